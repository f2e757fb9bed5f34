"""Ring attention: each rank keeps its q shard while the K/V shards travel around the ring.

Contract (P ranks, this rank r, channels from `transport`):
    * Only what the mask reads moves (RingPlan, from the pairs' block masks, the same on every
      rank): the ring runs `steps` <= P steps, stopping after the farthest hop at which some
      rank's queries still read a shard, and at step i a shard travels as the rows that ranks
      s + i, s + i + 1, ... read (a halo for local masks; whole shards for causal). Each width has
      its own cached channel (widths only shrink along the ring).
    * Forward, step i = 0 .. steps-1: rank r holds (rows of) the K/V shard of rank (r - i) mod P
      (its own at i = 0, else `recv`). It first pushes the rows the next hop needs on, then computes
      its q chunks against what it holds, so the transfer for step i + 1 overlaps the compute of
      step i. A step is one kernel: of the chunk pair where the shard is one chunk (contiguous),
      else of the whole q shard against the rows held at their global positions (pairs.step_call: a
      host issues a compiled call more slowly than the device runs a pair of small chunks, so pair
      kernels would leave the device waiting). After the compute the slot is released: the onward
      push out of it is queued (joined first where it went out on the next, narrower channel), so
      the slot may be overwritten. Partials are held and merged in one pass at the end
      (accumulate.Accumulator: a q chunk that meets one K/V pair keeps the kernel's output as it is;
      so at world size 1 the call is one kernel forward and one backward).
    * Backward computes each step's gradient (its one call's, or its pair's) from the merged out and
      lse (CPOptions.backward: flex's backward op, or its forward re-run; see cp.py), steps 1 ..
      steps-1 first and the own shard last. The rows held at step 1 are kept from the forward
      (one K/V slot's copy, held from the forward to the backward; none where autograd records
      no backward), so the first step waits for no transfer; K/V travel again from hop 2 on.
      The other ranks' dK/dV of a shard (rows held at step 1) travel one push behind them: a
      rank adds its contribution and pushes the sum on; the last push goes home (the next ring
      hop after P steps, else straight back) while the home rank computes its own shard's step.
      Gradient pieces are held and summed in one pass (accumulate.GradSum): in float32 only where
      two pieces meet, nothing filled; the dK/dV a rank passes on are summed at its step.
    * Fully masked (q chunk, kv chunk) pairs are skipped (attngym.distributed.call.pairs: the
    decision
      and the pair's BlockMask live as long as the Variant object).
    * In flight at any time: one K/V push, one dK/dV push (backward), one receive per slot.
      Send nothing is the limit case: a shard no other rank reads never leaves (steps = 1).

Tensors: q_BHSD (B, H, S/P, D) and k/v_BGSD (B, G, S/P, D) are this rank's shards in `layout`;
every chunk the layout gives a rank (one for contiguous, two for zigzag, some for balanced) is
evaluated at its global positions (attend_chunk q_offset / kv_offset).
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Any

import torch

from attngym.distributed.call import flex_backward
from attngym.distributed.call.accumulate import HELD, Accumulator, GradSum
from attngym.distributed.call.cp import CPCall, CPOptions, CPStats, StepClock, run
from attngym.distributed.call.pairs import (
    Saved,
    backward_pairs,
    forward_pairs,
    one_call_steps,
    pairs,
    pow2_blocks,
    read_part,
    rows_read,
    step_call,
)
from attngym.distributed.model.simulate import (
    Item,
    ItemTime,
    SequenceRanks,
    SimulatedCall,
    Simulation,
    nbytes,
)
from attngym.distributed.model.transfer_model import Fabric, Prediction, RankWork, predict
from attngym.distributed.placement.layout import LAYOUTS, Layout
from attngym.distributed.schemes.spec import TopologySpec
from attngym.variants.base import Variant

__all__ = [
    "RING", "CPOptions", "CPStats", "backward_step", "forward_step", "ring_attention",
    "ring_transfer_ms",
]  # fmt: skip


def _channel(call: CPCall, part_shape, device, dtype: torch.dtype, tag: str, hops: int = -1):
    """The cached channel for `tag` and part shape: pushes `hops` ranks back (-1: the next rank)."""
    from attngym.distributed.transport import cached

    P, r = call.world_size, call.rank
    return cached(
        call.transport.channel,
        tuple(part_shape),
        2,
        dtype=dtype,
        device=device,
        timeout_s=call.options.timeout_s,
        group=call.group,
        tag=tag,
        src=(r + hops) % P,
        dst=(r - hops) % P,
    )


@dataclasses.dataclass(frozen=True)
class RingPlan:
    """Which rows of which shard travel at each step (the same on every rank).

    steps: ring steps the mask needs, 1 + the farthest hop at which some rank still reads a shard.
    widths[i]: rows of a shard held at step i (widths[0] = S/P, the own shard); non-increasing,
        each a power-of-two number of blocks (pairs.pow2_blocks), so that a workload's masks share
        a few kernel shapes instead of compiling anew for each batch.
    starts[s][i]: the first local row of shard s held at step i (by rank s + i).

    Rows held at step i cover every row ranks s + i, s + i + 1, ... read (from their block
    masks), and sit inside the rows held at step i - 1, so a rank forwards a slice of what it got.
    """

    steps: int
    widths: tuple[int, ...]
    starts: tuple[tuple[int, ...], ...]


# Variant -> {(layout, B, H, block size, backend, device): RingPlan}.
_RING_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def ring_plan(call: CPCall, q: torch.Tensor) -> RingPlan:
    """The RingPlan of this call (memoised per variant)."""
    key = (call.layout, *q.shape[:2], call.options.block_size, call.backend, q.device)
    per = _RING_PLANS.setdefault(call.variant, {})
    if key not in per:
        per[key] = _build_ring_plan(call, q)
    return per[key]


def _build_ring_plan(call: CPCall, q: torch.Tensor) -> RingPlan:
    P, n = call.world_size, call.seq_len // call.world_size
    reads = [[rows_read(call, q, (s + hop) % P, s) for hop in range(P)] for s in range(P)]
    last = max((hop for s in range(P) for hop in range(1, P) if reads[s][hop]), default=0)
    steps = last + 1
    spans = [[None] * steps for _ in range(P)]  # rows of shard s read at hops i .. steps - 1
    for s in range(P):
        for i in range(steps - 1, 0, -1):
            here = [x for x in (reads[s][i], spans[s][i + 1] if i + 1 < steps else None) if x]
            spans[s][i] = (min(a for a, _ in here), max(b for _, b in here)) if here else None
    block = call.options.block_size[1]
    widths = [n] + [
        pow2_blocks(max((sp[i][1] - sp[i][0] for sp in spans if sp[i]), default=1), n, block)
        for i in range(1, steps)
    ]
    starts = []
    for s in range(P):
        lo = [0]
        for i in range(1, steps):
            prev, room = lo[-1], lo[-1] + widths[i - 1] - widths[i]
            lo.append(min(max(spans[s][i][0], prev), room) if spans[s][i] else prev)
        starts.append(tuple(lo))
    return RingPlan(steps, tuple(widths), tuple(starts))


def _step_rows(
    call: CPCall, q: torch.Tensor, plan: RingPlan, i: int, masks: str | None = None
) -> list[tuple[int, int]]:
    """The local q rows (start, stop) of the pieces ring step i adds to this rank's sums: its
    partials (whole q chunks), or with `masks` (the backward's block masks) its dq pieces, each
    pair cut to the rows it reads as backward_pairs cuts it (pairs.read_part). The simulation
    replays them to time a step from the sums the steps before it leave."""
    s = (call.rank - i) % call.world_size
    window = (plan.starts[s][i], plan.widths[i])
    if one_call_steps(call):  # a step's one call covers the whole shard
        return [(0, q.shape[2])] if step_call(call, q, s, window) is not None else []
    rows = []
    # block_masks given: the same pairs, not counted in call.stats
    for pair in pairs(call, q, s, block_masks=masks or call.backend, window=window):
        q_rows = pair[0] if masks is None else read_part(call, q, pair, masks)[0]
        rows.append((q_rows.start, q_rows.stop))
    return rows


def _hops(call: CPCall, like: torch.Tensor, dtype, tag: str, plan: RingPlan, start: int = 1):
    """For each hop i = start .. steps - 1: (channel, its local step). Hops of one width share a
    channel (widths only shrink, so they are consecutive); each channel counts its steps from 1
    (the backward starts at hop 2: the rows of hop 1 were kept from the forward)."""
    out, first = {}, start
    for i in range(start, plan.steps):
        if i > start and plan.widths[i] != plan.widths[i - 1]:
            first = i
        shape = (*like.shape[:2], plan.widths[i], like.shape[3])
        out[i] = (_channel(call, shape, like.device, dtype, tag), i - first + 1)
    return out


def forward_step(
    call: CPCall, acc: Accumulator, q: torch.Tensor, k_held, v_held, s: int, i: int, plan: RingPlan
) -> None:
    """Ring step i of the forward: this rank's q chunks against the rows of shard s held (the
    plan's window at step i), folded into `acc`. The ring and its simulation run this."""
    forward_pairs(call, acc, q, k_held, v_held, s, window=(plan.starts[s][i], plan.widths[i]))


def backward_step(
    call: CPCall, saved: Saved, k_held, v_held, s: int, i: int, plan: RingPlan, dq: GradSum
) -> tuple[GradSum, GradSum]:
    """Ring step i of the backward: the pairs of this rank's q against the rows of shard s held,
    dq added into `dq`; returns the step's dK and dV sums. Step 0 (the own shard): over the whole
    shard; a later step: over the rows held at step 1 (the width the sums travel in), this step's
    rows at their offset in them. The ring and its simulation run this."""
    if i == 0:
        shape, window, offset = tuple(k_held.shape), None, 0
    else:
        shape = (*k_held.shape[:2], plan.widths[1], k_held.shape[3])
        window, offset = (plan.starts[s][i], plan.widths[i]), plan.starts[s][i] - plan.starts[s][1]
    dk, dv = (GradSum.of(call, shape, saved.lse.dtype, saved.q.device) for _ in range(2))
    backward_pairs(call, saved, k_held, v_held, s, dq, dk, dv, window=window, dkv_offset=offset)
    return dk, dv


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cfg: CPCall):
        P, r = cfg.world_size, cfg.rank
        plan = ring_plan(cfg, q)
        stats, clock = cfg.stats, StepClock(cfg.stats, q.device)
        acc = Accumulator.of(cfg, q, v.shape[-1])
        kv = (k, v)  # the own shard as is (no stacked copy); a received slot is (2, B, G, rows, D)
        hops = _hops(cfg, k, k.dtype, "kv", plan)
        kept = None  # the rows held at step 1, kept for the backward's first step
        for i in range(plan.steps):
            s = (r - i) % P
            if i > 0:
                clock.start()
                kv = hops[i][0].recv(hops[i][1])
                clock.stop("step_wait_ms")
                if i == 1 and cfg.grad:
                    kept = kv.clone()
            if i < plan.steps - 1:  # the transfer of step i + 1 overlaps this step's compute
                part = _slice(kv, plan, s, i + 1)
                hops[i + 1][0].send(part, hops[i + 1][1] - 1)
                if stats is not None:
                    stats.bytes_sent += sum(t.numel() * t.element_size() for t in part)
            clock.start()
            forward_step(cfg, acc, q, kv[0], kv[1], s, i, plan)
            clock.stop("step_compute_ms")
            if i > 0:
                _release(hops, i, plan.steps)
        for chan in _distinct(c for c, _ in hops.values()):
            chan.join()
        out, lse = acc.result()
        if stats is not None:
            stats.lse = lse
        ctx.save_for_backward(q, k, v, out, lse, kept)
        ctx.cfg, ctx.plan = cfg, plan
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, kept = ctx.saved_tensors
        cfg: CPCall = ctx.cfg
        plan: RingPlan = ctx.plan
        P, r, steps = cfg.world_size, cfg.rank, plan.steps
        sum_dtype = lse.dtype
        lse2, start = None, 0
        if cfg.backward == "flex":  # per q chunk (or the shard, for step calls), as read
            lse2 = {}
            for _, length in [(0, q.shape[2])] if one_call_steps(cfg) else cfg.chunks(r):
                rows = lse[:, :, start : start + length]
                lse2[start, start + length] = flex_backward.kernel_lse(
                    rows, cfg.options.kernel_options, q.dtype
                )
                start += length
        saved = Saved(q, out, lse, dout, lse2)
        # dq: the steps' pieces, summed in one pass at the end. dK/dV keep their first piece
        # (the own shard's, often the only one but for what comes home).
        dq = GradSum.of(cfg, q.shape, sum_dtype, q.device)
        if steps == 1:  # no shard leaves its rank
            dk_own, dv_own = backward_step(cfg, saved, k, v, r, 0, plan, dq)
            return dq.total(q.dtype), dk_own.total(k.dtype), dv_own.total(v.dtype), None
        # Steps 1 .. steps - 1 first, from the rows kept at step 1 on; K/V travel again from hop
        # 2. Contributions of the other ranks to shard s lie in the rows held at step 1; they
        # accumulate along the ring in a buffer of that width, then go home (one more ring hop
        # after all P steps, else straight back over the steps - 1 hops travelled) while this
        # rank computes its own shard's step last.
        hops = _hops(cfg, k, k.dtype, "kv", plan, start=2)
        wide = (*k.shape[:2], plan.widths[1], k.shape[3])
        chain = _channel(cfg, wide, q.device, sum_dtype, "dkv")
        home = chain if steps == P else _channel(
            cfg, wide, q.device, sum_dtype, "dkv_home", hops=steps - 1
        )  # fmt: skip
        stats = cfg.stats
        kv = kept
        for i in range(1, steps):
            s = (r - i) % P
            if i > 1:
                kv = hops[i][0].recv(hops[i][1])
            if i < steps - 1:
                onward = _slice(kv, plan, s, i + 1)
                hops[i + 1][0].send(onward, hops[i + 1][1] - 1)
                if stats is not None:
                    stats.bytes_sent += sum(t.numel() * t.element_size() for t in onward)
            dk_part, dv_part = backward_step(cfg, saved, kv[0], kv[1], s, i, plan, dq)
            if i > 1:  # the shard's dK/dV so far, one push behind K/V
                so_far = chain.recv(i - 1)
                dk_part.add(0, so_far[0], fresh=False)
                dv_part.add(0, so_far[1], fresh=False)
            part = [dk_part.total(sum_dtype), dv_part.total(sum_dtype)]
            if i < steps - 1 or home is chain:
                chain.send(part, i - 1)
            else:
                home.send(part, 0)
            if stats is not None:
                stats.bytes_sent += sum(t.numel() * t.element_size() for t in part)
            del part, dk_part, dv_part  # the channel holds what it still reads
            if i > 1:
                _release(hops, i, steps)
                chain.release(i - 1)
        del kv
        dk_own, dv_own = backward_step(cfg, saved, k, v, r, 0, plan, dq)  # the push home flies
        last = steps - 1 if home is chain else 1
        back = home.recv(last)
        dk_own.add(plan.starts[r][1], back[0], fresh=False, last=True)
        dv_own.add(plan.starts[r][1], back[1], fresh=False, last=True)
        home.release(last)
        for chan in _distinct([*(c for c, _ in hops.values()), chain, home]):
            chan.join()
        return dq.total(q.dtype), dk_own.total(k.dtype), dv_own.total(v.dtype), None


