"""Simulated ranks: every rank's exact compute of a context-parallel call, one after another on one
device, timed, with the bytes its transfers would move.

For P ranks (any P, whatever the GPUs present), rank r's work is what the scheme computes on
rank r, built from the same plans, pair block masks and kernels, with the K/V the rank would hold
cut locally from the whole inputs (nothing is transferred). Each scheme states how in its own
module (its TopologySpec's `simulate`, driving its own step functions: ring.simulate_ring,
allgather.simulate_allgather, ulysses.simulate_ulysses and simulate_hybrid); this module holds
what they share:

    SimulatedCall  the whole inputs, the call's choices, the ranks and the clock a scheme's
                   simulation is given
    Clock          times each item of work once per key (`Item`: a pass and its structure)
    SequenceRanks  the ranks of a sequence-sharded scheme: each rank's shards, its CPCall (plans
                   cut from one whole-sequence block mask, GridPlans) and the merged forward a
                   backward starts from
    Simulation     what the ranks did: per-rank work for the transfer model, and the counts a real
                   run's CPStats would report

Identical work is timed once: an item is keyed by its shapes and the structure of its block masks
(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, block size) and every item with
that key shares one timing, so causal at P = 512 times a handful of distinct steps, not 512². A
variant whose score_mod depends on positions in a way the block mask does not show (ALiBi) costs
the same per block, so this is a timing key, not a numerical one. Building the plans costs what
one real rank pays (the ring's and all-gather's plans ask every (q rank, kv rank) pair for its
block mask: O(P²) masks, memoised per variant); `Simulation.wall_s` reports the whole
simulation's time and `timed` / `items` how much timing the keys saved.

Timing is the project's stream timing (bench.stream_time through a `Timer`: an item's device time
per call queued back to back, CUDA events, warm-up, the L2 cache flushed; and the host's time to
issue it; host clock on CPU). A Timer is a parameter so that tests, and topology=auto's first
pass over its candidates (ModelTimer: a few items of each kind timed, the rest priced from their
blocks), can price items without timing each.
Shape legend: B batch, H query heads, G kv heads, S sequence, D head dim, P ranks.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import itertools
import math
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch

from attngym import kernels
from attngym.distributed.call.cp import CPCall, CPOptions, CPStats, attend_chunk, resolve_backward
from attngym.distributed.call.pairs import Saved
from attngym.distributed.model.transfer_model import RankWork
from attngym.distributed.placement import layout as layouts
from attngym.distributed.placement.grid import plans_for
from attngym.variants.base import Variant


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


@dataclasses.dataclass(frozen=True)
class ItemTime:
    """What timing one pass of an item gives.

    ms: the device's time per call, queued back to back (the compute the transfer model
    overlaps); host_ms: the host's time to issue one call (a rank's host issues all its calls:
    the rank takes at least their sum, transfer_model.predict); peak: device bytes the call adds
    (0 where not measured).
    """

    ms: float
    host_ms: float = 0.0
    peak: int = 0


# (item, "fwd" | "bwd") -> its ItemTime.
Timer = Callable[[Item, str], ItemTime]


def bench_timer(device: torch.device, warmup: int, repeats: int, cuda_graph: bool = False) -> Timer:
    """The project's stream timing (bench.stream_time: the device's and the host's time per
    call) of an item's pass, with the device peak it adds. cuda_graph: each pass captured as a
    CUDA graph and its replay timed (bench.graphed), as a rank whose call is captured
    (topology.cuda_graph) issues it: the host's time is then one launch per item."""
    from attngym import bench
    from attngym.device import peak_memory, sync

    def timer(item: Item, which: str) -> ItemTime:
        fn = item.fwd if which == "fwd" else item.bwd
        # First calls apart (compilation, and the sums an item builds at its first call: a
        # ring step's, from the pieces the steps before it leave), as phases.first_call: two,
        # so that a warmup of 0 times none of it.
        fn()
        fn()
        sync(device)
        with peak_memory(device) as peak:
            if cuda_graph:
                fn = bench.graphed(fn, device)
            timing = bench.stream_time(fn, warmup=warmup, repeats=repeats, device=device)
            del fn  # a captured graph's memory goes with it
        used = peak["bytes"] if device.type == "cuda" else 0
        return ItemTime(timing.gpu_ms, timing.host_ms, used)

    return timer


# A CUDA graph's replay issues a whole item in one launch: the host's time per item then, about
# what torch.cuda.CUDAGraph.replay takes (tens of microseconds' launch and bookkeeping).
GRAPH_REPLAY_MS = 0.02
# The whole problem's forward on the dense reference (a CPU) is computed a band of query rows at a
# time, each band's (rows x S) float64 terms per head about this size: all S rows at once held
# tens of GB at 16K (8 heads), killed by the out-of-memory killer past what the estimate judged.
REFERENCE_BAND_BYTES = 2**28


