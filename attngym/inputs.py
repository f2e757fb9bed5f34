"""Seeded inputs: the same q, k, v and output gradient for a config on every rank and topology.

A sharded run is checked against the unsharded problem and a ring run is compared with a
single-device run of the same config, so the draw depends on the shape and the seed alone: it is
made in float32 on the CPU, then moved and cast. It is cut into chunks of DRAW_CHUNK numbers,
each from its own generator seeded by (seed, tensor, chunk), drawn by threads at once: a 64K
run's inputs are 4 x 67 M numbers, 1.5 s on one core, and the numbers do not depend on how many
threads draw them.

Shape legend: B batch, H query heads, G key/value heads, S sequence, D head dim.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from attngym.errors import choice_error

# The resolved dtype names a run may use, as torch dtypes.
TORCH_DTYPES = {
    name: getattr(torch, name) for name in ("float32", "bfloat16", "float16", "float64")
}
DRAW_CHUNK = 1 << 22


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
    shapes = [
        (s.batch, s.heads, s.seq_len, s.head_dim),
        (s.batch, kv_heads, s.seq_len, s.head_dim),
        (s.batch, kv_heads, s.seq_len, s.head_dim),
        (s.batch, s.heads, s.seq_len, s.head_dim),
    ]
    drawn = [torch.empty(shape) for shape in shapes]
    chunks = [
        (t.view(-1)[start : start + DRAW_CHUNK], _chunk_seed(seed, i, start // DRAW_CHUNK))
        for i, t in enumerate(drawn)
        for start in range(0, t.numel(), DRAW_CHUNK)
    ]
    with ThreadPoolExecutor(min(len(chunks), torch.get_num_threads())) as pool:
        for _ in pool.map(_draw_chunk, chunks):
            pass
    q, k, v, grad_out = (t.to(device=device, dtype=dtype) for t in drawn)
    if requires_grad:
        for t in (q, k, v):
            t.requires_grad_(True)
    return q, k, v, grad_out


def _chunk_seed(seed: int, tensor: int, chunk: int) -> int:
    """The seed of one chunk of the draw: unrelated to its neighbours' (a hash, not seed + i)."""
    digest = hashlib.sha256(f"{seed}/{tensor}/{chunk}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _draw_chunk(chunk: tuple[torch.Tensor, int]) -> None:
    out, seed = chunk
    torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), out=out)
