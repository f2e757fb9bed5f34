"""What the CUDA context-parallel tests share: the transports this box can run, and the error of
a rank's shards against the float64 reference."""

from __future__ import annotations

import os

import torch

from attngym.distributed import unshard


def transports() -> list[str]:
    """The transports the CUDA tests are parametrised over. nccl is always listed and skips
    itself where this box has fewer GPUs than ranks (`skip_reason`); copy_engine is listed with
    two or more GPUs, or on one GPU when TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 (two ranks
    sharing it over gloo)."""
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    out = ["nccl"]
    if n_gpu >= 2 or os.environ.get("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES") == "1":
        out.append("copy_engine")
    return out


def skip_reason(transport: str, ranks: int, n_gpu: int | None = None) -> str | None:
    """Why `ranks` CUDA ranks over `transport` cannot run on this box (None: they can).

    NCCL needs one GPU per rank: it refuses two ranks on one device, so with fewer GPUs than
    ranks the test is skipped with that reason, not failed. copy_engine shares a GPU when the
    test allows overlapping devices, and is judged by `transports`.

    Args:
        n_gpu: the GPUs to judge by (default: torch.cuda.device_count()).
    """
    if n_gpu is None:
        n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if transport == "nccl" and n_gpu < ranks:
        return (
            f"nccl needs one GPU per rank: {ranks} ranks, {n_gpu} GPU(s) here "
            "(NCCL refuses two ranks on one device)"
        )
    return None


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
