"""Context parallelism costs nothing of its own: counts of ops and bytes, never timings.

At world size 1 every topology must be the one-device call: one kernel forward (and one backward)
and nothing else but the lse's conversion for flex's backward op (ring, all-gather, hybrid). The
counts come from scripts/cp_profile.py's CallCost on gloo ranks with the reference kernel, whose own
work is not counted (on a GPU it is one flex kernel). The gradient and output accumulators are
checked against the float32 accumulator they replace (zero-filled, added into in order, cast once):
bit for bit, since they add the same numbers in the same order.
"""

from __future__ import annotations

import pathlib
import random

import pytest
import torch

from attngym.distributed.cp import Accumulator, GradSum
from attngym.distributed.launch import launch
from attngym.distributed.merge import merge_into

from .gpu_ranks import skip_reason, transports

SCRIPTS = pathlib.Path(__file__).resolve().parents[2] / "scripts"
S = 512


def _costs_worker(rank, world_size, cases, layout, seq_len, window):
    """CallCost reports of each (kind, variant, options) case, one list per pass (a report per
    rank), from the same worker the script runs."""
    import cp_profile

    return {
        (kind, variant): cp_profile._cpu_worker(
            rank,
            world_size,
            kind,
            seq_len,
            layout,
            2,
            variant,
            "auto",
            options,
            16,
            window,
            "bfloat16",
        )  # fmt: skip
        for kind, variant, options in cases
    }


def _costs(monkeypatch, world_size, cases, layout="contiguous", seq_len=S, window=64):
    monkeypatch.syspath_prepend(str(SCRIPTS))  # the spawned ranks start with this sys.path
    args = (cases, layout, seq_len, window)
    return launch(_costs_worker, world_size, args=args, timeout_s=300)


HYBRID = {"a2a_size": None, "across": "ring"}


def test_every_topology_at_world_size_1_is_one_kernel_call_and_nothing_else(monkeypatch):
    cases = [(kind, "sliding_window", {}) for kind in ("ring", "allgather", "ulysses")]
    cases += [("hybrid", "sliding_window", HYBRID), ("ring", "document", {})]
    got = _costs(monkeypatch, 1, cases)
    for case, passes in got.items():
        fwd, fwd_bwd = passes["fwd"][0], passes["fwd_bwd"][0]
        assert fwd["kernel_calls"] == 1 and fwd_bwd["kernel_calls"] == 2, (case, passes)
        assert fwd["ops"] == {}, (case, fwd)
        # flex's backward op reads the lse in base 2: converted once (a B·H·S multiply); Ulysses
        # differentiates the kernel call itself.
        allowed = {"mul": 1} if case[0] in ("ring", "hybrid", "allgather") else {}
        assert fwd_bwd["ops"] == allowed, (case, fwd_bwd)
    # Memory: exactly the kernel's outputs, the one-device call's: out, lse, then dq, dk, dv.
    elem = 2 * 1 * 2 * S * 16  # one bf16 (B=1, H=2, S, D=16) tensor, bytes
    for case, passes in got.items():
        assert passes["fwd"][0]["alloc_bytes"] == elem + 4 * 2 * S, case
        assert passes["fwd_bwd"][0]["peak_bytes"] <= 4 * elem + 2 * 4 * 2 * S, case