class ModelTimer:
    """A Timer that prices an item from its block masks after timing a few for real: auto's
    first pass over every candidate, compiling and timing a handful of items, not all of them.

    An item's size is its blocks, full and partial weighed as the balanced layout weighs them
    (layout.BLOCK_COSTS); items of one kind (the scheme's item or its part, the pass, the
    kernels' batch, heads and head dim) cost `a + b * blocks`, fitted to up to `samples` of them
    timed with `timer`: the first of its kind, then any whose size lies outside what was timed
    by more than half (a least-squares line, `a` and `b` held non-negative). The host's time per
    item is the mean of its kind's samples, or one graph replay's (GRAPH_REPLAY_MS) with
    `cuda_graph`, where a graph would issue it. Items whose masks are unknown (a reference
    backend) are timed for real. `measured` holds the real timings, keyed as Clock keys them,
    for later simulations to reuse.
    """

    def __init__(self, timer: Timer, *, samples: int = 3, cuda_graph: bool = False):
        self.timer, self.samples, self.cuda_graph = timer, samples, cuda_graph
        self.measured: dict[tuple, ItemTime] = {}
        self.kinds: dict[tuple, list[tuple[float, ItemTime]]] = {}

    def __call__(self, item: Item, which: str) -> ItemTime:
        blocks = block_units(item)
        if blocks is None or (which, item.key) in self.measured:
            return self._on_host(self._real(item, which))
        timed = self.kinds.setdefault(_kind(item, which), [])
        sizes = [size for size, _ in timed]
        if not timed or (
            len(timed) < self.samples and not min(sizes) / 1.5 <= blocks <= max(sizes) * 1.5
        ):
            timed.append((blocks, self._real(item, which)))
            return self._on_host(timed[-1][1])
        a, b = _fit([(size, t.ms) for size, t in timed])
        host = sum(t.host_ms for _, t in timed) / len(timed)
        return self._on_host(ItemTime(a + b * blocks, host))

    def with_graphs(self) -> ModelTimer:
        """This model for calls captured as CUDA graphs: the same fit and real timings, each
        item issued by one replay."""
        graphed = copy.copy(self)
        graphed.cuda_graph = True
        return graphed

    def _real(self, item: Item, which: str) -> ItemTime:
        if (which, item.key) not in self.measured:
            self.measured[which, item.key] = self.timer(item, which)
        return self.measured[which, item.key]

    def _on_host(self, time: ItemTime) -> ItemTime:
        """`time` as a rank issues it: with cuda_graph, one replay of a graph a launch."""
        if not self.cuda_graph:
            return time
        return dataclasses.replace(time, host_ms=GRAPH_REPLAY_MS)


def block_units(item: Item) -> float | None:
    """An item's blocks, a partial one weighed as layout.BLOCK_COSTS weighs it against a full
    one; None where an item has no block masks to count (a reference backend's)."""
    if not item.block_masks or any(bm is None for bm in item.block_masks):
        return None
    return sum(float(layouts.block_row_prices(bm).sum()) for bm in item.block_masks)


def _kind(item: Item, which: str) -> tuple:
    """Items priced by one line: the scheme's item (its key's leading names: the all-gather's
    one call, or its overlap's own and received parts, each a line of its own), the pass, and
    the batch, heads and head dim of its queries (the first 4-d shape of its key)."""
    names = tuple(itertools.takewhile(lambda part: isinstance(part, str), item.key))
    shape = next((t for t in item.key if isinstance(t, tuple) and len(t) == 4), ())
    return (*names, which, *shape[:2], *shape[3:])


def _fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(a, b) of ms = a + b * size through `points` by least squares, neither negative: one
    point, or a line that would fall below zero, goes through the origin; a falling one is flat."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var = sum((x - mean_x) ** 2 for x, _ in points)
    b = sum((x - mean_x) * (y - mean_y) for x, y in points) / var if var > 0 else None
    if b is not None and b < 0:
        return mean_y, 0.0
    if b is None or mean_y - b * mean_x < 0:
        squares = sum(x * x for x, _ in points)
        return (0.0, sum(x * y for x, y in points) / squares) if squares > 0 else (mean_y, 0.0)
    return mean_y - b * mean_x, b


