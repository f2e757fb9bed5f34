"""Context parallelism costs nothing of its own: counts of ops and bytes, never timings.

At world size 1 every topology must be the one-device call: one kernel forward (and one backward)
and nothing else but the lse's conversion for flex's backward op (ring, all-gather, hybrid). The
counts come from scripts/cp_profile.py's CallCost on gloo ranks with the reference kernel, whose own
work is not counted (on a GPU it is one flex kernel). The gradient and output accumulators are
checked against the float32 accumulator they replace (zero-filled, added into in order, cast once):
bit for bit, since they add the same numbers in the same order.
"""

from __future__ import annotations

import hashlib
import pathlib
import random
import subprocess
import sys

import pytest
import torch

from attngym.distributed.call.accumulate import HELD, Accumulator, GradSum
from attngym.distributed.ranks.launch import launch

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
    flex's op. On zigzag a ring step is one call over the shard's two chunks: the ring holds the
    steps' partials of the whole shard and adds them up once, eager (as here) through a float32
    sum of the shard, where the all-gather writes its bf16 out once (compiled, on CUDA, one
    kernel writes the bf16 out from the partials). On CUDA the all-gather's
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
                    # ring adds the held partials up in a float32 sum of the shard
                    slack += (seq_len // world_size) * 2 * 16 * 4
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
    for _ in range(rng.randint(1, 2 * HELD)):  # past HELD: added up in groups, in order
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


def test_compiled_gradsum_writes_bands_into_a_kernel_output_that_shares_its_storage():
    """dq, dk and dv of one kernel in one storage. The compiled sums (fused, as on CUDA; here
    Inductor's CPU code) write a band's sum into that dq, and a home band into dk, and leave
    the other gradients alone. Passing the band both as a piece and as the output view made
    the compiled call raise."""
    gen = torch.Generator().manual_seed(0)
    shape = (1, 2, 64, 8)
    for fused in (False, True):
        grads = torch.randn(3, *shape, generator=gen).bfloat16()  # dq, dk, dv of one kernel
        before, (dq_i, dk_i, _) = grads.clone(), grads.unbind()
        band, home = torch.randn(1, 2, 16, 8, generator=gen).bfloat16(), torch.randn(1, 2, 8, 8)
        dq = GradSum(shape, torch.float32, "cpu", fused=fused)
        dq.add(8, band)  # the received rows' piece first, as the overlapped all-gather adds it
        dq.add(0, dq_i)
        dk = GradSum(shape, torch.float32, "cpu", fused=fused)
        dk.add(0, dk_i)
        dk.add(40, home, fresh=False, last=True)  # what comes home, into the kept rows
        assert dq.total(torch.bfloat16) is dq_i and dk.total(torch.bfloat16) is dk_i
        want = before.float()
        want[0, :, :, 8:24] += band.float()
        want[1, :, :, 40:48] += home
        # dv untouched; each band's sum exact in float32, rounded once
        assert torch.equal(grads, want.bfloat16())


def _float64_merge(shape, partials):
    """The float64 merge of partials over rows 0.. of a (1, 2, n, 4) shard: (out, lse)."""
    out, lse = torch.zeros(shape, dtype=torch.float64), torch.full(shape[:3], float("-inf"))
    lse = lse.double()
    for out_i, lse_i in partials:
        m = out_i.shape[2]
        new = torch.logaddexp(lse[:, :, :m], lse_i.double())
        w_old = torch.nan_to_num(torch.exp(lse[:, :, :m] - new))
        w_new = torch.nan_to_num(torch.exp(lse_i.double() - new))
        out[:, :, :m] = out[:, :, :m] * w_old[..., None] + out_i.double() * w_new[..., None]
        lse[:, :, :m] = new
    return out, lse


@pytest.mark.parametrize("count", [2, HELD, HELD + 3])
def test_accumulator_merges_held_partials_in_one_pass_as_float64_does(count):
    gen = torch.Generator().manual_seed(count)
    q = torch.randn(1, 2, 16, 4, generator=gen).bfloat16()
    partials = [
        (torch.randn(1, 2, 8, 4, generator=gen).bfloat16(), 3 * torch.randn(1, 2, 8, generator=gen))
        for _ in range(count)
    ]
    for j in range(count):  # rows some pairs do not reach; row 7 none at all
        partials[j][1][0, 0, 7] = float("-inf")
    partials[1][1][0, 1, :3] = float("-inf")
    acc = Accumulator(q, 4)
    for out_i, lse_i in partials:
        acc.add(slice(0, 8), out_i, lse_i)
        assert all(held <= HELD for *_, held in acc.held())
    out, lse = acc.result()
    want_out, want_lse = _float64_merge((1, 2, 16, 4), partials)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    torch.testing.assert_close(lse, want_lse.float(), rtol=1e-6, atol=1e-6)  # -inf included
    torch.testing.assert_close(out.double(), want_out, rtol=8e-3, atol=8e-3)  # bf16 rounding
    assert (out[:, :, 8:] == 0).all() and torch.isneginf(lse[:, :, 8:]).all()  # no pair here
    assert (out[0, 0, 7] == 0).all() and not out.isnan().any()


def test_accumulator_hands_a_single_partial_back_unchanged():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 16, 4, generator=gen).bfloat16()
    acc = Accumulator(q, 4)
    kept = torch.randn(1, 2, 16, 4, generator=gen).bfloat16()
    acc.add(slice(0, 16), kept, torch.randn(1, 2, 16, generator=gen))
    assert acc.result()[0] is kept  # world size 1: the kernel's own output


