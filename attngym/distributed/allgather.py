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


def _index_map(positions: torch.Tensor):
    """How a local index becomes a global position: an int offset, or the table itself."""
    start = int(positions[0])
    if torch.equal(
        positions, torch.arange(start, start + positions.numel(), device=positions.device)
    ):
        return start
    return positions


def key_positions(layout: Layout, rank: int, plan: HaloPlan, device) -> torch.Tensor:
    """The global position of each key of rank `rank`'s call, in the order the call holds them."""
    every = [layout.positions(p, device) for p in range(layout.world_size)]
    if plan.width == every[rank].numel():  # whole shards: the gathered buffer itself
        return torch.cat(every)
    rows = [every[p][plan.starts[p] : plan.starts[p] + plan.width] for p in range(len(every))]
    return torch.cat([every[rank], *(rows[p] for p in range(len(every)) if p != rank)])


def mapped_variant(
    variant: Variant, layout: Layout, rank: int, device, kv_positions: torch.Tensor
) -> Variant:
    """The variant over (this rank's shard rows) x (the call's keys): `at_positions` with this
    rank's query positions in `layout`."""
    name = f"{variant.name}@{layout.name}.rank{rank}"
    return at_positions(variant, layout.positions(rank, device), kv_positions, device, name)


def at_positions(
    variant: Variant,
    q_positions: torch.Tensor,
    kv_positions: torch.Tensor,
    device,
    name: str,
    *,
    tables: bool = False,
) -> Variant:
    """The variant over local query rows and keys at these global positions.

    Query row i is global position q_map(i), key j is kv_map(j) (key j is at kv_positions[j]);
    each map is an offset (a 0-d tensor) or a position table, so the callbacks stay tensor-only
    and one compiled kernel serves every rank. A map that is the identity (offset 0) is left
    out, so at world size 1 the callbacks are the variant's own and the kernel is the one-device
    call's (an added 0 still costs a load and an add per score). `tables`: always a table
    lookup (PyTorch's CP form, for its contender). The block rule is moved with them
    (`mapped_block_rule`).
    """
    q_at = _mapper(q_positions if tables else _index_map(q_positions), device, "q")
    kv_at = _mapper(kv_positions if tables else _index_map(kv_positions), device, "kv")
    score_mod, mask_mod = variant.score_mod, variant.mask_mod
    if q_at is None and kv_at is None:
        # The variant's own callbacks and buffers; a copy, so that the memo below (weak keys)
        # holds no reference to its key.
        return dataclasses.replace(variant, name=name)
    q_at = q_at or _identity
    kv_at = kv_at or _identity
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
        name=name,
        score_mod=score_mod,
        mask_mod=mask_mod,
        buffers={},
        bind=None,
        seq_len=None,
        block_rule=mapped_block_rule(
            variant.block_rule, q_positions.to(device), kv_positions.to(device)
        ),
    )


def mapped_block_rule(rule, q_positions: torch.Tensor, kv_positions: torch.Tensor):
    """The variant's block rule (Variant.block_rule, over global positions) for callbacks that
    read local indices through position tables: a block whose rows (or keys) are consecutive
    positions is classed by the rule at those positions; any other block is partial, so its
    mask is evaluated entry by entry (exact, never skipped). The chunked layouts' blocks are all
    consecutive when the chunks are whole blocks. None when the variant has no rule."""
    if rule is None:
        return None

    def local_rule(q_lo, q_hi, kv_lo, kv_hi):
        q_first, q_last = q_positions[q_lo], q_positions[q_hi]
        kv_first, kv_last = kv_positions[kv_lo], kv_positions[kv_hi]
        classes = rule(q_first, q_last, kv_first, kv_last)
        runs = _consecutive(q_positions, q_lo, q_hi) & _consecutive(kv_positions, kv_lo, kv_hi)
        return torch.where(runs, classes, torch.ones_like(classes))

    return local_rule


def _consecutive(positions: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Per block [lo, hi]: whether positions rise by exactly 1 from each row to the next."""
    steps = torch.diff(positions, prepend=positions[:1] - 1) == 1  # steps[i]: i-1 -> i is +1
    broken = torch.cumsum(~steps, dim=0)  # breaks up to and including row i
    return broken[hi] == broken[lo]


def _identity(idx):
    return idx


def _mapper(index_map, device, role: str):
    """A local index's global position: a table lookup, an added offset, or None (offset 0)."""
    if isinstance(index_map, torch.Tensor):
        table = index_map

        def at(idx):
            return table[idx]

    elif index_map == 0:
        return None
    else:
        offset = kernels.position(index_map, torch.device(device), role)

        def at(idx):
            return idx + offset

    return at


# Variant -> {(layout, rank, device, block size, backend, plan): (mapped variant, block mask)};
# the block mask broadcasts over batch and heads.
_MAPPED: weakref.WeakKeyDictionary[Variant, dict[tuple, tuple[Variant, Any]]] = (
    weakref.WeakKeyDictionary()
)


def _mapped(call: CPCall, q: torch.Tensor, plan: HaloPlan):
    key = (call.layout, call.rank, q.device, call.options.block_size, call.backend, plan)
    per = _MAPPED.setdefault(call.variant, {})
    if key not in per:
        positions = key_positions(call.layout, call.rank, plan, q.device)
        mapped = mapped_variant(call.variant, call.layout, call.rank, q.device, positions)
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
