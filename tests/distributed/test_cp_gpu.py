"""Context parallelism on CUDA ranks: NCCL and copy-engine transports, compiled flex chunks.

Ranks share GPUs modulo the device count; copy_engine runs with two or more GPUs, or on one GPU
when TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1. Inputs are float32 and the flex kernel computes in
float32 (TF32 off by default), so outputs and gradients match the float64 reference to ~1e-5
relative; 2e-3 leaves room for the flex kernel's own accumulation order.
"""

from __future__ import annotations

import os

import pytest
import torch

from attngym import reference, variants
from attngym.distributed import allgather_attention, ring_attention, shard, unshard
from attngym.distributed.launch import launch

REL = 2e-3


def _transports():
    """nccl needs a GPU per rank (NCCL refuses two ranks on one device); copy_engine also runs
    with two ranks on one GPU when TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 (a gloo group)."""
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    out = ["nccl"] if n_gpu >= 2 else []
    if n_gpu >= 2 or os.environ.get("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES") == "1":
        out.append("copy_engine")
    return out or ["nccl"]  # collected and skipped without CUDA


def _variants(names):
    """The variants the ranks check: masks that skip different (q, kv) chunk pairs."""
    made = {
        "causal": lambda: variants.get("causal"),
        "sliding_window": lambda: variants.get("sliding_window", window_size=200),
        "document": lambda: variants.get("document", doc_lengths=[300, 500, 224]),
    }
    return {name: made[name]() for name in names}


def _worker(rank, world_size, transport, variant_names):
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator().manual_seed(0)
    S = 1024
    q = torch.randn(1, 4, S, 64, generator=gen).to(device)
    k, v = (torch.randn(1, 2, S, 64, generator=gen).to(device) for _ in range(2))
    dout = torch.randn(q.shape, generator=gen).to(device)
    errors = {}
    for name, variant in _variants(variant_names).items():
        variant = variant.to(device)
        qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
        ref_out, _ = reference.attention(qr, kr, vr, None, variant.mask_mod)
        ref_out.backward(dout.double())
        for fn in (ring_attention, allgather_attention):
            for layout in ("contiguous", "zigzag"):
                q_s, k_s, v_s = (
                    shard(t, rank, world_size, layout).requires_grad_() for t in (q, k, v)
                )
                out = fn(q_s, k_s, v_s, variant, layout=layout, transport=transport)
                out.backward(shard(dout, rank, world_size, layout))
                rel = []
                for got, want in zip(
                    (out, q_s.grad, k_s.grad, v_s.grad),
                    (ref_out, qr.grad, kr.grad, vr.grad),
                    strict=True,
                ):
                    parts = [torch.empty_like(got) for _ in range(world_size)]
                    dist.all_gather(parts, got.detach().contiguous())
                    whole = unshard(parts, layout).double()
                    rel.append(((whole - want).norm() / want.norm()).item())
                errors[(name, fn.__name__, layout)] = rel
    return errors


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["causal", "sliding_window", "document"])
@pytest.mark.parametrize("transport", _transports())
def test_cp_on_cuda_matches_reference(transport, variant, monkeypatch):
    world_size = max(2, torch.cuda.device_count()) if transport == "nccl" else 2
    if torch.cuda.device_count() < world_size:
        monkeypatch.setenv("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "1")
    errors = launch(
        _worker,
        min(world_size, 4),
        args=(transport, (variant,)),
        device="cuda",
        timeout_s=300,
    )
    for case, rel in errors.items():
        assert max(rel) < REL, f"{transport} {case}: relative errors of out, dq, dk, dv = {rel}"


@pytest.mark.multigpu
def test_auto_transport_picks_copy_engine_inside_one_host():
    errors = launch(_worker, 2, args=("auto", ("causal",)), device="cuda", timeout_s=300)
    for case, rel in errors.items():
        assert max(rel) < REL, f"auto {case}: {rel}"