@dataclasses.dataclass
class Simulation:
    """What the simulated ranks did: per-rank work for the transfer model, and the counts the
    real run's CPStats would report.

    extra: what a scheme's own pricing needs beyond the ranks (hybrid: the in-group exchange and
    its across scheme; all-gather: the ranks of PyTorch's whole-shard scheme), its business;
    "planning_ms", the placement's planning (cp_simulate.simulated times it);
    and "alternatives", where a scheme sets it: option sets of its own that would run this
    call another way, for topology=auto to simulate too (all-gather: the overlap its default
    did not take).
    """

    world_size: int
    ranks: list[RankWork]
    sequence_shards: int  # shards of the sequence the ranks attend apart (as TopologySpec.shards)
    stride: int = 1  # global ranks between two of `ranks` (hybrid's across groups: a2a_size)
    pairs_computed: int = 0  # summed over the ranks, as the CP task's instrument phase
    pairs_skipped: int = 0
    bytes_moved: int = 0  # one forward, the most any rank sends (CPStats.bytes_sent)
    peak_mem_bytes: int = 0  # the largest rank: the timed compute's peak plus its buffers
    items: int = 0  # items of work over all ranks and passes
    timed: int = 0  # distinct items timed
    wall_s: float = 0.0
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


class Clock:
    """Times items once per key, counts how many there were, and keys block masks by structure
    (kept for this simulation only: its BlockMasks go with it)."""

    def __init__(
        self,
        timer: Timer,
        on_timed: Callable[[], Any] | None = None,
        seen: dict[tuple, ItemTime] | None = None,
    ):
        # seen: (pass, key) -> ItemTime, shared by simulations whose timings are alike (auto's
        # candidates on one device: the same item is timed once for all of them).
        self.timer, self.seen, self.items = timer, {} if seen is None else seen, 0
        self.on_timed = on_timed  # called after each distinct item is timed (progress)
        self.peak = 0
        self.timed = 0  # items this clock timed (not found in `seen`)
        self._mask_keys: dict[int, tuple[Any, tuple]] = {}

    def time(
        self, item: Item | Callable[[], Item], which: str, key: tuple | None = None
    ) -> ItemTime:
        """The item's ItemTime for `which`; `item` may be a builder, called only for a new key."""
        self.items += 1
        seen = (which, item.key if key is None else key)
        if seen not in self.seen:
            built = item() if key is not None else item
            self.seen[seen] = self.timer(built, which)
            self.timed += 1
            if self.on_timed is not None:
                self.on_timed()
        timed = self.seen[seen]
        self.peak = max(self.peak, timed.peak)
        return timed

    def ms(self, item: Item | Callable[[], Item], which: str, key: tuple | None = None) -> float:
        """The item's device time for `which` (Clock.time's ms)."""
        return self.time(item, which, key).ms

    def mask_key(self, block_mask) -> tuple | None:
        """The structure of a BlockMask as a hashable key (None for none)."""
        if block_mask is None:
            return None
        kept = self._mask_keys.get(id(block_mask))
        if kept is not None and kept[0] is block_mask:
            return kept[1]
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
        self._mask_keys[id(block_mask)] = (block_mask, key)
        return key


