"""Head-parallel (Ulysses) and hybrid attention on CPU ranks (gloo) against the float64 reference.

One spawn per test runs every case. Inputs are float64 and the attention kernel is the float64
reference (the CPU backend), so the only differences from the whole-sequence reference are the
order of a few sums: a few ulp of O(1) values. 1e-10 is far above that and far below any real bug
(a head offset off by one changes ALiBi's slopes by a factor 2^(-8/H); a misplaced chunk or a
wrong K/V head gives errors of order 1e-2 or more).
"""

from __future__ import annotations

import pytest
import torch

from attngym import reference, variants
from attngym.distributed import (
    CPOptions,
    CPStats,
    check_ulysses_heads,
    hybrid_attention,
    shard,
    ulysses_attention,
)
from attngym.distributed.ranks.launch import launch

from .catalogue import HEADS, PARAMS

TOL = 1e-10
LAYOUTS = ("contiguous", "zigzag")
S = 32


def _whole(t, world_size, layout, group=None):
    import torch.distributed as dist

    from attngym.distributed import unshard

    parts = [torch.empty_like(t) for _ in range(world_size)]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    return unshard(parts, layout)


def _errors(fn, rank, world_size, variant, kv_heads, layout, seed, **kwargs):
    """max |err| of out, dq, dk, dv of `fn` against the whole-sequence reference."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, HEADS, S, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(1, kv_heads, S, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(q.shape, generator=gen, dtype=torch.float64)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    want_out, _ = reference.attention(qr, kr, vr, variant.score_mod, variant.mask_mod)
    want_out.backward(dout)
    q_s, k_s, v_s = (shard(t, rank, world_size, layout).requires_grad_() for t in (q, k, v))
    out = fn(q_s, k_s, v_s, variant, layout=layout, transport="gloo", **kwargs)
    out.backward(shard(dout, rank, world_size, layout))
    got = [out, q_s.grad, k_s.grad, v_s.grad]
    want = [want_out, qr.grad, kr.grad, vr.grad]
    return [
        (_whole(g, world_size, layout) - w).abs().max().item()
        for g, w in zip(got, want, strict=True)
    ]


def _ulysses_worker(rank, world_size):
    errors = {}
    for n, name in enumerate(variants.names()):
        variant = variants.get(name, **PARAMS[name])
        kv_heads = (4, 2, 1)[n % 3]  # in turn: MHA; GQA split (2 >= P); replicated (1 < P)
        for layout in ("contiguous", "zigzag"):
            errors[(name, kv_heads, layout)] = _errors(
                ulysses_attention, rank, world_size, variant, kv_heads, layout, n
            )
    errors[("document", 2, "double_zigzag")] = _errors(  # four pieces a rank, one call
        ulysses_attention, rank, world_size, variants.get("document", **PARAMS["document"]), 2,
        "double_zigzag", 98,
    )  # fmt: skip
    try:  # 3 heads over 2 ranks: refused before any exchange, on every rank alike
        x = torch.randn(1, 3, S // world_size, 8, dtype=torch.float64)
        ulysses_attention(x, x, x, variants.get("causal"), transport="gloo")
        refused = None
    except ValueError as e:
        refused = str(e)
    return errors, refused


def test_ulysses_matches_reference_for_every_variant_fwd_bwd():
    assert sorted(PARAMS) == variants.names(), "give every catalogue variant its test parameters"
    errors, refused = launch(_ulysses_worker, 2, timeout_s=120)
    assert len(errors) == len(PARAMS) * 2 + 1
    bad = {case: errs for case, errs in errors.items() if max(errs) >= TOL}
    assert bad == {}, f"max |err| of out, dq, dk, dv: {bad}"
    assert refused is not None and refused.startswith("heads: 3 query heads"), refused


def _rounds_worker(rank, world_size):
    """pipeline=True for every variant, in turn on zigzag (two rounds) and double_zigzag (four),
    MHA, GQA split and K/V heads replicated, each backward choice; its pairs counted; contiguous
    refused."""
    errors, pairs = {}, {}
    for n, name in enumerate(variants.names()):
        variant = variants.get(name, **PARAMS[name])
        kv_heads = (4, 2, 1)[n % 3]
        backward = ("auto", "flex", "recompute")[n % 3]
        layout = ("zigzag", "double_zigzag")[n % 2]
        stats = CPStats()
        errors[(name, kv_heads, backward, layout)] = _errors(
            ulysses_attention, rank, world_size, variant, kv_heads, layout, n, pipeline=True,
            backward=backward, stats=stats,
        )  # fmt: skip
        pairs[name] = (layout, stats.pairs_computed)
    # kernel options (a dict) reach the rounds' calls as the one call's
    errors[("causal", 4, "kernel_options")] = _errors(
        ulysses_attention, rank, world_size, variants.get("causal"), 4, "zigzag", 99,
        pipeline=True, options=CPOptions(kernel_options={"BLOCK_M": 16}, backward="recompute"),
    )  # fmt: skip
    x = torch.randn(1, HEADS, S // world_size, 8, dtype=torch.float64)
    try:
        ulysses_attention(x, x, x, variants.get("causal"), transport="gloo", pipeline=True)
        refused = None
    except ValueError as e:
        refused = str(e)
    return errors, pairs, refused


def test_ulysses_in_rounds_matches_reference_for_every_variant_fwd_bwd():
    errors, pairs, refused = launch(_rounds_worker, 2, timeout_s=180)
    bad = {case: errs for case, errs in errors.items() if max(errs) >= TOL}
    assert bad == {}, f"max |err| of out, dq, dk, dv: {bad}"
    # a causal mask reads no later round's keys (one call a round); full attention reads every
    # later round's: 2 + 1 calls in two rounds, 4 + 3 + 2 + 1 in four
    calls = {"zigzag": {"causal": 2, "full": 3}, "double_zigzag": {"causal": 4, "full": 10}}
    assert all(pairs[name][1] == calls[pairs[name][0]][name] for name in ("causal", "full")), pairs
    assert refused is not None and refused.startswith("layout: pipeline=True"), refused


def _options_worker(rank, world_size):
    """ulysses_attention with options=CPOptions(...) and with the same fields as keywords; then
    a backward choice, which ulysses has nothing to act on, as an option and as a keyword."""
    gen = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, HEADS, S // world_size, 8, generator=gen) for _ in range(3))
    variant = variants.get("alibi", num_heads=HEADS)
    fields = {"backend": "reference", "scale": 0.3, "block_size": (16, 16), "timeout_s": 30.0}
    by_options = ulysses_attention(q, k, v, variant, transport="gloo", options=CPOptions(**fields))
    by_keywords = ulysses_attention(q, k, v, variant, transport="gloo", **fields)
    default = ulysses_attention(q, k, v, variant, transport="gloo", backend="reference")
    refused = []
    for how in ({"options": CPOptions(backward="recompute")}, {"backward": "flex"}):
        try:
            ulysses_attention(q, k, v, variant, transport="gloo", **how)
            refused.append(None)
        except ValueError as e:
            refused.append(str(e))
    return torch.equal(by_options, by_keywords), torch.equal(by_options, default), refused


def test_ulysses_options_object_equals_keywords_and_refuses_backward():
    same, same_as_default, refused = launch(_options_worker, 2, timeout_s=60)
    assert same  # one CPOptions either way: the very same computation
    assert not same_as_default  # the scale was honoured, not dropped
    assert [msg.split(";")[0] for msg in refused] == [
        "backward: ulysses_attention differentiates its one kernel call with autograd"
    ] * 2, refused


def _hybrid_worker(rank, world_size):
    cases = {
        "alibi": (variants.get("alibi", num_heads=HEADS), 4),
        "causal": (variants.get("causal"), 1),
        "sliding_window+softcap": (
            variants.compose(
                variants.get("sliding_window", window_size=6), variants.get("softcap", soft_cap=5.0)
            ),
            2,
        ),
    }
    errors = {}
    for n, (name, (variant, kv_heads)) in enumerate(cases.items()):
        # Each across algorithm meets each layout once per case, in turn (6 runs, not 12).
        for across, layout in (("ring", LAYOUTS[n % 2]), ("allgather", LAYOUTS[1 - n % 2])):
            errors[(name, across, layout)] = _errors(
                hybrid_attention,
                rank,
                world_size,
                variant,
                kv_heads,
                layout,
                n,
                a2a_size=2,
                across=across,
            )
    # An options object reaches the ring across the groups, backward choice included.
    stats = CPStats()
    errors[("causal", "ring", "contiguous", "recompute")] = _errors(
        hybrid_attention,
        rank,
        world_size,
        variants.get("causal"),
        2,
        "contiguous",
        len(cases),
        a2a_size=2,
        options=CPOptions(backward="recompute"),
        stats=stats,
    )
    errors.update(_subgroup_errors(rank))
    refused = []
    x = torch.randn(1, HEADS, S // world_size, 8, dtype=torch.float64)
    for bad in ({"a2a_size": 3}, {"a2a_size": 2, "across": "tree"}):
        try:
            hybrid_attention(x, x, x, variants.get("causal"), transport="gloo", **bad)
            refused.append(None)
        except ValueError as e:
            refused.append(str(e))
    return errors, refused, stats.backward


def _subgroup_errors(rank):
    """Hybrid attention within a subgroup of the job: two replicas of two ranks (as a data
    parallel x context parallel mesh makes), each on its own inputs; only a replica's members
    create its in-group and across-group groups."""
    import torch.distributed as dist

    replicas = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank calls new_group
    group, me = replicas[rank // 2], rank % 2
    variant = variants.get("causal")
    gen = torch.Generator().manual_seed(50 + rank // 2)
    q, dout = (torch.randn(1, HEADS, S, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(1, 2, S, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want_out, _ = reference.attention(*leaves, variant.score_mod, variant.mask_mod)
    want_out.backward(dout)
    errors = {}
    for a2a_size in (1, 2):
        q_s, k_s, v_s = (shard(t, me, 2, "zigzag").requires_grad_() for t in (q, k, v))
        out = hybrid_attention(
            q_s, k_s, v_s, variant, group=group, a2a_size=a2a_size, layout="zigzag",
            transport="gloo",
        )  # fmt: skip
        out.backward(shard(dout, me, 2, "zigzag"))
        errors[("causal", "subgroup", f"a2a_size={a2a_size}")] = [
            (_whole(got, 2, "zigzag", group) - want).abs().max().item()
            for got, want in zip(
                (out, q_s.grad, k_s.grad, v_s.grad),
                (want_out, *(t.grad for t in leaves)),
                strict=True,
            )
        ]
    return errors


def test_hybrid_matches_reference_at_four_ranks():
    errors, refused, backward = launch(_hybrid_worker, 4, timeout_s=180)
    assert backward == "recompute"
    assert refused == [
        "a2a_size: 3 does not divide the world size 4",
        "across: expected one of ring, allgather, got 'tree'",
    ]
    assert len(errors) == 3 * 2 + 1 + 2
    bad = {case: errs for case, errs in errors.items() if max(errs) >= TOL}
    assert bad == {}, f"max |err| of out, dq, dk, dv: {bad}"


@pytest.mark.parametrize(
    ("heads", "kv_heads", "world_size", "match"),
    [
        (6, None, 4, "heads: 6 query heads cannot be split over 4 ranks"),
        (8, 3, 2, "kv_heads: 3 must be a positive divisor of heads"),
    ],
)
def test_check_ulysses_heads_rejects(heads, kv_heads, world_size, match):
    with pytest.raises(ValueError, match=match):
        check_ulysses_heads(heads, kv_heads, world_size)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "world_size"), [(8, None, 4), (8, 2, 4), (8, 8, 2), (6, 3, 2), (4, 1, 4)]
)
def test_check_ulysses_heads_accepts(heads, kv_heads, world_size):
    check_ulysses_heads(heads, kv_heads, world_size)
