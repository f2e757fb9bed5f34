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
import functools
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
    mapped_call,
    pairs,
    rows_read,
    run,
)
from attngym.distributed.layout import LAYOUTS, Layout
from attngym.distributed.simulate import Item, SequenceRanks, SimulatedCall, Simulation, nbytes
from attngym.distributed.spec import TopologySpec
from attngym.distributed.transfer_model import Fabric, Prediction, RankWork, predict
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
        per[key] = mapped_call(call, positions, q.device, "gathered", full=False)
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


# ---------------------------------------------------------------------------------------------
# Simulated and priced (topology.simulate=true; attngym.distributed.simulate, transfer_model).


def simulate_allgather(sc: SimulatedCall) -> Simulation:
    """Every rank's one call (cp.attend) on the keys it would gather (its own shard and the rows
    the HaloPlan sends), with the mapped variant and block mask the algorithm builds; backward:
    that call's own. Also the ranks of PyTorch's scheme, the same calls with whole shards
    gathered (Simulation.extra["torch_cp"])."""
    ranks = SequenceRanks(sc)
    works, whole_shards, sent, buffers = [], [], 0, 0
    for r in range(sc.world_size):
        work, received, buffer = _simulated_rank(ranks, r, sc.clock)
        works.append(work)
        sent, buffers = max(sent, received), max(buffers, buffer)
        whole = nbytes(2, *ranks.ks[r].shape, itemsize=ranks.ks[r].element_size())
        whole *= sc.world_size - 1
        whole_shards.append(dataclasses.replace(work, fwd_bytes=(whole,), bwd_bytes=(whole,)))
    sim = ranks.simulation(works)
    sim.bytes_moved, sim.peak_mem_bytes = sent, buffers
    sim.extra["torch_cp"] = whole_shards
    return sim


def _simulated_rank(ranks: SequenceRanks, r: int, clock) -> tuple[RankWork, int, int]:
    """Rank r's RankWork, the bytes it receives and its gathered buffer's bytes."""
    P, q_r, ks, vs = ranks.world_size, ranks.qs[r], ranks.ks, ranks.vs
    call, counted = ranks.call(r), ranks.call(r, counted=True)
    saved = ranks.saved[r] if ranks.saved is not None else None
    n = ks[0].shape[2]
    plan = halo_plan(call, q_r) if P > 1 else HaloPlan(n, (0,))
    w = plan.width
    if P > 1 and 0 < w < n:  # this rank's whole shard, then the other ranks' rows
        others = [p for p in range(P) if p != r]
        k_all, v_all = (
            torch.cat([t[r], *(t[p].narrow(2, plan.starts[p], w) for p in others)], dim=2)
            for t in (ks, vs)
        )
    elif P > 1 and w == n:  # the gathered buffer, rank order
        k_all, v_all = torch.cat(ks, dim=2), torch.cat(vs, dim=2)
    else:
        k_all, v_all = ks[r], vs[r]
    mapped, block_mask = _mapped(call, q_r, plan)
    for p in range(P):  # the chunk pairs the one call covers, counted as the algorithm does
        pairs(counted, q_r, p)

    def fwd():
        with torch.no_grad():
            attend(call, q_r, k_all, v_all, 0, 0, block_mask, variant=mapped)

    bwd = None
    if saved is not None:
        leaves = [t.detach().requires_grad_() for t in (q_r, k_all, v_all)]

        def bwd():
            with torch.enable_grad():
                out, _ = attend(call, *leaves, 0, 0, block_mask, variant=mapped)
                torch.autograd.grad(out, leaves, saved.dout)

    key = ("allgather", tuple(q_r.shape), tuple(k_all.shape), clock.mask_key(block_mask))
    item = Item(key=key, fwd=fwd, bwd=bwd, block_masks=(block_mask,))
    fwd_ms = clock.ms(item, "fwd")
    both_ms = clock.ms(item, "bwd") if saved is not None else None
    b, g, _, d = ks[0].shape
    received = nbytes(2, b, g, w, d, itemsize=ks[0].element_size()) * (P - 1)
    buffer = nbytes(2, b, g, P * w, d, itemsize=ks[0].element_size())
    # fwd-and-bwd as one item: the backward item re-runs the forward under autograd (flex's
    # backward needs its graph), so its time is fwd+bwd; the backward alone is the difference.
    work = RankWork(
        fwd_ms=(fwd_ms,),
        bwd_ms=() if both_ms is None else (max(both_ms - fwd_ms, 0.0),),
        fwd_bytes=(received,),
        bwd_bytes=(received,),
    )
    return work, received, buffer * (2 if saved is not None else 1)


def gather_rank_ms(work: RankWork, fab: Fabric, backward: bool, crossing: float = 0.0) -> float:
    """The gather, then the call; backward: the call's, then the reduce-scatter (as long as the
    gather). `crossing`: the share gathered from other NVLink domains."""
    gather = fab.ms("allgather", work.fwd_bytes[0] if work.fwd_bytes else 0.0, crossing)
    total = gather + work.compute_fwd_ms
    if backward:
        total += sum(work.bwd_ms) + gather
    return total


def price_allgather(sim: Simulation, fab: Fabric, backward: bool) -> Prediction:
    """The all-gather's call on `fab` (gather_rank_ms), and PyTorch's scheme beside it: the same
    calls with every rank's whole K/V shard gathered (`torch_cp`)."""
    rank_ms = functools.partial(
        gather_rank_ms, crossing=fab.collective_crossing(len(sim.ranks), sim.stride)
    )
    ours = predict(rank_ms, sim.ranks, fab, backward)
    theirs = predict(rank_ms, sim.extra["torch_cp"], fab, backward)
    return dataclasses.replace(ours, contenders={"torch_cp": theirs})


ALLGATHER = TopologySpec(
    name="allgather",
    attention=allgather_attention,
    layouts=LAYOUTS,
    user_layouts=True,
    timer=allgather_transfer_ms,
    simulate=simulate_allgather,
    price=price_allgather,
)