@dataclasses.dataclass
class SimulatedCall:
    """What a scheme's simulation is given.

    q: (B, H, S, D) the whole queries; k, v: (B, G, S, D); grad_out: (B, H, S, D), or None for a
    forward-only simulation; variant on q's device; layout: the name or Layout a real call takes;
    options: the kernel choices; scheme_options: the scheme's own (TopologySpec.options);
    clock: times its items; domain_size: GPUs per NVLink domain of the fabric priced on (None:
    one domain), for a scheme whose groups follow the domains (hybrid).
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    grad_out: torch.Tensor | None
    variant: Variant
    world_size: int
    layout: Any
    options: CPOptions
    scheme_options: Mapping[str, Any]
    clock: Clock
    domain_size: int | None = None

    def replace(self, **changes: Any) -> SimulatedCall:
        return dataclasses.replace(self, **changes)


def simulate(
    spec,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor | None,
    variant: Variant,
    *,
    world_size: int,
    layout: str | layouts.Layout = "contiguous",
    options: CPOptions | None = None,
    scheme_options: Mapping[str, Any] | None = None,
    timer: Timer,
    domain_size: int | None = None,
    on_timed: Callable[[], Any] | None = None,
    seen: dict[tuple, ItemTime] | None = None,
) -> Simulation:
    """Every rank's compute of `spec`'s scheme over `world_size` ranks, timed one after another.

    Args:
        spec: the scheme's TopologySpec (its `simulate`).
        q: (B, H, S, D) the whole queries; k, v: (B, G, S, D); grad_out: (B, H, S, D), or None
            for a forward-only simulation.
        variant: the attention variant.
        world_size: P, the ranks simulated (any P the layout and heads allow).
        layout: the layout name (or a Layout) the real call would take.
        options: the CP options (backend, block size, kernel options, compile, backward).
        scheme_options: the scheme's own options (its defaults for those left out).
        timer: how an item is timed (bench_timer for the project's timing).
        domain_size: GPUs per NVLink domain (SimulatedCall.domain_size).
        on_timed: called after each distinct item is timed (the run's progress).
        seen: timings already taken of items alike (Clock's), shared by simulations.

    Returns:
        A Simulation with each rank's RankWork (compute per step, bytes per step).
    """
    if spec.simulate is None:
        raise ValueError(f"scheme: {spec.name} declares no simulation (TopologySpec.simulate)")
    start = time.perf_counter()
    clock = Clock(timer, on_timed, seen)
    variant = variant.to(q.device) if variant.device not in (None, q.device) else variant
    call = SimulatedCall(
        q, k, v, grad_out, variant, world_size, layout, options or CPOptions(),
        spec.option_values(scheme_options), clock, domain_size,
    )  # fmt: skip
    sim = spec.simulate(call)
    sim.items, sim.timed = clock.items, clock.timed
    sim.peak_mem_bytes += clock.peak
    sim.wall_s = time.perf_counter() - start
    return sim


def nbytes(*shape: int, itemsize: int) -> int:
    """Bytes of a tensor of `shape`."""
    return math.prod(shape) * itemsize


class SequenceRanks:
    """The P ranks of a sequence-sharded scheme (ring, all-gather, a user's) in a simulation.

    Attributes:
        layout: the Layout the real call resolves; positions[r] rank r's global rows.
        qs, ks, vs: each rank's shards, cut from the whole inputs in the layout.
        saved: each rank's Saved (its q shard and the whole problem's merged out and lse at its
            rows: what the real call merges to), for a backward; None for a forward only.
        stats: the pairs counted as a real forward counts them (`call(r, counted=True)`).
    """

    def __init__(self, sc: SimulatedCall):
        q, opts = sc.q, sc.options
        self.sc, self.world_size, self.seq_len = sc, sc.world_size, q.shape[2]
        self.backend = kernels.resolve_backend(opts.backend, q.device)
        self.backward = resolve_backward(opts)
        self.layout = layouts.resolve(sc.layout, sc.world_size, self.seq_len, sc.variant, q.device)
        self.grid = plans_for(sc.variant, self.seq_len, opts.block_size, q.device)
        self.positions = [self.layout.positions(r, q.device) for r in range(sc.world_size)]
        self.qs, self.ks, self.vs = (
            [t.index_select(2, p) for p in self.positions] for t in (q, sc.k, sc.v)
        )
        self.stats = CPStats()
        self.saved = None
        if sc.grad_out is not None:
            out, lse = self._merged(q, sc.k, sc.v)
            acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
            self.saved = [
                Saved(self.qs[r], out.index_select(2, p), lse.index_select(2, p).to(acc_dtype),
                      sc.grad_out.index_select(2, p))
                for r, p in enumerate(self.positions)
            ]  # fmt: skip

    def _merged(self, q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole problem's forward (out, lse), once per inputs for every simulation of this
        variant and grid (topology=auto's candidates share it): kept on the grid while the
        inputs live."""
        opts = self.sc.options
        key = (id(q), id(k), id(v), self.backend, opts.block_size, repr(opts.kernel_options))
        kept = self.grid.merged.get(key)
        if kept is None or any(ref() is not t for ref, t in zip(kept[0], (q, k, v), strict=True)):
            if self.backend == "flex":
                out, lse = attend_chunk(q, k, v, self.sc.variant, options=opts,
                                        block_mask=self.grid.whole)  # fmt: skip
            else:  # the dense reference holds (rows x S) terms per head: a band of rows at once
                rows = max(1, REFERENCE_BAND_BYTES // (q.shape[0] * q.shape[1] * k.shape[2] * 8))
                bands = [
                    attend_chunk(
                        q[:, :, i : i + rows], k, v, self.sc.variant, q_offset=i, options=opts
                    )
                    for i in range(0, self.seq_len, rows)
                ]
                out, lse = (torch.cat(parts, dim=2) for parts in zip(*bands, strict=True))
            kept = ((weakref.ref(q), weakref.ref(k), weakref.ref(v)), out, lse)
            self.grid.merged[key] = kept
        return kept[1], kept[2]

    def call(self, rank: int, counted: bool = False) -> CPCall:
        """Rank `rank`'s CPCall with no process group and no transport (nothing moves); counted:
        its pairs go into `stats`, as the real forward counts them (once)."""
        return CPCall(
            variant=self.sc.variant,
            group=None,
            transport=None,
            layout=self.layout,
            options=self.sc.options,
            backend=self.backend,
            backward=self.backward,
            rank=rank,
            world_size=self.world_size,
            seq_len=self.seq_len,
            stats=self.stats if counted else None,
            plans=self.grid,
        )

    def simulation(self, ranks: list[RankWork]) -> Simulation:
        """The Simulation of these ranks' work, with the pairs counted."""
        sim = Simulation(self.world_size, ranks, self.world_size)
        sim.pairs_computed, sim.pairs_skipped = self.stats.pairs_computed, self.stats.pairs_skipped
        return sim
