"""What the CUDA context-parallel tests share: the transports this box can run, and the error of
a rank's shards against the float64 reference."""

from __future__ import annotations

import os

import torch

from attngym.distributed import unshard


def transports() -> list[str]:
    """nccl needs a GPU per rank (NCCL refuses two ranks on one device); copy_engine also runs
    with two ranks on one GPU when TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 (a gloo group)."""
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    out = ["nccl"] if n_gpu >= 2 else []
    if n_gpu >= 2 or os.environ.get("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES") == "1":
        out.append("copy_engine")
    return out or ["nccl"]  # collected and skipped without CUDA


def relative_errors(got, want, world_size, layout, variant=None) -> list[float]:
    """‖whole - want‖ / ‖want‖ for each pair: `got` this rank's shards (out, dq, dk, dv, ...),
    gathered from every rank and put back in sequence order; `want` the whole reference tensors."""
    import torch.distributed as dist

    errors = []
    for g, w in zip(got, want, strict=True):
        parts = [torch.empty_like(g) for _ in range(world_size)]
        dist.all_gather(parts, g.detach().contiguous())
        whole = unshard(parts, layout, variant=variant).double()
        errors.append(((whole - w).norm() / w.norm()).item())
    return errors
