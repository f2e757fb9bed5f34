"""Simulated ranks: every rank's exact compute of a context-parallel call, one after another on one
device, timed, with the bytes its transfers would move.

For P ranks (any P, whatever the GPUs present), rank r's work is what the algorithm computes on
rank r, built from the same plans, pair block masks and kernels, with the K/V the rank would hold
cut locally from the whole inputs (nothing is transferred):

    ring       per ring step i, the pairs of its q chunks against the rows of shard (r - i) mod P
               it holds (ring.ring_plan: the same RingPlan, windows and skipped pairs):
               cp.forward_pairs into a fresh accumulator, and cp.backward_pairs against the
               merged out and lse of the whole problem (the values the real ring merges to).
    allgather  its one call (cp.attend) on the keys it would gather (allgather.halo_plan: its own
               shard and the rows others send), with the mapped variant and block mask the
               algorithm builds; backward: that call's own.
    ulysses    its one call on its head slice of the whole sequence (K/V heads repeated up to
               lcm(G, P) as the all-to-all does), the head-shifted variant and block mask of
               ulysses_attention.
    hybrid     the across algorithm over the P / a2a_size groups on a group's head slice
               (H / a2a_size heads); every member of a group does the same work.

Identical work is timed once: an item (a ring step's pairs, or a call) is keyed by its shapes and
the structure of its block masks (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
block size) and every item with that key shares one timing, so causal at P = 512 times a handful of
distinct steps, not 512². A variant whose score_mod depends on positions in a way the block mask
does not show (ALiBi) costs the same per block, so this is a timing key, not a numerical one.
Building the plans costs what one real rank pays (the ring's and all-gather's plans ask every
(q rank, kv rank) pair for its block mask: O(P²) masks, memoised per variant); `Simulation.wall_s`
reports the whole simulation's time and `timed` / `items` how much timing the keys saved.

Timing is the project's (bench.time_fn through a `Timer`: CUDA events, warm-up, the L2 cache
flushed; host clock on CPU). A Timer is a parameter so tests and the layout's cost model can
price items from their block masks instead.
Shape legend: B batch, H query heads, G kv heads, S sequence, D head dim, P ranks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import time
from collections.abc import Callable
from typing import Any

import torch

from attngym import kernels
from attngym.distributed import layout as layouts
from attngym.distributed.cp import (
    Accumulator,
    CPCall,
    CPOptions,
    CPStats,
    GradSum,
    Saved,
    attend,
    backward_pairs,
    forward_pairs,
    pairs,
)
from attngym.distributed.transfer_model import RankWork
from attngym.variants.base import Variant

SCHEMES = ("ring", "allgather", "ulysses", "hybrid")


@dataclasses.dataclass
class Item:
    """One piece of a rank's work to time: `fwd()` (and `bwd()`), keyed by its structure.

    block_masks: the flex block masks it runs on (None entries on the reference backend), for
    timers that price blocks; key: shapes and block-mask structure (see the module docstring).
    """

    key: tuple
    fwd: Callable[[], Any]
    bwd: Callable[[], Any] | None
    block_masks: tuple[Any, ...] = ()


# (item, "fwd" | "bwd") -> (ms, peak bytes the call adds, or 0 where not measured).
Timer = Callable[[Item, str], tuple[float, int]]


def bench_timer(device: torch.device, warmup: int, repeats: int) -> Timer:
    """The project's timing (bench.time_fn) of an item's pass, with the device peak it adds."""
    from attngym import bench
    from attngym.device import peak_memory, sync

    def timer(item: Item, which: str) -> tuple[float, int]:
        fn = item.fwd if which == "fwd" else item.bwd
        # First calls apart (compilation), as phases.first_call: two, as a ring step's first
        # call keeps its partials and the next ones merge into them (the merge compiles then),
        # which a warmup of 0 would otherwise time.
        fn()
        fn()
        sync(device)
        with peak_memory(device) as peak:
            timing = bench.time_fn(fn, warmup=warmup, repeats=repeats, device=device)
        return timing.median_ms, peak["bytes"] if device.type == "cuda" else 0

    return timer


@dataclasses.dataclass
class Simulation:
    """What the simulated ranks did: per-rank work for the transfer model, and the counts the
    real run's CPStats would report."""

    scheme: str  # ring | allgather | ulysses (hybrid: its across scheme, over the groups)
    world_size: int
    ranks: list[RankWork]
    pairs_computed: int = 0  # summed over the ranks, as the CP task's instrument phase
    pairs_skipped: int = 0
    bytes_moved: int = 0  # one forward, the most any rank sends (CPStats.bytes_sent)
    peak_mem_bytes: int = 0  # the largest rank: the timed compute's peak plus its buffers
    items: int = 0  # items of work over all ranks and passes
    timed: int = 0  # distinct items timed
    wall_s: float = 0.0
    exchange: RankWork | None = None  # hybrid: the in-group all-to-all's bytes


