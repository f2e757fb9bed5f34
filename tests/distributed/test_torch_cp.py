"""PyTorch's own flex context parallelism (torch_cp): layout mapping, argument checks, parity.

PyTorch's flex CP runs on CPU ranks (gloo) forward only: flex has no CPU backward. So the CPU test
checks the forward against the float64 reference and against attngym's ring_attention on the same
shards; forward and backward are checked on two GPUs (multigpu).
"""

from __future__ import annotations

import functools

import pytest
import torch

from attngym import reference, variants
from attngym.distributed.placement import layout as layouts
from attngym.distributed.ranks.launch import launch
from attngym.distributed.schemes import torch_cp
from attngym.distributed.schemes.ring import ring_attention

S = 256  # the smallest sequence PyTorch's CP runs on 2 ranks: 2 x its 128-token mask blocks


def _cases():
    return {
        "causal": variants.get("causal"),
        # A mask and a position-dependent score_mod: both must see global positions. The softcap
        # after alibi matters: alibi alone is linear in q_idx, so softmax would cancel a wrong
        # query offset.
        "sliding_window+alibi+softcap": variants.compose(
            variants.get("sliding_window", window_size=40),
            variants.get("alibi", num_heads=4),
            variants.get("softcap", soft_cap=2.0),
        ),
    }


def test_torch_cp_is_available_on_this_torch():
    assert torch_cp.torch_cp_available() == (True, "")


def test_torch_cp_unavailable_names_the_reason(monkeypatch):
    def missing():
        raise ImportError("cannot import name '_ContextParallel'")

    monkeypatch.setattr(torch_cp, "_api", missing)
    ok, why = torch_cp.torch_cp_available()
    assert not ok
    assert torch.__version__ in why and "_ContextParallel" in why


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_zigzag_is_pytorchs_head_tail_balancer(world_size):
    from torch.distributed.tensor.experimental._context_parallel import _HeadTailLoadBalancer

    seq_len = 2 * world_size * 5
    positions = _HeadTailLoadBalancer(seq_len, world_size, "cpu")._generate_indices()[0]
    want = torch.cat(
        [
            torch.arange(off, off + n)
            for r in range(world_size)
            for off, n in layouts.chunks(r, world_size, seq_len, "zigzag")
        ]
    )
    assert torch.equal(positions.long(), want)
    assert torch_cp.torch_layout("zigzag") == "zigzag"
    assert torch_cp.torch_layout("contiguous") == "contiguous"


def test_torch_layout_rejects_unknown_layouts():
    with pytest.raises(ValueError, match="unknown layout 'zigzig'.*did you mean 'zigzag'"):
        torch_cp.torch_layout("zigzig")


def test_check_shape_needs_world_size_times_128():
    torch_cp.check_shape(256, 2, "zigzag")
    torch_cp.check_shape(384, 3, "contiguous")
    with pytest.raises(ValueError, match=r"seq_len=192 must be divisible by world_size x 128"):
        torch_cp.check_shape(192, 2, "contiguous")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"block_size": (64, 64)}, r"block_size must be \(128, 128\)"),
        ({"heads": 0}, "heads must be a positive integer"),
        ({"kv_heads": 3}, r"kv_heads \(3\) must divide heads \(4\)"),
    ],
)
def test_torch_cp_rejects_bad_arguments_before_any_collective(kwargs, match):
    args = {"batch": 1, "heads": 4, "kv_heads": 2, "seq_len": S} | kwargs
    with pytest.raises(ValueError, match=match):
        torch_cp.TorchCP(variants.get("causal"), **args)


@pytest.mark.parametrize("kwargs", [{"backward": "recompute"}, {"backend": "reference"}])
def test_torch_cp_attention_refuses_choices_it_cannot_honour(kwargs):
    x = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match="backward, backend: PyTorch's CP runs compiled flex"):
        torch_cp.torch_cp_attention(x, x, x, variants.get("causal"), **kwargs)


def _gather(t, world_size, layout, variant=None):
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(world_size)]
    dist.all_gather(parts, t.detach().contiguous())
    return layouts.unshard(parts, layout, variant=variant)


