"""Seeded inputs: the same q, k, v and output gradient for a config on every rank and topology.

A sharded run is checked against the unsharded problem and a ring run is compared with a
single-device run of the same config, so the draw depends on the shape and the seed alone: it is
made in float32 on the CPU, then moved and cast.

Shape legend: B batch, H query heads, G key/value heads, S sequence, D head dim.
"""

from __future__ import annotations

from typing import Any

import torch

from attngym.errors import choice_error

# The resolved dtype names a run may use, as torch dtypes.
TORCH_DTYPES = {
    name: getattr(torch, name) for name in ("float32", "bfloat16", "float16", "float64")
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a resolved dtype name ("float32", "bfloat16", ...)."""
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(choice_error("dtype", name, TORCH_DTYPES)) from None


def make_inputs(
    shape: Any,
    seed: int,
    device: torch.device | str,
    dtype: torch.dtype,
    requires_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeded random q, k, v and an output gradient for the whole sequence.

    Args:
        shape: anything with batch, heads, kv_heads (None: heads), seq_len and head_dim, such as
            attngym.runner.config.Shape.
        seed: seeds the draw.

    Returns:
        q: (B, H, S, D); k, v: (B, G, S, D); grad_out: (B, H, S, D) — all in `dtype` on `device`;
        q, k, v require grad when `requires_grad`.
    """
    s = shape
    kv_heads = s.kv_heads
    gen = torch.Generator().manual_seed(seed)
    shapes = [
        (s.batch, s.heads, s.seq_len, s.head_dim),
        (s.batch, kv_heads, s.seq_len, s.head_dim),
        (s.batch, kv_heads, s.seq_len, s.head_dim),
        (s.batch, s.heads, s.seq_len, s.head_dim),
    ]
    out = [torch.randn(shape, generator=gen).to(device=device, dtype=dtype) for shape in shapes]
    q, k, v, grad_out = out
    if requires_grad:
        for t in (q, k, v):
            t.requires_grad_(True)
    return q, k, v, grad_out
