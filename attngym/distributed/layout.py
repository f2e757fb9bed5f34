"""How a sequence is spread over ranks: which global positions each rank's shard holds.

Layouts (S tokens, P ranks, sharded along `dim`, the sequence dim 2 of (B, H, S, D)):

    contiguous  rank r holds positions [r·S/P, (r+1)·S/P): one chunk per rank.
    zigzag      S is cut into 2P equal chunks; rank r holds chunk r, then chunk 2P-1-r. Under a
                causal mask every rank then does the same amount of work (the early chunk is cheap,
                the late one expensive).

A rank's shard is the concatenation of its chunks in that order; `chunks` gives them as
(global offset, length) pairs, which is what the context-parallel kernels pass as q/kv offsets.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

LAYOUTS = ("contiguous", "zigzag")


def _check(layout: str, world_size: int) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}; got {layout!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")


def pieces(layout: str, world_size: int) -> int:
    """How many equal pieces S is cut into: P (contiguous) or 2P (zigzag)."""
    _check(layout, world_size)
    return world_size if layout == "contiguous" else 2 * world_size


def check_seq_len(seq_len: int, world_size: int, layout: str) -> None:
    """ValueError unless `seq_len` splits evenly into the layout's pieces."""
    n = pieces(layout, world_size)
    if seq_len % n:
        raise ValueError(
            f"seq_len={seq_len} must be divisible by {n} for layout={layout!r} with "
            f"world_size={world_size} ({'P' if layout == 'contiguous' else '2P'} equal chunks)"
        )


def chunks(rank: int, world_size: int, seq_len: int, layout: str) -> list[tuple[int, int]]:
    """The (global offset, length) chunks rank `rank` holds, in shard order.

    Args:
        rank: 0 <= rank < world_size.
        world_size: P.
        seq_len: S, the whole sequence.
        layout: "contiguous" or "zigzag".

    Returns:
        One pair for contiguous, two for zigzag; lengths sum to S/P.
    """
    check_seq_len(seq_len, world_size, layout)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    n = pieces(layout, world_size)
    size = seq_len // n
    if layout == "contiguous":
        return [(rank * size, size)]
    return [(rank * size, size), ((n - 1 - rank) * size, size)]


def shard(x: torch.Tensor, rank: int, world_size: int, layout: str, dim: int = 2) -> torch.Tensor:
    """This rank's shard of `x` along `dim` (a contiguous copy).

    Args:
        x: the whole tensor, e.g. q_BHSD with S at `dim`.
        rank, world_size: which shard of how many.
        layout: "contiguous" or "zigzag".
        dim: the sequence dimension.

    Returns:
        (…, S/P, …): the rank's chunks concatenated in shard order.
    """
    parts = [
        x.narrow(dim, off, length) for off, length in chunks(rank, world_size, x.shape[dim], layout)
    ]
    return torch.cat(parts, dim=dim).contiguous()


def unshard(shards: Sequence[torch.Tensor], layout: str, dim: int = 2) -> torch.Tensor:
    """Reassemble the whole tensor from every rank's shard (rank order), the inverse of `shard`.

    Args:
        shards: P tensors (…, S/P, …), shard r from rank r.
        layout: the layout they were cut with.
        dim: the sequence dimension.

    Returns:
        (…, S, …) in global position order.
    """
    world_size = len(shards)
    if world_size == 0:
        raise ValueError("unshard needs at least one shard")
    seq_len = shards[0].shape[dim] * world_size
    placed: list[tuple[int, torch.Tensor]] = []
    for rank, s in enumerate(shards):
        if s.shape != shards[0].shape:
            raise ValueError(
                f"shard {rank} has shape {tuple(s.shape)}, shard 0 {tuple(shards[0].shape)}"
            )
        start = 0
        for off, length in chunks(rank, world_size, seq_len, layout):
            placed.append((off, s.narrow(dim, start, length)))
            start += length
    return torch.cat([t for _, t in sorted(placed, key=lambda p: p[0])], dim=dim)