def _forward_worker(rank, world_size):
    from torch.distributed.tensor.experimental._context_parallel import _attention
    from torch.nn.attention.flex_attention import create_block_mask

    # PyTorch builds its CP block mask with a torch.compile'd create_block_mask (~20 s per
    # variant on CPU); the eager one computes the same mask, so the test uses it.
    _attention._compiled_create_block_mask = create_block_mask
    gen = torch.Generator().manual_seed(3)
    errors = {}
    for name, variant in _cases().items():
        kv_heads = 2 if name == "causal" else 4  # GQA on one case
        q = torch.randn(1, 4, S, 16, generator=gen, dtype=torch.float64)
        k, v = (torch.randn(1, kv_heads, S, 16, generator=gen, dtype=torch.float64) for _ in "kv")
        want, _ = reference.attention(q, k, v, variant.score_mod, variant.mask_mod)
        # balanced: PyTorch has no such placement, so the shards are resharded to zigzag and back.
        for layout in ("contiguous", "zigzag", "balanced"):
            q_s, k_s, v_s = (
                layouts.shard(t, rank, world_size, layout, variant=variant) for t in (q, k, v)
            )
            with torch.no_grad():
                out = torch_cp.torch_cp_attention(q_s, k_s, v_s, variant, layout=layout)
                ring = ring_attention(q_s, k_s, v_s, variant, layout=layout, transport="gloo")
            errors[(name, layout)] = (
                (_gather(out, world_size, layout, variant) - want).abs().max().item(),
                (out - ring).abs().max().item(),
            )
    # reshard: contiguous -> zigzag shards, and the gradient back. Each position's weight is its
    # index, so a gradient routed to the wrong position shows.
    x = torch.randn(1, 2, S, 4, generator=gen, dtype=torch.float64)
    weight = torch.arange(S, dtype=torch.float64).view(1, 1, S, 1).expand(x.shape)
    x_s = layouts.shard(x, rank, world_size, "contiguous").requires_grad_()
    moved = torch_cp.reshard(x_s, "contiguous", "zigzag")
    (moved * layouts.shard(weight, rank, world_size, "zigzag")).sum().backward()
    resharded = torch.equal(moved, layouts.shard(x, rank, world_size, "zigzag")) and torch.equal(
        x_s.grad, layouts.shard(weight, rank, world_size, "contiguous")
    )
    return errors, resharded


def test_torch_cp_forward_matches_reference_and_ring_on_cpu():
    """Float64 in, eager flex in float64: errors are a few ulp of O(1) values; 1e-10 is far above
    that and far below a wrong global position (errors of order 1e-1)."""
    errors, resharded = launch(_forward_worker, 2, timeout_s=120)
    assert resharded, "reshard moved values or gradients to the wrong positions"
    assert len(errors) == 2 * 3
    for case, (vs_reference, vs_ring) in errors.items():
        assert vs_reference < 1e-10, f"{case}: max |torch_cp - reference| = {vs_reference}"
        assert vs_ring < 1e-10, f"{case}: max |torch_cp - ring_attention| = {vs_ring}"


def _block_mask_worker(rank, world_size):
    """attngym's build of torch_cp's BlockMask against PyTorch's _create_cp_block_mask."""
    from torch.distributed.tensor.experimental._context_parallel import (
        _attention,
        _HeadTailLoadBalancer,
    )
    from torch.nn.attention.flex_attention import create_block_mask

    _attention._compiled_create_block_mask = create_block_mask  # eager: the same mask, no compile
    seq, same = 1024, {}
    for name, variant in {
        "causal": variants.get("causal"),
        "sliding_window": variants.get("sliding_window", window_size=100),
        "document": variants.get("document", doc_lengths=[300, 724]),
        "sliding_window+alibi+softcap": _cases()["sliding_window+alibi+softcap"],
    }.items():
        for layout in ("contiguous", "zigzag"):
            ours = torch_cp.TorchCP(variant, batch=1, heads=4, kv_heads=4, seq_len=seq,
                                    layout=layout)  # fmt: skip
            balancer = (
                _HeadTailLoadBalancer(seq, world_size, torch.device("cpu"))
                if layout == "zigzag"
                else None
            )
            before = _attention._cp_options.enable_load_balance
            _attention._cp_options.enable_load_balance = balancer is not None
            try:
                theirs = _attention._create_cp_block_mask(
                    variant.mask_mod, 1, 1, seq, seq, ours.mesh, balancer
                )
            finally:
                _attention._cp_options.enable_load_balance = before
            same[(name, layout)] = all(
                torch.equal(getattr(ours.block_mask, f), getattr(theirs, f))
                for f in (
                    "kv_num_blocks",
                    "full_kv_num_blocks",
                    "q_num_blocks",
                    "full_q_num_blocks",
                )
            ) and torch.equal(ours.block_mask.to_dense(), theirs.to_dense())
    return same


