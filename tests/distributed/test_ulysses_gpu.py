"""Ulysses (one call, and in rounds) and hybrid attention on CUDA ranks: copy-engine and NCCL
all-to-alls, compiled flex.

Ranks share GPUs modulo the device count; copy_engine runs with two or more GPUs, or on one GPU
when TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 (a gloo group). Inputs are float32 and flex
computes in float32, so outputs and gradients match the float64 reference to ~1e-5 relative; 2e-3
leaves room for the kernel's accumulation order, far below a wrong head slice or chunk (~1).
"""

from __future__ import annotations

import functools

import pytest
import torch

from attngym import reference, variants
from attngym.distributed import hybrid_attention, shard, ulysses_attention
from attngym.distributed.ranks.launch import launch

from .gpu_ranks import relative_errors, skip_reason, transports

REL = 2e-3


def _worker(rank, world_size, transport):
    device = torch.device("cuda", torch.cuda.current_device())
    S, H = 1024, 4
    cases = {
        "causal": variants.get("causal"),
        "alibi": variants.get("alibi", num_heads=H),  # global head indices
        "document": variants.get("document", doc_lengths=[300, 500, 224]),
    }
    calls = {
        "ulysses": ulysses_attention,
        "hybrid_a2a1_ring": functools.partial(hybrid_attention, a2a_size=1),
        "hybrid_a2a2_allgather": functools.partial(
            hybrid_attention, a2a_size=2, across="allgather"
        ),
        "ulysses_rounds": functools.partial(ulysses_attention, pipeline=True),
    }
    errors = {}
    for n, (name, variant) in enumerate(cases.items()):
        variant = variant.to(device)
        kv_heads = (4, 2, 1)[n]  # MHA, GQA split, GQA replicated
        gen = torch.Generator().manual_seed(n)
        q = torch.randn(1, H, S, 64, generator=gen).to(device)
        k, v = (torch.randn(1, kv_heads, S, 64, generator=gen).to(device) for _ in range(2))
        dout = torch.randn(q.shape, generator=gen).to(device)
        qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
        ref_out, _ = reference.attention(qr, kr, vr, variant.score_mod, variant.mask_mod)
        ref_out.backward(dout.double())
        for call, fn in calls.items():
            rounds = call == "ulysses_rounds"  # two rounds, four
            for layout in ("zigzag", "double_zigzag") if rounds else ("contiguous", "zigzag"):
                q_s, k_s, v_s = (
                    shard(t, rank, world_size, layout).requires_grad_() for t in (q, k, v)
                )
                out = fn(q_s, k_s, v_s, variant, layout=layout, transport=transport)
                out.backward(shard(dout, rank, world_size, layout))
                errors[(name, call, layout)] = relative_errors(
                    (out, q_s.grad, k_s.grad, v_s.grad),
                    (ref_out, qr.grad, kr.grad, vr.grad),
                    world_size,
                    layout,
                )
    return errors


@pytest.mark.gpu
@pytest.mark.parametrize("transport", transports())
def test_ulysses_and_hybrid_on_cuda_match_reference(transport, monkeypatch):
    if (reason := skip_reason(transport, 2)) is not None:
        pytest.skip(reason)
    if torch.cuda.device_count() < 2:
        monkeypatch.setenv("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "1")
    errors = launch(_worker, 2, args=(transport,), device="cuda", timeout_s=300)
    assert len(errors) == 3 * 4 * 2
    bad = {case: rel for case, rel in errors.items() if max(rel) >= REL}
    assert bad == {}, f"{transport}: relative errors of out, dq, dk, dv: {bad}"