class _Clock:
    """Times items once per key; counts how many there were."""

    def __init__(self, timer: Timer):
        self.timer, self.seen, self.items = timer, {}, 0
        self.peak = 0

    def ms(self, item: Item | Callable[[], Item], which: str, key: tuple | None = None) -> float:
        """The item's time for `which`; `item` may be a builder, called only for a new key."""
        self.items += 1
        seen = (which, item.key if key is None else key)
        if seen not in self.seen:
            built = item() if key is not None else item
            ms, peak = self.timer(built, which)
            self.seen[seen] = ms
            self.peak = max(self.peak, peak)
        return self.seen[seen]


_MASK_KEYS: dict[int, tuple] = {}


def mask_key(block_mask) -> tuple | None:
    """The structure of a BlockMask as a hashable key (None for none)."""
    if block_mask is None:
        return None
    ident = id(block_mask)
    cached = _MASK_KEYS.get(ident)
    if cached is not None and cached[0] is block_mask:
        return cached[1]
    digest = hashlib.sha1()
    for t in (
        block_mask.kv_num_blocks,
        block_mask.kv_indices,
        block_mask.full_kv_num_blocks,
        block_mask.full_kv_indices,
    ):
        if t is None:
            digest.update(b"none")
        else:
            digest.update(str(tuple(t.shape)).encode())
            digest.update(t.detach().to("cpu", torch.int32).contiguous().numpy().tobytes())
    key = (tuple(block_mask.BLOCK_SIZE), tuple(block_mask.seq_lengths), digest.hexdigest())
    _MASK_KEYS[ident] = (block_mask, key)
    return key


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(num_blocks, indices) of a (rows, cols) bool block grid, kept columns first in order, as
    create_block_mask orders them; shaped (1, 1, ...) for BlockMask.from_kv_blocks."""
    num = dense.sum(-1, dtype=torch.int32)
    idx = torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True)
    return num[None, None], idx.to(torch.int32)[None, None]


class GridPlans:
    """Chunk-pair plans cut from one whole-sequence block mask, for cp.PLAN_SOURCES.

    A pair whose chunks start and end on block boundaries has exactly the blocks of the whole
    mask's sub-grid (full blocks full, partial ones partial), so its BlockMask is built from them
    (BlockMask.from_kv_blocks with the variant's mask at the pair's offsets) instead of
    evaluating the mask again: the O(P²) pair plans of ring and all-gather cost tensor slicing,
    not mask evaluation; pairs whose blocks are all full share one BlockMask per shape. Other
    pairs (unaligned chunks) return None and are built as usual. The skip decision (no kept
    block) is the flex block mask's, for the reference backend too: like every block mask here
    it is evaluated at batch 0 and head 0.
    """

    def __init__(self, variant: Variant, seq_len: int, block_size, device):
        self.variant, self.block, self.device = variant, tuple(block_size), torch.device(device)
        self.seq_len = seq_len
        # (rows, cols) -> the BlockMask of a pair whose blocks are all full: one object for every
        # such pair, as flex never evaluates the mask on a full block (its mask_mod, at the first
        # such pair's offsets, is never called).
        self.all_full: dict[tuple, Any] = {}
        whole = self.whole = kernels.make_block_mask(
            variant, seq_len, seq_len, block_size=self.block, device=device
        )
        self.usable = whole is not None
        if not self.usable:  # no mask: every pair full, built as usual
            return
        n_kv = -(-seq_len // self.block[1])
        self.partial = _dense(whole.kv_num_blocks, whole.kv_indices, n_kv)
        self.full = (
            torch.zeros_like(self.partial)
            if whole.full_kv_num_blocks is None
            else _dense(whole.full_kv_num_blocks, whole.full_kv_indices, n_kv)
        )

    def covers(self, seq_len: int, block_size, device) -> bool:
        """Whether this grid is the one of a call of this length, block size and device."""
        same = (seq_len, tuple(block_size), torch.device(device))
        return (self.seq_len, self.block, self.device) == same

    def __call__(self, batch, heads, q_chunk, kv_chunk, block_size, backend, device):
        from torch.nn.attention.flex_attention import BlockMask

        bq, bk = self.block
        aligned = all(x % bq == 0 for x in q_chunk) and all(x % bk == 0 for x in kv_chunk)
        inside = max(sum(q_chunk), sum(kv_chunk)) <= self.seq_len
        same = tuple(block_size) == self.block and torch.device(device) == self.device
        if not (self.usable and aligned and inside and same):
            return None
        rows = slice(q_chunk[0] // bq, (q_chunk[0] + q_chunk[1]) // bq)
        cols = slice(kv_chunk[0] // bk, (kv_chunk[0] + kv_chunk[1]) // bk)
        partial, full = self.partial[rows, cols], self.full[rows, cols]
        if not bool((partial | full).any()):
            return True, None
        if backend == "reference":
            return False, None
        whole_full = not bool(partial.any()) and bool(full.all())
        if whole_full and partial.shape in self.all_full:
            return False, self.all_full[partial.shape]
        _, mask_mod = kernels.shifted_mods(self.variant, q_chunk[0], kv_chunk[0], device)
        block_mask = BlockMask.from_kv_blocks(
            *_ordered(partial), *_ordered(full), BLOCK_SIZE=self.block, mask_mod=mask_mod,
            seq_lengths=(q_chunk[1], kv_chunk[1]),
        )  # fmt: skip
        if whole_full:
            self.all_full[partial.shape] = block_mask
        return False, block_mask


def _dense(num: torch.Tensor, idx: torch.Tensor, n_kv: int) -> torch.Tensor:
    """(rows, n_kv) bool: the blocks a (1, 1, rows) count and (1, 1, rows, K) index table keep."""
    num, idx = num[0, 0].long(), idx[0, 0].long()
    valid = torch.arange(idx.shape[-1], device=idx.device)[None, :] < num[:, None]
    out = torch.zeros((idx.shape[0], n_kv + 1), dtype=torch.bool, device=idx.device)
    out.scatter_(1, torch.where(valid, idx, n_kv), True)
    return out[:, :n_kv]


def _call(variant, layout, options, backend, backward, rank, world_size, seq_len, stats=None):
    """A CPCall for rank `rank` with no process group and no transport (nothing moves)."""
    return CPCall(
        variant=variant,
        group=None,
        transport=None,
        layout=layout,
        options=options,
        backend=backend,
        backward=backward,
        rank=rank,
        world_size=world_size,
        seq_len=seq_len,
        stats=stats,
    )


def _nbytes(*shape: int, itemsize: int) -> int:
    return math.prod(shape) * itemsize


def simulate(
    scheme: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor | None,
    variant: Variant,
    *,
    world_size: int,
    layout: str | layouts.Layout = "contiguous",
    options: CPOptions | None = None,
    a2a_size: int | None = None,
    across: str = "ring",
    timer: Timer,
) -> Simulation:
    """Every rank's compute of `scheme` over `world_size` ranks, timed one after another.

    Args:
        scheme: ring | allgather | ulysses | hybrid.
        q: (B, H, S, D) the whole queries; k, v: (B, G, S, D); grad_out: (B, H, S, D), or None
            for a forward-only simulation.
        variant: the attention variant (on q's device).
        world_size: P, the ranks simulated (any P the layout and heads allow).
        layout: the layout name (or a Layout) the real call would take.
        options: the CP options (backend, block size, kernel options, compile, backward).
        a2a_size, across: hybrid's group size (required here: no NVLink domains to ask) and
            algorithm among the groups.
        timer: how an item is timed (bench_timer for the project's timing).

    Returns:
        A Simulation with each rank's RankWork (compute per step, bytes per step).
    """
    start = time.perf_counter()
    opts = options if options is not None else CPOptions()
    clock = _Clock(timer)
    if scheme == "hybrid":
        sim = _hybrid(q, k, v, grad_out, variant, world_size, layout, opts, a2a_size, across, clock)
    elif scheme == "ulysses":
        sim = _ulysses(q, k, v, grad_out, variant, world_size, opts, clock)
    elif scheme in ("ring", "allgather"):
        sim = _sequence(scheme, q, k, v, grad_out, variant, world_size, layout, opts, clock)
    else:
        raise ValueError(f"scheme: expected one of {', '.join(SCHEMES)}, got {scheme!r}")
    sim.items, sim.timed = clock.items, len(clock.seen)
    sim.peak_mem_bytes += clock.peak
    sim.wall_s = time.perf_counter() - start
    return sim


def _sequence(scheme, q, k, v, grad_out, variant, P, layout, opts, clock) -> Simulation:
    """ring or allgather over P ranks of the sequence."""
    from attngym.distributed.cp import _resolve_backward

    seq_len = q.shape[2]
    backend = kernels.resolve_backend(opts.backend, q.device)
    backward = _resolve_backward(opts)
    variant = variant.to(q.device) if variant.device not in (None, q.device) else variant
    plan = layouts.resolve(layout, P, seq_len, variant, q.device)
    from attngym.distributed.cp import PLAN_SOURCES

    grid = PLAN_SOURCES.get(variant)
    if grid is None or not grid.covers(seq_len, opts.block_size, q.device):
        grid = PLAN_SOURCES[variant] = GridPlans(variant, seq_len, opts.block_size, q.device)
    positions = [plan.positions(r, q.device) for r in range(P)]
    qs = [q.index_select(2, p) for p in positions]
    ks = [k.index_select(2, p) for p in positions]
    vs = [v.index_select(2, p) for p in positions]
    saved = None
    if grad_out is not None:
        out, lse = kernels.attend_chunk(
            q, k, v, variant, backend=backend, block_size=opts.block_size,
            block_mask=grid.whole if backend == "flex" else None,
            kernel_options=opts.kernel_options, scale=opts.scale, compile=opts.compile,
            compile_mode=opts.compile_mode,
        )  # fmt: skip
        acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        saved = [
            Saved(qs[r], out.index_select(2, p), lse.index_select(2, p).to(acc_dtype),
                  grad_out.index_select(2, p))
            for r, p in enumerate(positions)
        ]  # fmt: skip
    sim = Simulation(scheme, P, [])
    stats = CPStats()
    build = _ring_rank if scheme == "ring" else _allgather_rank
    for r in range(P):
        # `counted` counts pairs as the real forward does (once); the timed work counts none.
        counted = _call(variant, plan, opts, backend, backward, r, P, seq_len, stats)
        call = _call(variant, plan, opts, backend, backward, r, P, seq_len)
        work = build(call, counted, r, qs, ks, vs, saved[r] if saved else None, clock, sim)
        sim.ranks.append(work)
    sim.pairs_computed, sim.pairs_skipped = stats.pairs_computed, stats.pairs_skipped
    return sim


def _step_key(call, q_r, kv_rank, window) -> tuple:
    """The structure of one ring step: its pairs' row counts and block masks."""
    return tuple(
        (qr.stop - qr.start, kr.stop - kr.start, mask_key(bm))
        for qr, kr, _, _, bm in pairs(call, q_r, kv_rank, block_masks="flex", window=window)
    )


def _ring_rank(call, counted, r, qs, ks, vs, saved, clock, sim) -> RankWork:
    from attngym.distributed.ring import ring_plan

    P, q_r = call.world_size, qs[r]
    plan = ring_plan(call, q_r)
    b, g, _, d = ks[0].shape
    itemsize = ks[0].element_size()
    kv_bytes = [_nbytes(2, b, g, w, d, itemsize=itemsize) for w in plan.widths]
    acc_size = 8 if q_r.dtype == torch.float64 else 4
    dkv_bytes = _nbytes(2, b, g, plan.widths[1], d, itemsize=acc_size) if plan.steps > 1 else 0
    fwd_ms, bwd_ms, fwd_in, bwd_moving = [], [], [], []
    for i in range(plan.steps):
        s = (r - i) % P
        window = (plan.starts[s][i], plan.widths[i])
        pairs(counted, q_r, s, window=window)  # counts computed / skipped pairs, as the forward
        key = _step_key(call, q_r, s, window)
        # The held rows' sizes matter to the backward's accumulator too: part of the key.
        key = ("ring", tuple(q_r.shape), plan.widths[i], plan.widths[min(1, plan.steps - 1)], key)

        def build(s=s, i=i, key=key):
            return _ring_item(call, q_r, ks[s], vs[s], s, i, plan, saved, key)

        fwd_ms.append(clock.ms(build, "fwd", key) if key[-1] else 0.0)
        if saved is not None:
            bwd_ms.append(clock.ms(build, "bwd", key) if key[-1] else 0.0)
            onward = kv_bytes[i + 1] if i + 1 < plan.steps else 0
            bwd_moving.append(onward + (dkv_bytes if i > 0 else 0))
        fwd_in.append(kv_bytes[i] if i > 0 else 0)
    sent = sum(kv_bytes[1 : plan.steps])
    sim.bytes_moved = max(sim.bytes_moved, sent)
    slots = 2 * kv_bytes[1] if plan.steps > 1 else 0
    sim.peak_mem_bytes = max(sim.peak_mem_bytes, slots + (2 * dkv_bytes if saved else 0))
    return RankWork(
        fwd_ms=tuple(fwd_ms),
        bwd_ms=tuple(bwd_ms),
        fwd_bytes=tuple(fwd_in),
        bwd_bytes=tuple(bwd_moving),
        tail_bwd_bytes=dkv_bytes if saved is not None else 0,
    )


def _ring_item(call, q_r, k_s, v_s, s, i, plan, saved, key) -> Item:
    """Ring step i of rank call.rank: its forward pairs and backward pairs on the rows held."""
    start, width = plan.starts[s][i], plan.widths[i]
    window = (start, width)
    k_h, v_h = (t.narrow(2, start, width).contiguous() for t in (k_s, v_s))
    acc = Accumulator.of(call, q_r, v_s.shape[-1])

    def fwd():
        with torch.no_grad():
            forward_pairs(call, acc, q_r, k_h, v_h, s, window=window)

    bwd = None
    if saved is not None:
        sum_dtype = saved.lse.dtype
        rows = plan.widths[1] if (i > 0 and plan.steps > 1) else k_h.shape[2]
        wide = (*k_s.shape[:2], rows, k_s.shape[3])
        offset = start - plan.starts[s][1] if i > 0 else 0

        def bwd():
            # As the ring's backward: gradients summed as they come (cp.GradSum), the own
            # shard's dK/dV in the input dtype, a travelling step's in the sum dtype.
            with torch.no_grad():
                dq = GradSum(q_r.shape, sum_dtype, q_r.device)
                dk, dv = (GradSum(wide, sum_dtype, q_r.device) for _ in range(2))
                backward_pairs(call, saved, k_h, v_h, s, dq, dk, dv, window=window,
                               dkv_offset=offset)  # fmt: skip
                out_dtype = k_s.dtype if i == 0 else sum_dtype
                for grad, dtype in ((dq, q_r.dtype), (dk, out_dtype), (dv, out_dtype)):
                    grad.total(dtype)  # the sums written out, as the ring's step does

    masks = tuple(bm for *_, bm in pairs(call, q_r, s, block_masks="flex", window=window))
    return Item(key=key, fwd=fwd, bwd=bwd, block_masks=masks)


def _allgather_rank(call, counted, r, qs, ks, vs, saved, clock, sim) -> RankWork:
    from attngym.distributed.allgather import HaloPlan, _mapped, halo_plan

    P, q_r = call.world_size, qs[r]
    n = ks[0].shape[2]
    plan = halo_plan(call, q_r) if P > 1 else HaloPlan(n, (0,))
    w = plan.width
    if P > 1 and 0 < w < n:  # this rank's whole shard, then the other ranks' rows
        rows = [(t[p].narrow(2, plan.starts[p], w)) for t in (ks, vs) for p in range(P)]
        others = [p for p in range(P) if p != r]
        k_all = torch.cat([ks[r], *(rows[p] for p in others)], dim=2)
        v_all = torch.cat([vs[r], *(rows[P + p] for p in others)], dim=2)
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

    key = ("allgather", tuple(q_r.shape), tuple(k_all.shape), mask_key(block_mask))
    item = Item(key=key, fwd=fwd, bwd=bwd, block_masks=(block_mask,))
    fwd_ms = clock.ms(item, "fwd")
    bwd_ms = clock.ms(item, "bwd") if saved is not None else None
    b, g, _, d = ks[0].shape
    received = _nbytes(2, b, g, w, d, itemsize=ks[0].element_size()) * (P - 1)
    sim.bytes_moved = max(sim.bytes_moved, received)
    buffer = _nbytes(2, b, g, P * w, d, itemsize=ks[0].element_size())
    sim.peak_mem_bytes = max(sim.peak_mem_bytes, buffer * (2 if saved is not None else 1))
    # fwd-and-bwd as one item: the backward item re-runs the forward under autograd (flex's
    # backward needs its graph), so its time is fwd+bwd; the backward alone is the difference.
    return RankWork(
        fwd_ms=(fwd_ms,),
        bwd_ms=() if bwd_ms is None else (max(bwd_ms - fwd_ms, 0.0),),
        fwd_bytes=(received,),
        bwd_bytes=(received,),
    )


def _ulysses(q, k, v, grad_out, variant, P, opts, clock) -> Simulation:
    from attngym.distributed.ulysses import _plan, check_ulysses_heads

    b, h, seq_len, d = q.shape
    check_ulysses_heads(h, k.shape[1], P)
    backend = kernels.resolve_backend(opts.backend, q.device)
    variant = variant.to(q.device) if variant.device not in (None, q.device) else variant
    replicas = math.lcm(k.shape[1], P) // k.shape[1]
    k_rep, v_rep = (t.repeat_interleave(replicas, dim=1) for t in (k, v))
    hp, rp = h // P, k_rep.shape[1] // P
    sim = Simulation("ulysses", P, [])
    itemsize = q.element_size()
    for r in range(P):
        q_h = q[:, r * hp : (r + 1) * hp].contiguous()
        k_h = k_rep[:, r * rp : (r + 1) * rp].contiguous()
        v_h = v_rep[:, r * rp : (r + 1) * rp].contiguous()
        heads = hp if kernels.offsets_as_tables(opts.kernel_options) else None
        shifted, block_mask = _plan(
            variant, r * hp, heads, seq_len, opts.block_size, backend, q.device
        )

        def call(q_h=q_h, k_h=k_h, v_h=v_h, shifted=shifted, block_mask=block_mask):
            return kernels.attend_chunk(
                q_h, k_h, v_h, shifted, backend=backend, block_size=opts.block_size,
                block_mask=block_mask, kernel_options=opts.kernel_options, scale=opts.scale,
                compile=opts.compile, compile_mode=opts.compile_mode,
            )[0]  # fmt: skip

        def fwd(call=call):
            with torch.no_grad():
                call()

        bwd = None
        if grad_out is not None:
            g_h = grad_out[:, r * hp : (r + 1) * hp].contiguous()
            leaves = [t.detach().requires_grad_() for t in (q_h, k_h, v_h)]

            def bwd(g_h=g_h, leaves=leaves, shifted=shifted, block_mask=block_mask):
                with torch.enable_grad():
                    out = kernels.attend_chunk(
                        *leaves, shifted, backend=backend, block_size=opts.block_size,
                        block_mask=block_mask, kernel_options=opts.kernel_options,
                        scale=opts.scale, compile=opts.compile, compile_mode=opts.compile_mode,
                    )[0]  # fmt: skip
                    torch.autograd.grad(out, leaves, g_h)

        key = ("ulysses", tuple(q_h.shape), tuple(k_h.shape), mask_key(block_mask))
        item = Item(key=key, fwd=fwd, bwd=bwd, block_masks=(block_mask,))
        fwd_ms = clock.ms(item, "fwd")
        both = clock.ms(item, "bwd") if grad_out is not None else None
        # As ulysses._exchange counts: q, k, v (K/V heads repeated) out and the output back, each
        # rank keeping its own 1/P.
        shard = seq_len // P
        qkv = (b * h * shard * d + 2 * b * k_rep.shape[1] * shard * d) * itemsize
        out_bytes = b * h * shard * d * itemsize
        sim.bytes_moved = max(sim.bytes_moved, (qkv + out_bytes) * (P - 1) // P)
        sim.pairs_computed += 1
        sim.ranks.append(
            RankWork(
                fwd_ms=(fwd_ms,),
                bwd_ms=() if both is None else (max(both - fwd_ms, 0.0),),
                fwd_bytes=(qkv * (P - 1) / P,),
                tail_fwd_bytes=out_bytes * (P - 1) / P,
            )
        )
        heads_whole = (hp + 2 * rp) * b * seq_len * d * itemsize
        sim.peak_mem_bytes = max(sim.peak_mem_bytes, heads_whole + b * hp * seq_len * d * itemsize)
    return sim


def _hybrid(q, k, v, grad_out, variant, P, layout, opts, a2a_size, across, clock) -> Simulation:
    """hybrid: the across scheme over the groups on one head slice; the in-group exchange's
    bytes as Ulysses counts them over a2a_size ranks."""
    from attngym.distributed.ulysses import check_ulysses_heads

    if a2a_size is None or P % a2a_size:
        raise ValueError(
            f"a2a_size: simulated hybrid needs a divisor of world_size={P} (no NVLink domains to "
            f"take it from), got {a2a_size!r}"
        )
    b, h, seq_len, d = q.shape
    check_ulysses_heads(h, k.shape[1], a2a_size)
    replicas = math.lcm(k.shape[1], a2a_size) // k.shape[1]
    k_rep, v_rep = (t.repeat_interleave(replicas, dim=1) for t in (k, v))
    ha, ra = h // a2a_size, k_rep.shape[1] // a2a_size
    groups = P // a2a_size
    head = (slice(None), slice(0, ha))
    kv_head = (slice(None), slice(0, ra))
    if groups == 1:
        inner = _ulysses(q, k, v, grad_out, variant, a2a_size, opts, clock)
        inner.scheme = "ulysses"
        return inner
    g_out = None if grad_out is None else grad_out[head].contiguous()
    inner = _sequence(
        across, q[head].contiguous(), k_rep[kv_head].contiguous(), v_rep[kv_head].contiguous(),
        g_out, variant, groups, layout, opts, clock,
    )  # fmt: skip
    itemsize = q.element_size()
    shard = seq_len // P
    qkv = (b * h * shard * d + 2 * b * k_rep.shape[1] * shard * d) * itemsize
    out_bytes = b * h * shard * d * itemsize
    keep = (a2a_size - 1) / a2a_size
    inner.exchange = RankWork(fwd_ms=(), fwd_bytes=(qkv * keep,), tail_fwd_bytes=out_bytes * keep)
    inner.bytes_moved += int((qkv + out_bytes) * keep)
    inner.pairs_computed *= a2a_size
    inner.pairs_skipped *= a2a_size
    inner.world_size = P
    return inner
