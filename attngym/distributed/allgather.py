"""All-gather attention: each rank gathers every K/V shard, then attends its q shard in one call.

Contract (P ranks, this rank r, an all-gather from `transport`):
    * Forward: `start([k, v])`, then `wait` returns the gathered (2, B, G, S, D) buffer (rank p's
      shard at rows [p·S/P, (p+1)·S/P), in layout order) through the transport's differentiable
      wait. One kernel call attends the rank's q shard (S/P rows) to all S keys: the variant's
      callbacks read each local row and key index through the layout's map to global positions
      (an offset when the rows are one chunk, the identity when the gathered keys are already in
      global order, else a position table), and the block mask is built in that local index
      space, so every masked block is skipped as in the one-device kernel.
    * Backward is the kernel's own (flex's backward, or the reference's autograd) over the
      gathered K/V; the wait's backward reduce-scatters dK/dV to their home ranks. Nothing is
      recomputed and `CPOptions.backward` does not apply.
    * Why one call and no overlap of the gather with the local shard's compute: splitting the
      call into a local and a remote part costs a second kernel, an lse merge over the output and
      pair bookkeeping per step, to hide a gather that is a few percent of the compute from 64K
      tokens per GPU on (1.25 ms of a 45 ms forward at S = 128K on two H200s); PyTorch's own
      flex context parallelism makes the same choice.
    * The mapped variant and its block mask are kept per Variant object (weak keys) and layout.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch

from attngym import kernels
from attngym.distributed.cp import CPCall, CPOptions, CPStats, StepClock, attend, pairs, run
from attngym.distributed.layout import Layout
from attngym.variants.base import Variant

__all__ = ["CPOptions", "CPStats", "allgather_attention"]


def _gather(call: CPCall, k: torch.Tensor):
    from attngym.distributed.transport import cached

    return cached(
        call.transport.allgather,
        tuple(k.shape),
        2,
        2,
        dtype=k.dtype,
        device=k.device,
        timeout_s=call.options.timeout_s,
        group=call.group,
    )


def _index_map(positions: torch.Tensor):
    """How a local index becomes a global position: an int offset, or the table itself."""
    start = int(positions[0])
    if torch.equal(
        positions, torch.arange(start, start + positions.numel(), device=positions.device)
    ):
        return start
    return positions


def mapped_variant(variant: Variant, layout: Layout, rank: int, device) -> Variant:
    """The variant over (this rank's shard rows) x (the gathered keys in layout order).

    Query row i is global position q_map(i), key j is kv_map(j); each map is an offset (a 0-d
    tensor) or a position table, so the callbacks stay tensor-only and one compiled kernel serves
    every rank.
    """
    q_map = _index_map(layout.positions(rank, device))
    kv_map = _index_map(torch.cat([layout.positions(p, device) for p in range(layout.world_size)]))
    q_at = _mapper(q_map, device, "q")
    kv_at = _mapper(kv_map, device, "kv")
    score_mod = mask_mod = None
    if variant.score_mod is not None:
        inner_score = variant.score_mod

        def score_mod(score, b, h, q_idx, kv_idx):
            return inner_score(score, b, h, q_at(q_idx), kv_at(kv_idx))

    if variant.mask_mod is not None:
        inner_mask = variant.mask_mod

        def mask_mod(b, h, q_idx, kv_idx):
            return inner_mask(b, h, q_at(q_idx), kv_at(kv_idx))

    return dataclasses.replace(
        variant,
        name=f"{variant.name}@{layout.name}.rank{rank}",
        score_mod=score_mod,
        mask_mod=mask_mod,
        buffers={},
        bind=None,
        seq_len=None,
    )


def _mapper(index_map, device, role: str):
    if isinstance(index_map, torch.Tensor):
        table = index_map

        def at(idx):
            return table[idx]

    else:
        offset = kernels.position(index_map, torch.device(device), role)

        def at(idx):
            return idx + offset

    return at


# Variant -> {(layout, rank, device, B, H, block size, backend): (mapped variant, block mask)}.
_MAPPED: weakref.WeakKeyDictionary[Variant, dict[tuple, tuple[Variant, Any]]] = (
    weakref.WeakKeyDictionary()
)


def _mapped(call: CPCall, q: torch.Tensor):
    key = (call.layout, call.rank, q.device, call.options.block_size, call.backend)
    per = _MAPPED.setdefault(call.variant, {})
    if key not in per:
        mapped = mapped_variant(call.variant, call.layout, call.rank, q.device)
        block_mask = None
        if call.backend == "flex":
            block_mask = kernels.make_block_mask(
                mapped,
                q.shape[2],
                call.seq_len,
                block_size=call.options.block_size,
                device=q.device,
            )
        per[key] = (mapped, block_mask)
    return per[key]


def _allgather(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: CPCall) -> torch.Tensor:
    stats, clock = call.stats, StepClock(call.stats, q.device)
    if call.world_size > 1:
        ag = _gather(call, k)
        clock.start()
        ag.start([k, v])
        kv = ag.wait([k, v])  # differentiable: its backward reduce-scatters dK/dV
        clock.stop("step_wait_ms")
        k_all, v_all = kv[0], kv[1]
        if stats is not None:
            stats.bytes_sent += 2 * k.numel() * k.element_size() * (call.world_size - 1)
    else:
        k_all, v_all = k, v
    mapped, block_mask = _mapped(call, q)
    clock.start()
    out, lse = attend(call, q, k_all, v_all, 0, 0, block_mask, variant=mapped)
    clock.stop("step_compute_ms")
    if stats is not None:
        stats.lse = lse.detach()
        stats.backward = "kernel"  # flex's own backward, or the reference's autograd
        for p in range(call.world_size):  # the chunk pairs the one call covers, for comparison
            pairs(call, q, p)
    return out


def allgather_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    variant: Variant,
    *,
    group=None,
    transport: str = "auto",
    layout: str | Layout = "contiguous",
    options: CPOptions | None = None,
    stats: CPStats | None = None,
    **overrides: Any,
) -> torch.Tensor:
    """Attention of this rank's q shard over the whole sequence, K/V all-gathered, one kernel call.

    Collective: every rank of `group` calls it with its shards (same shapes, same arguments).
    The arguments are those of `ring_attention`.

    Args:
        q: (B, H, S/P, D) this rank's query shard in `layout`.
        k, v: (B, G, S/P, D) this rank's key/value shards, G dividing H (GQA).
        variant: the attention variant, evaluated at global positions.
        group, transport, layout, options, stats, **overrides: as in ring_attention.

    Returns:
        (B, H, S/P, D) this rank's output shard, in q's dtype; differentiable w.r.t. q, k, v.
    """
    return run(
        _allgather,
        q,
        k,
        v,
        variant,
        group=group,
        transport=transport,
        layout=layout,
        options=options,
        stats=stats,
        **overrides,
    )