def test_ring_allocates_no_more_than_the_allgather_at_one_and_two_ranks(monkeypatch):
    """Peak bytes a call adds, the largest rank's, for a local mask (the ring moves a halo) and
    causal (whole shards): the ring's float32 sums exist only where pieces meet.

    Slack in the backward: two (B, H, S/P) float32, the lse the ring saves and its base-2 copy for
    flex's op. On zigzag a ring step is one call over the shard's two chunks, summed in a float32
    out of the whole shard where the all-gather writes its bf16 out once. On CUDA the all-gather's
    compiled flex holds as much (it saves its lse, and its backward allocates a zero lse gradient),
    which this count cannot see: both lie inside the reference kernel here. For the window both move
    exactly the halo, so the ring may also hold its second receive slot: two (K, V) halos (the
    all-gather receives one), and its backward the halo's rows it kept from the forward (its
    first step waits for no transfer): one (K, V) block of 128 rows.
    """
    # zigzag at 2048 tokens, window 128: a halo pair whose q chunk reads only a band of it
    for world_size, layout, seq_len, window in (
        (1, "contiguous", S, 64),
        (2, "contiguous", S, 64),
        (2, "zigzag", 2048, 128),
    ):
        lse_bytes = 4 * 2 * seq_len // world_size
        cases = [(k, v, {}) for k in ("ring", "allgather") for v in ("sliding_window", "causal")]
        got = _costs(monkeypatch, world_size, cases, layout, seq_len, window)
        for variant in ("sliding_window", "causal"):
            for name in ("fwd", "fwd_bwd"):
                ring, gather = (
                    max(r["peak_bytes"] for r in got[kind, variant][name])
                    for kind in ("ring", "allgather")
                )
                slack = 2 * lse_bytes if name == "fwd_bwd" else 0
                if variant == "sliding_window" and world_size > 1:
                    slack += 2 * (2 * 2 * window * 16 * 2)  # two slots of K, V: H=2, D=16, bf16
                    if name == "fwd_bwd":
                        slack += 2 * 2 * 128 * 16 * 2  # the rows kept from the forward
                if layout == "zigzag":  # a step's one call spans the shard's two chunks: the
                    # ring sums it in a float32 out of the shard (the all-gather's is bf16)
                    slack += (seq_len // world_size) * 2 * 16 * (4 - 2)
                assert ring <= gather + slack, (world_size, layout, variant, name, ring, gather)
    # The halo pairs' gradients cover their bands: the ring's backward below the all-gather's
    # with no slack (before each returned whole-chunk pieces: 528 against 448 KB).
    ring, gather = (max(r["peak_bytes"] for r in got[k, "sliding_window"]["fwd_bwd"])
                    for k in ("ring", "allgather"))  # fmt: skip
    assert ring <= gather, (ring, gather)


def _old_sum(shape, pieces, dtype):
    """The accumulator GradSum replaces: zeros in float32, each piece added in order, one cast."""
    acc = torch.zeros(shape, dtype=torch.float32)
    for start, piece, _ in pieces:
        acc.narrow(-2, start, piece.shape[-2]).add_(piece)
    return acc.to(dtype)


@pytest.mark.parametrize("seed", range(20))
def test_gradsum_equals_the_zero_filled_float32_accumulator_bit_for_bit(seed):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    n = 24
    shape = (1, 2, n, 4)
    pieces = []
    for _ in range(rng.randint(1, 6)):
        start = rng.randrange(n)
        rows = rng.randint(1, n - start)
        fresh = rng.random() < 0.7  # a kernel's output (bf16), else a received float32 slot
        dtype = torch.bfloat16 if fresh else torch.float32
        pieces.append((start, torch.randn(1, 2, rows, 4, generator=gen).to(dtype), fresh))
    want = _old_sum(shape, pieces, torch.bfloat16)
    sums = GradSum(shape, torch.float32, "cpu")
    for start, piece, fresh in pieces:
        sums.add(start, piece, fresh=fresh)
        if not fresh:
            piece.fill_(1e6)  # a slot released and overwritten: the sum kept none of it
    assert torch.equal(sums.total(torch.bfloat16), want)


def test_gradsum_hands_a_single_whole_piece_back_and_writes_bands_into_it():
    gen = torch.Generator().manual_seed(0)
    whole = torch.randn(1, 2, 16, 4, generator=gen).bfloat16()
    kernel_out = whole.clone()
    sums = GradSum(whole.shape, torch.float32, "cpu")
    sums.add(0, whole)
    assert sums.total(torch.bfloat16) is whole  # world size 1: no copy, no cast
    band = torch.randn(1, 2, 4, 4, generator=gen)
    want = _old_sum(whole.shape, [(0, kernel_out, True), (10, band, False)], torch.bfloat16)
    sums = GradSum(whole.shape, torch.float32, "cpu")
    sums.add(0, whole)
    sums.add(10, band, fresh=False)  # a halo's dK/dV coming home
    got = sums.total(torch.bfloat16)
    assert got is whole and torch.equal(got, want)  # the band written in place, nothing else
    # The last piece over a band (dK/dV coming home): rounded into the kept rows at once.
    whole = kernel_out.clone()
    sums = GradSum(whole.shape, torch.float32, "cpu")
    sums.add(0, whole)
    sums.add(10, band, fresh=False, last=True)
    got = sums.total(torch.bfloat16)
    assert got is whole and torch.equal(got, want)
    empty = GradSum((1, 2, 8, 4), torch.float32, "cpu")
    assert torch.equal(empty.total(torch.float32), torch.zeros(1, 2, 8, 4))  # no piece: zeros


def test_accumulator_keeps_a_single_partial_and_merges_two_as_before():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 16, 4, generator=gen).bfloat16()
    partials = [
        (torch.randn(1, 2, 8, 4, generator=gen).bfloat16(), torch.randn(1, 2, 8, generator=gen))
        for _ in range(3)
    ]
    partials[1][1][0, 0, :3] = float("-inf")  # rows the second pair does not reach
    # Old: zeros and -inf over the shard, every partial merged in, cast once. Rows 8.. of the
    # shard get no partial here (out 0, lse -inf), rows 0..7 two.
    old_out = torch.zeros(1, 2, 16, 4)
    old_lse = torch.full((1, 2, 16), float("-inf"))
    acc = Accumulator(q, 4)
    for out_i, lse_i in partials[:2]:
        merge_into(old_out[:, :, :8], old_lse[:, :, :8], out_i, lse_i)
        acc.add(slice(0, 8), out_i.clone(), lse_i.clone())
    out, lse = acc.result()
    assert torch.equal(out, old_out.bfloat16()) and torch.equal(lse, old_lse)
    # Told that rows 0..7 meet two pairs, the accumulator casts the first partial at once.
    acc = Accumulator(q, 4, expected={(0, 8): 2})
    for out_i, lse_i in partials[:2]:
        acc.add(slice(0, 8), out_i.clone(), lse_i.clone())
    assert acc._chunks[0, 8][0].dtype == torch.float32
    out, lse = acc.result()
    assert torch.equal(out, old_out.bfloat16()) and torch.equal(lse, old_lse)
    acc = Accumulator(q, 4)
    acc.add(slice(0, 16), partials[2][0].repeat(1, 1, 2, 1), partials[2][1].repeat(1, 1, 2))
    kept = acc._chunks[0, 16][0]
    assert acc.result()[0] is kept  # world size 1: the kernel's own output


