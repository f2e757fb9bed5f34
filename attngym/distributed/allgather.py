"""All-gather attention: each rank gathers the K/V rows it reads, then attends in one call.

Contract (P ranks, this rank r, an all-gather from `transport`):
    * Only what the mask reads moves (HaloPlan, from the pairs' block masks, the same on every
      rank): each rank contributes the `width` rows of its K/V shard that some other rank's
      queries read, from `starts[p]` (whole shards for causal; a halo for local masks; nothing,
      and no gather, when no rank reads another's shard).
    * Forward: `start([k, v] rows)`, then `wait` returns the gathered (2, B, G, P·width, D)
      buffer (rank p's rows at [p·width, (p+1)·width)) through the transport's differentiable
      wait. The keys of the call are the gathered buffer when width = S/P (copied when the
      transport reuses its buffer, OUTPUT_REUSED, and a backward will read them), else this
      rank's own shard followed by the other ranks' rows. One kernel call attends the rank's q
      shard (S/P rows) to those keys: the variant's callbacks read each local row and key index
      through a map to global positions (an offset when the rows are one chunk, the identity
      when the keys are already in global order, else a position table), and the block mask is
      built in that local index space, so every masked block is skipped as in the one-device
      kernel.
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
from attngym.distributed.cp import (
    CPCall,
    CPOptions,
    CPStats,
    StepClock,
    attend,
    pairs,
    rows_read,
    run,
)
from attngym.distributed.layout import LAYOUTS, Layout
from attngym.distributed.positions import at_positions
from attngym.distributed.spec import TopologySpec
from attngym.variants.base import Variant

__all__ = ["ALLGATHER", "CPOptions", "CPStats", "allgather_attention", "allgather_transfer_ms"]


@dataclasses.dataclass(frozen=True)
class HaloPlan:
    """The rows of each shard that travel (the same on every rank). They cover every row some
    other rank's queries read (from their block masks, so whole blocks).

    Attributes:
        width: rows each rank contributes: S/P for masks that read whole shards, 0 when no rank
            reads another's shard.
        starts: starts[p], the first local row of rank p's contribution.
    """

    width: int
    starts: tuple[int, ...]


# Variant -> {(layout, B, H, block size, backend, device): HaloPlan}.
_HALO_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def halo_plan(call: CPCall, q: torch.Tensor) -> HaloPlan:
    """The HaloPlan of this call (memoised per variant)."""
    key = (call.layout, *q.shape[:2], call.options.block_size, call.backend, q.device)
    per = _HALO_PLANS.setdefault(call.variant, {})
    if key not in per:
        P, n = call.world_size, call.seq_len // call.world_size
        spans = []
        for s in range(P):
            read = [rows_read(call, q, p, s) for p in range(P) if p != s]
            read = [x for x in read if x]
            spans.append((min(a for a, _ in read), max(b for _, b in read)) if read else None)
        width = max((b - a for a, b in filter(None, spans)), default=0)
        # A shard read by no other rank still sends `width` rows (an all-gather moves one size).
        starts = tuple(0 if sp is None else min(sp[0], n - width) for sp in spans)
        per[key] = HaloPlan(width, starts)
    return per[key]


def _gather(call: CPCall, k: torch.Tensor, width: int):
    from attngym.distributed.transport import cached

    return cached(
        call.transport.allgather,
        (*k.shape[:2], width, k.shape[3]),
        2,
        2,
        dtype=k.dtype,
        device=k.device,
        timeout_s=call.options.timeout_s,
        group=call.group,
    )


def key_positions(layout: Layout, rank: int, plan: HaloPlan, device) -> torch.Tensor:
    """The global position of each key of rank `rank`'s call, in the order the call holds them."""
    every = [layout.positions(p, device) for p in range(layout.world_size)]
    if plan.width == every[rank].numel():  # whole shards: the gathered buffer itself
        return torch.cat(every)
    rows = [every[p][plan.starts[p] : plan.starts[p] + plan.width] for p in range(len(every))]
    return torch.cat([every[rank], *(rows[p] for p in range(len(every)) if p != rank)])