def test_nccl_on_fewer_gpus_than_ranks_is_a_skip_with_its_reason():
    reason = skip_reason("nccl", 2, n_gpu=1)
    assert reason is not None and "one GPU per rank" in reason and "2 ranks" in reason
    assert skip_reason("nccl", 2, n_gpu=2) is None
    assert skip_reason("nccl", 4, n_gpu=2) is not None
    assert skip_reason("copy_engine", 2, n_gpu=1) is None  # shares a GPU when allowed
    assert "nccl" in transports()  # collected everywhere, so the skip says why


def _one_rank_parity_worker(rank, world_size):
    """Each topology at world size 1 against the float64 reference: the max error of out, dq,
    dk, dv per case, and a digest of the call's and the reference's bits (the same in every
    process, or something reads or rounds differently from run to run)."""
    from attngym import reference, registry, variants

    gen = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(1, 4, 96, 8, generator=gen, dtype=torch.float64) for _ in range(4))
    errors, bits = {}, hashlib.sha256()
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
            for t in (*got, *want):
                bits.update(t.detach().numpy().tobytes())
    return errors, bits.hexdigest()


def test_every_topology_at_world_size_1_matches_the_reference():
    """float64 through the float64 reference kernel: the call and the whole-sequence reference
    differ by the order of a few sums at most; 1e-10 is far above that, far below a real bug."""
    errors, _ = launch(_one_rank_parity_worker, 1, timeout_s=300)
    assert len(errors) == 8
    for case, errs in errors.items():
        assert max(errs) < 1e-10, (case, errs)


@pytest.mark.slow
def test_the_parity_is_bit_identical_in_every_fresh_process_beside_a_busy_one():
    """The same inputs give the same bits in every process. A process's first parallel call of
    one of MKL's vector math functions could run one thread's chunk through a low-accuracy kernel
    (attngym.device.settle_cpu_math): `exp` off by ~1e-9 in about one fresh process in ten, more
    often under load. Fresh rank processes, with a busy one beside them for the load."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        runs = [launch(_one_rank_parity_worker, 1, timeout_s=300) for _ in range(12)]
    finally:
        busy.kill()
        busy.wait()
    assert len({digest for _, digest in runs}) == 1
    for errors, _ in runs:
        assert max(max(errs) for errs in errors.values()) < 1e-10, errors