def test_nccl_on_fewer_gpus_than_ranks_is_a_skip_with_its_reason():
    reason = skip_reason("nccl", 2, n_gpu=1)
    assert reason is not None and "one GPU per rank" in reason and "2 ranks" in reason
    assert skip_reason("nccl", 2, n_gpu=2) is None
    assert skip_reason("nccl", 4, n_gpu=2) is not None
    assert skip_reason("copy_engine", 2, n_gpu=1) is None  # shares a GPU when allowed
    assert "nccl" in transports()  # collected everywhere, so the skip says why


def _one_rank_parity_worker(rank, world_size):
    """Each topology at world size 1 against the float64 reference: out, dq, dk, dv."""
    from attngym import reference, registry, variants

    gen = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(1, 4, 96, 8, generator=gen, dtype=torch.float64) for _ in range(4))
    errors = {}
    for name, variant in (
        ("sliding_window", variants.get("sliding_window", window_size=20)),
        ("document", variants.get("document", doc_lengths=[40, 56])),
    ):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        want, _ = reference.attention(*leaves, variant.score_mod, variant.mask_mod)
        want = [want, *torch.autograd.grad(want, leaves, dout)]
        for kind, options in (("ring", {}), ("allgather", {}), ("ulysses", {}), ("hybrid", HYBRID)):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out = registry.get("topology", kind).attention(*leaves, variant, **options)
            got = [out, *torch.autograd.grad(out, leaves, dout)]
            errors[kind, name] = [
                (g - w).abs().max().item() for g, w in zip(got, want, strict=True)
            ]
    return errors


def test_every_topology_at_world_size_1_matches_the_reference():
    """float64 through the float64 reference kernel: the call and the whole-sequence reference
    differ by the order of a few sums at most; 1e-10 is far above that, far below a real bug."""
    errors = launch(_one_rank_parity_worker, 1, timeout_s=300)
    assert len(errors) == 8
    for case, errs in errors.items():
        assert max(errs) < 1e-10, (case, errs)