def mapped_variant(
    variant: Variant,
    layout: Layout,
    rank: int,
    device,
    kv_positions: torch.Tensor,
    *,
    tables: bool = False,
) -> Variant:
    """The variant over (this rank's shard rows) x (the call's keys): `at_positions` with this
    rank's query positions in `layout` (`tables`: offsets as tables, kernels.offsets_as_tables)."""
    name = f"{variant.name}@{layout.name}.rank{rank}"
    positions = layout.positions(rank, device)
    return at_positions(variant, positions, kv_positions, device, name, offsets_as_tables=tables)


# Variant -> {(layout, rank, device, block size, backend, plan, tables): (mapped variant, block
# mask)};
# the block mask broadcasts over batch and heads.
_MAPPED: weakref.WeakKeyDictionary[Variant, dict[tuple, tuple[Variant, Any]]] = (
    weakref.WeakKeyDictionary()
)


def _mapped(call: CPCall, q: torch.Tensor, plan: HaloPlan):
    tables = kernels.offsets_as_tables(call.options.kernel_options)
    key = (call.layout, call.rank, q.device, call.options.block_size, call.backend, plan, tables)
    per = _MAPPED.setdefault(call.variant, {})
    if key not in per:
        positions = key_positions(call.layout, call.rank, plan, q.device)
        mapped = mapped_variant(
            call.variant, call.layout, call.rank, q.device, positions, tables=tables
        )
        block_mask = None
        if call.backend == "flex":
            block_mask = kernels.make_block_mask(
                mapped,
                q.shape[2],
                positions.numel(),
                block_size=call.options.block_size,
                device=q.device,
            )
        per[key] = (mapped, block_mask)
    return per[key]


def _allgather(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: CPCall) -> torch.Tensor:
    stats, clock = call.stats, StepClock(call.stats, q.device)
    P, r, n = call.world_size, call.rank, k.shape[2]
    plan = halo_plan(call, q) if P > 1 else HaloPlan(n, (0,))
    if P > 1 and plan.width > 0:
        w = plan.width
        ag = _gather(call, k, w)
        mine = [t.narrow(2, plan.starts[r], w) for t in (k, v)]
        clock.start()
        ag.start(mine)
        kv = ag.wait(mine)  # differentiable: its backward reduce-scatters dK/dV
        clock.stop("step_wait_ms")
        if w == n:
            k_all, v_all = kv[0], kv[1]
            saved = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
            if getattr(ag, "OUTPUT_REUSED", True) and saved:
                # The kernel saves its keys for the backward (dq needs them too), and the
                # transport's buffer belongs to the next call (a second layer's forward before
                # this one's backward).
                k_all, v_all = k_all.clone(), v_all.clone()
        else:  # this rank's whole shard, then the other ranks' rows
            others = [p for p in range(P) if p != r]
            k_all, v_all = (
                torch.cat([own, *(kv[j][:, :, p * w : (p + 1) * w] for p in others)], dim=2)
                for j, own in enumerate((k, v))
            )
        if stats is not None:
            stats.bytes_sent += 2 * mine[0].numel() * k.element_size() * (P - 1)
    else:  # one rank, or no rank reads another's shard
        k_all, v_all = k, v
    mapped, block_mask = _mapped(call, q, plan)
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


def allgather_transfer_ms(
    transport, k_s: torch.Tensor, timeout_s: float, repeats: int
) -> list[float]:
    """Times of one all-gather of every rank's whole K/V shard alone (start, then wait; the step
    clock of CPStats), as the forward gathers them for masks that read whole shards. Collective
    over the world."""
    kv = torch.stack([k_s.detach(), k_s.detach()])
    ag = transport.allgather(
        tuple(k_s.shape), 2, 2, dtype=k_s.dtype, device=k_s.device, timeout_s=timeout_s
    )
    stats = CPStats()
    clock = StepClock(stats, k_s.device)
    for _ in range(repeats):
        clock.start()
        ag.start(kv)
        ag.wait(kv)
        clock.stop("step_wait_ms")
    return stats.step_wait_ms


ALLGATHER = TopologySpec(
    name="allgather",
    attention=allgather_attention,
    layouts=LAYOUTS,
    timer=allgather_transfer_ms,
)