def _slice(kv, plan: RingPlan, s: int, i: int) -> list[torch.Tensor]:
    """The rows of shard s held at step i, [K, V] cut from the K and V held at step i - 1 (the
    own shard's (k, v), or a received (2, B, G, rows, D) slot)."""
    start = plan.starts[s][i] - plan.starts[s][i - 1]
    return [t.narrow(2, start, plan.widths[i]) for t in kv]


def _release(hops, i: int, steps: int) -> None:
    """Release hop i's slot. Its onward push (hop i + 1) is queued on this channel when the width
    stays, and then ordered before the slot's next write; where the width shrinks it went out on
    the next channel, whose pushes are joined first."""
    chan, step = hops[i]
    if i + 1 < steps and hops[i + 1][0] is not chan:
        hops[i + 1][0].join()
    chan.release(step)


def _distinct(channels):
    return list({id(c): c for c in channels}.values())


def ring_attention(
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
    """Attention of this rank's q shard over the whole sequence, K/V passed around a ring.

    Collective: every rank of `group` calls it with its shards (same shapes, same arguments).

    Args:
        q: (B, H, S/P, D) this rank's query shard in `layout`.
        k, v: (B, G, S/P, D) this rank's key/value shards, G dividing H (GQA).
        variant: the attention variant, evaluated at global positions. Pass it already on q's
            device to reuse its chunk block masks across calls (see the module docstring).
        group: process group of the P ranks (default: the world).
        transport: auto | copy_engine | nccl | gloo (see attngym.distributed.transport).
        layout: contiguous | zigzag | balanced, or a Layout (see
        attngym.distributed.placement.layout).
            `balanced` by name is placed by blocks, as `shard(..., variant=)` places it (a step
            of a shard of several chunks is one kernel over the whole shard, pairs.step_call).
        options: kernel and backward choices (CPOptions; default CPOptions()).
        stats: filled with pair counts, bytes and per-step timings when given.
        **overrides: any CPOptions field on top of `options` (backend, block_size,
            kernel_options, scale, timeout_s, compile, compile_mode, backward).

    Returns:
        (B, H, S/P, D) this rank's output shard, in q's dtype; differentiable w.r.t. q, k, v.
    """
    return run(
        _RingAttention,
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


def ring_transfer_ms(transport, k_s: torch.Tensor, timeout_s: float, repeats: int) -> list[float]:
    """Times of each ring step's K/V push alone (whole shards; the step clock of CPStats),
    following the channel's step protocol as the forward does: step i pushes what it holds (its
    own K/V at i = 0, else the slot received at step i) and receives step i + 1 once; the slot of
    step i is released only after its onward push is queued. Collective over the world."""
    world_size = torch.distributed.get_world_size()
    kv = torch.stack([k_s.detach(), k_s.detach()])
    chan = transport.channel(
        tuple(k_s.shape), 2, dtype=k_s.dtype, device=k_s.device, timeout_s=timeout_s
    )
    stats = CPStats()
    clock = StepClock(stats, k_s.device)
    for _ in range(repeats):
        cur = kv
        for i in range(world_size - 1):
            clock.start()
            chan.send(cur, i)
            nxt = chan.recv(i + 1)
            clock.stop("step_wait_ms")
            if i > 0:
                chan.release(i)  # the onward push out of this slot is queued
            cur = nxt
        chan.release(world_size - 1)
        chan.join()
    return stats.step_wait_ms


# ---------------------------------------------------------------------------------------------
# Simulated and priced (topology.simulate=true; attngym.distributed.model.simulate, transfer_model).


def simulate_ring(sc: SimulatedCall) -> Simulation:
    """Every rank's ring, one after another: per step i, forward_step against the rows of shard
    (r - i) mod P it would hold (the same RingPlan, windows and skipped pairs) and backward_step
    against the whole problem's merged out and lse (the values the real ring merges to)."""
    ranks = SequenceRanks(sc)
    works, sent, buffers = [], 0, 0
    for r in range(sc.world_size):
        work, rank_sent, rank_buffers = _simulated_rank(ranks, r, sc.clock)
        works.append(work)
        sent, buffers = max(sent, rank_sent), max(buffers, rank_buffers)
    sim = ranks.simulation(works)
    sim.bytes_moved, sim.peak_mem_bytes = sent, buffers
    return sim


def _simulated_rank(ranks: SequenceRanks, r: int, clock) -> tuple[RankWork, int, int]:
    """Rank r's RankWork, the bytes it sends in a forward and the bytes it holds beside the
    timed compute: its channels' slots, the rows kept, the dK/dV sums and the pieces held."""
    P, q_r = ranks.world_size, ranks.qs[r]
    call, counted = ranks.call(r), ranks.call(r, counted=True)
    saved = ranks.saved[r] if ranks.saved is not None else None
    plan = ring_plan(call, q_r)
    b, g, _, d = ranks.ks[0].shape
    itemsize = ranks.ks[0].element_size()
    kv_bytes = [nbytes(2, b, g, w, d, itemsize=itemsize) for w in plan.widths]
    acc_size = 8 if q_r.dtype == torch.float64 else 4
    dkv_bytes = nbytes(2, b, g, plan.widths[1], d, itemsize=acc_size) if plan.steps > 1 else 0
    fwd_ms, bwd_ms, fwd_in, bwd_moving, host = [], [], [], [], [0.0, 0.0]
    dv_dim = ranks.vs[0].shape[-1]
    held, held_bytes = _held_before(call, q_r, dv_dim, plan, saved)
    for i in range(plan.steps):
        s = (r - i) % P
        window = (plan.starts[s][i], plan.widths[i])
        # counts computed / skipped pairs, as the forward
        pairs(counted, q_r, s, window=window, masks=False)
        structure = _step_structure(call, q_r, s, window, clock)
        # The held rows' sizes matter to the backward's sums too, and what the step adds to
        # (the first hop's rows kept; the dK/dV so far, or coming home), and the sums held
        # where the step adds them up: part of the key.
        role = "own" if i == 0 else "first" if i == 1 else "later"
        key = ("ring", tuple(q_r.shape), plan.widths[i], plan.widths[min(1, plan.steps - 1)],
               structure, role, held[i])  # fmt: skip

        def build(s=s, i=i, key=key):
            return _step_item(call, q_r, ranks.ks[s], ranks.vs[s], s, i, plan, saved, key,
                              held[i])  # fmt: skip

        for j, (which, times) in enumerate((("fwd", fwd_ms), ("bwd", bwd_ms))):
            if which == "bwd" and saved is None:
                continue
            adds_up = held[i][j] is not None  # the step sums what is held: timed, even if empty
            timed = clock.time(build, which, key) if structure or adds_up else ItemTime(0.0)
            times.append(timed.ms)
            host[j] += timed.host_ms
        if saved is not None:
            # During step i's compute: the K/V of step i + 1 (from hop 2: hop 1's rows are
            # kept from the forward) and the dK/dV pushed after step i - 1; the own shard's
            # step runs last, while the last push goes home.
            onward = kv_bytes[i + 1] if 1 <= i < plan.steps - 1 else 0
            bwd_moving.append(onward + (dkv_bytes if i > 1 or (i == 0 and plan.steps > 1) else 0))
        fwd_in.append(kv_bytes[i] if i > 0 else 0)
    slots = 2 * kv_bytes[1] if plan.steps > 1 else 0
    work = RankWork(
        fwd_ms=tuple(fwd_ms),
        bwd_ms=tuple(bwd_ms),
        fwd_bytes=tuple(fwd_in),
        bwd_bytes=tuple(bwd_moving),
        host_fwd_ms=host[0],
        host_bwd_ms=host[1],
    )
    kept = kv_bytes[1] if saved is not None and plan.steps > 1 else 0  # step 1's rows, kept
    buffers = slots + kept + (2 * dkv_bytes if saved else 0) + held_bytes  # + pieces held
    return work, sum(kv_bytes[1 : plan.steps]), buffers


def _step_structure(call, q_r, s, window, clock) -> tuple:
    """What a step's time depends on: each kernel's shapes and block-mask structure (its one
    step_call, or its chunk pairs); () when it computes nothing."""
    if one_call_steps(call):
        step = step_call(call, q_r, s, window)
        if step is None:
            return ()
        return ((q_r.shape[2], window[1], clock.mask_key(step.block_mask)),)
    return tuple(
        (qr.stop - qr.start, kr.stop - kr.start, clock.mask_key(bm))
        for qr, kr, _, _, bm in pairs(call, q_r, s, block_masks="flex", window=window)
    )


def _held_before(call, q_r, dv_dim: int, plan: RingPlan, saved) -> tuple[list[tuple], int]:
    """Per step i: (forward, backward) the sums this rank holds before the step, where the
    step's time depends on them: the step that adds them up (the forward's last; the backward's
    own, run last) or adds to a sum holding accumulate.HELD pieces; else None (the step only holds
    its pieces). And the most bytes of pieces held at once. Replayed with the pieces' shapes only
    (on "meta")."""
    last = {"fwd": plan.steps - 1, "bwd": 0}
    out, most = [[None, None] for _ in range(plan.steps)], 0
    row = q_r.shape[0] * q_r.shape[1] * max(q_r.shape[3], dv_dim) * q_r.element_size()
    for j, which in enumerate(("fwd", "bwd") if saved is not None else ("fwd",)):
        sums = _sums(call, q_r, dv_dim, saved, which, "meta")
        for i in _order(plan, which):
            now = sums.held()
            if i == last[which] or any(count >= HELD for *_, count in now):
                out[i][j] = now
            _add_step(sums, call, q_r, dv_dim, plan, i, which)
            most = max(most, sum((b - a) * count for a, b, count in sums.held()) * row)
    return [tuple(x) for x in out], most


def _order(plan: RingPlan, which: str) -> list[int]:
    """The steps in the order a pass runs them: the forward 0 .. steps - 1, the backward
    1 .. steps - 1 and the own shard's last."""
    return list(range(plan.steps)) if which == "fwd" else [*range(1, plan.steps), 0]


def _sums(call, q_r, dv_dim: int, saved, which: str, device):
    """A new sum of this rank's pass on `device`, as the ring makes it: the forward's
    Accumulator, the backward's dq GradSum."""
    device = torch.device(device)
    if which == "fwd":
        like = q_r if device == q_r.device else torch.empty_like(q_r, device=device)
        return Accumulator.of(call, like, dv_dim)
    return GradSum.of(call, q_r.shape, saved.lse.dtype, device)


def _add_step(sums, call, q_r, dv_dim: int, plan: RingPlan, i: int, which: str) -> None:
    """Add random pieces of the shapes step i adds (_step_rows) to `sums`, on its device."""
    b, h, _, d = q_r.shape
    device, gen = sums.device, torch.randn
    if which == "fwd":
        for a, z in _step_rows(call, q_r, plan, i):
            out_i = gen(b, h, z - a, dv_dim, device=device).to(q_r.dtype)
            sums.add(slice(a, z), out_i, gen(b, h, z - a, dtype=sums.acc_dtype, device=device))
        return
    masks = "flex" if call.backward == "flex" else call.backend  # as backward_pairs reads
    for a, z in _step_rows(call, q_r, plan, i, masks):
        sums.add(a, gen(b, h, z - a, d, device=device).to(q_r.dtype))


def _step_item(call, q_r, k_s, v_s, s, i, plan, saved, key, held) -> Item:
    """Ring step i of rank call.rank as an Item: its forward_step and backward_step on the rows
    it holds, with the sums the ring's step does: the partials and dq pieces held, added up by
    the step that sums them (or adds to HELD of them), from the pieces the steps before it
    leave; the dK/dV so far added; the own step (the backward's last) also writes out the
    shard's dK/dV and adds those that come home. `held`: the step's (forward, backward) entry
    of _held_before."""
    start, width = plan.starts[s][i], plan.widths[i]
    k_h, v_h = (t.narrow(2, start, width).contiguous() for t in (k_s, v_s))
    dv_dim = v_s.shape[-1]

    @functools.cache
    def before(which: str):
        """The sums the steps before leave (fresh ones where the step only holds its pieces).
        Built at the first call, which the timer keeps apart (compilation), so that a timer
        pricing block masks builds none of it."""
        sums = _sums(call, q_r, dv_dim, saved, which, q_r.device)
        if held[0 if which == "fwd" else 1] is not None:
            order = _order(plan, which)
            for j in order[: order.index(i)]:
                _add_step(sums, call, q_r, dv_dim, plan, j, which)
        return sums

    def fwd():
        with torch.no_grad():
            if i == 1 and saved is not None:  # the rows held at step 1, kept for the backward
                torch.stack([k_h, v_h])
            acc = before("fwd").fork()
            forward_step(call, acc, q_r, k_h, v_h, s, i, plan)
            if i == plan.steps - 1:  # the last step: the partials merged, the output written
                acc.result()

    bwd = None
    if saved is not None:
        sum_dtype, device = saved.lse.dtype, q_r.device
        wide = (*k_s.shape[:2], plan.widths[min(1, plan.steps - 1)], k_s.shape[3])
        # From step 2 on the dK/dV so far arrive (a receive slot's worth); at the own step the
        # sums come home.
        so_far = torch.randn((2, *wide), dtype=sum_dtype, device=device) if i > 1 else None
        home = (torch.randn((2, *wide), dtype=sum_dtype, device=device)
                if i == 0 and plan.steps > 1 else None)  # fmt: skip

        def bwd():
            with torch.no_grad():
                dq = before("bwd").fork()
                dk, dv = backward_step(call, saved, k_h, v_h, s, i, plan, dq)
                if so_far is not None:
                    dk.add(0, so_far[0], fresh=False)
                    dv.add(0, so_far[1], fresh=False)
                if home is not None:
                    at = plan.starts[call.rank][1]
                    dk.add(at, home[0], fresh=False, last=True)
                    dv.add(at, home[1], fresh=False, last=True)
                if i == 0:  # the last step: dq's pieces summed and written out
                    dq.total(q_r.dtype)
                out_dtype = k_s.dtype if i == 0 else sum_dtype
                for grad, dtype in ((dk, out_dtype), (dv, out_dtype)):
                    grad.total(dtype)

    if one_call_steps(call):
        step = step_call(call, q_r, s, (start, width))
        masks = () if step is None else (step.block_mask,)
    else:
        masks = tuple(bm for *_, bm in pairs(call, q_r, s, block_masks="flex",
                                             window=(start, width)))  # fmt: skip
    return Item(key=key, fwd=fwd, bwd=bwd, block_masks=masks)


def ring_rank_ms(work: RankWork, fab: Fabric, backward: bool, crossing: float = 0.0) -> float:
    """Per step, max(compute of step i, transfer of step i + 1's data), summed; backward: each
    step's compute against the pushes in flight during it (the last dK/dV push home flies during
    the own shard's step, which the ring's backward runs last), then any tail.

    fwd_bytes[i] is what arrives for step i (fwd_bytes[0] = 0: the own shard); bwd_bytes[i] what
    moves during backward step i; `crossing`: the share of a push that crosses NVLink domains
    (Fabric.neighbour_crossing).
    """
    steps = len(work.fwd_ms)
    total = 0.0
    for i in range(steps):
        nxt = work.fwd_bytes[i + 1] if i + 1 < steps else 0.0
        total += max(work.fwd_ms[i], fab.ms("channel", nxt, crossing))
    if backward:
        for i, compute in enumerate(work.bwd_ms):
            moving = work.bwd_bytes[i] if work.bwd_bytes else 0
            total += max(compute, fab.ms("channel", moving, crossing))
        total += fab.ms("channel", work.tail_bwd_bytes, crossing)
    return total


def price_ring(sim: Simulation, fab: Fabric, backward: bool) -> Prediction:
    """The ring's call on `fab`: each rank's steps overlapped with its pushes (ring_rank_ms),
    every push at the slowest hop's link once the ring leaves an NVLink domain."""
    crossing = fab.neighbour_crossing(len(sim.ranks), sim.stride)
    return predict(functools.partial(ring_rank_ms, crossing=crossing), sim.ranks, fab, backward)


RING = TopologySpec(
    name="ring", attention=ring_attention, layouts=LAYOUTS, user_layouts=True,
    timer=ring_transfer_ms, step_kernels=True, simulate=simulate_ring, price=price_ring,
    pickable=True,
)  # fmt: skip