def test_torch_cp_block_mask_is_pytorchs():
    """torch_cp's BlockMask, built by attngym (from the block rule where the variant has one), has
    exactly the blocks PyTorch's _create_cp_block_mask gives, on every rank and layout."""
    same = launch(_block_mask_worker, 2, timeout_s=120)
    assert len(same) == 4 * 2
    assert all(same.values()), [case for case, ok in same.items() if not ok]


def _fwd_bwd(fn, shards, dout_s):
    q_s, k_s, v_s = (t.clone().requires_grad_() for t in shards)
    out = fn(q_s, k_s, v_s)
    out.backward(dout_s)
    return [out, q_s.grad, k_s.grad, v_s.grad]


def _cuda_worker(rank, world_size):
    """Forward and backward of a TorchCP built once and called twice (as a benchmark does)."""
    device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator().manual_seed(0)
    seq_len = 1024
    q = torch.randn(1, 4, seq_len, 64, generator=gen).to(device)
    k, v = (torch.randn(1, 2, seq_len, 64, generator=gen).to(device) for _ in "kv")
    dout = torch.randn(q.shape, generator=gen).to(device)
    cases = _cases() | {"document": variants.get("document", doc_lengths=[300, 500, 224])}
    errors = {}
    for name, variant in cases.items():
        variant = variant.to(device)
        qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
        want, _ = reference.attention(qr, kr, vr, variant.score_mod, variant.mask_mod)
        want.backward(dout.double())
        for layout in ("contiguous", "zigzag"):
            cp = torch_cp.TorchCP(
                variant, batch=1, heads=4, kv_heads=2, seq_len=seq_len, layout=layout, device=device
            )
            shards = [layouts.shard(t, rank, world_size, layout) for t in (q, k, v)]
            dout_s = layouts.shard(dout, rank, world_size, layout)
            _fwd_bwd(cp, shards, dout_s)  # the first call compiles; the second is checked
            mine = _fwd_bwd(cp, shards, dout_s)
            ring = _fwd_bwd(
                functools.partial(ring_attention, variant=variant, layout=layout, transport="nccl"),
                shards,
                dout_s,
            )
            rel = []
            for got, theirs, ref in zip(mine, ring, (want, qr.grad, kr.grad, vr.grad), strict=True):
                whole = _gather(got, world_size, layout).double()
                rel.append(((whole - ref).norm() / ref.norm()).item())
                rel.append(((got - theirs).double().norm() / theirs.double().norm()).item())
            errors[(name, layout)] = rel
    return errors


@pytest.mark.multigpu
def test_torch_cp_forward_backward_match_reference_and_ring_on_two_gpus():
    """Float32 in, flex in float32 (TF32 off): ~1e-5 relative to the float64 reference; 2e-3
    leaves room for flex's accumulation order (as in test_cp_gpu), far below a wrong position."""
    errors = launch(_cuda_worker, 2, device="cuda", timeout_s=300)
    assert len(errors) == 3 * 2
    for case, rel in errors.items():
        assert max(rel) < 2e-3, (
            f"{case}: relative errors (vs reference, vs ring) of out, dq, dk, dv = {rel}"
        )
