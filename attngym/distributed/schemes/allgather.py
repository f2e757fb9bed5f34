"""All-gather attention: each rank gathers the K/V rows it reads, then attends in one call.

Contract (P ranks, this rank r, on `transport`):
    * Only what the mask reads moves (ReadPlan, from the pairs' block masks, the same on every
      rank): rank r receives from each rank p exactly the whole kv blocks of p's shard that r's
      queries read (a halo for a window, the documents a rank's queries touch, nothing where no
      rank reads another's shard).
    * How it moves: when some rank reads every other shard whole (causal, say), one all-gather of
      the whole shards (`start([k, v])`, then the transport's differentiable `wait`; the slowest
      rank receives as much either way, and the collective is the fastest way to move it). Else
      the transport's uneven exchange (`exchange`): each rank packs the rows each peer reads into
      one buffer (destinations in rank order) and receives only its own.
    * The keys of the (one) call: the gathered buffer in rank order (whole shards), else this rank's
      own chunks, the rows it received and zeros at rows it does not read that bring those to a
      power-of-two number of blocks (ReadPlan.pads: a few kernel shapes, however the ranks and
      masks differ), in the order of their global positions (a window's halo and shard form one
      run). One kernel call attends the rank's q shard (S/P rows) to those keys: the variant's
      callbacks read each local row and key index through a map to global positions (an offset
      when the keys are one run, else a position table), and the block mask is cut in that local
      index space, so every masked block is skipped as in the one-device kernel.
    * Backward: flex's backward op over the received K/V from the call's own out and lse
      (`CPOptions.backward` flex, as the ring's pairs; the kernel compiled flex's autograd runs,
      issued without its wrappers), or the kernel's own autograd (recompute; the reference's on
      a CPU without the op); nothing is recomputed either way. The gather's backward
      reduce-scatters dK/dV to their home ranks, the exchange's sends each received row's
      gradient back and its owner adds them up.
    * Overlap (AllGatherOptions.overlap; by default where the exchange brings some rank at least
      a shard's rows): the exchange is started, the rank attends its own keys while the rows
      arrive, then the rows it received, and the two partials are merged by their lse; the
      backward differentiates the received rows' call first (flex's backward op from the merged
      out and lse, as the ring's pairs), sends those gradients home while it differentiates the
      own keys' call, and adds what comes back. It costs a second kernel and a merge, to hide an
      exchange as long as the own keys' call (documents: a rank reads up to 6x its shard); a
      window's halo is too short a transfer to be worth them. Whole-shard gathers are not split
      (the slowest rank's call would be all remote).
    * The positioned calls (variant, block mask, maps) are kept per Variant object (weak keys)
      and layout.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Any

import torch

from attngym import kernels
from attngym.distributed.call import fold
from attngym.distributed.call.accumulate import Accumulator, GradSum
from attngym.distributed.call.cp import CPCall, CPOptions, CPStats, StepClock, run
from attngym.distributed.call.pairs import (
    PositionedCall,
    Saved,
    attend_at,
    grads_at,
    pairs,
    positioned,
    pow2_blocks,
    runs_read,
)
from attngym.distributed.model.simulate import (
    Item,
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
    "ALLGATHER", "AllGatherOptions", "CPOptions", "CPStats", "allgather_attention",
    "allgather_transfer_ms",
]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class AllGatherOptions:
    """allgather's own options: topology.options.<field>, allgather_attention's keywords."""

    overlap: bool | None = None
    """Attend the own keys while the rows read from other shards arrive, then those (two calls,
    merged by their lse), their gradients sent home during the own keys' backward; None: where
    the exchange brings some rank at least a shard's rows. Whole-shard gathers are not split."""

    fold: bool | None = None
    """Fold the batch and heads into the call's rows and run its costliest block rows first
    (attngym.distributed.call.fold: flex runs the heads one after the other, so each head's
    longest rows would start late and end alone); None: on CUDA flex, where the call's longest
    block row costs fold.SPREAD times its mean or more (packed documents; not windows nor a
    causal mask), the unfolded call offered to topology=auto (a batch of many short documents
    measured slower folded)."""


Run = tuple[int, int]  # [start, stop) local rows of a shard


@dataclasses.dataclass(frozen=True)
class ReadPlan:
    """The rows of other ranks' shards each rank's queries read (whole kv blocks of the pairs'
    block masks; the same plan on every rank).

    Attributes:
        runs: runs[dst][src], the runs of src's local rows that dst's queries read, in order;
            () for dst == src (a rank's own keys never travel).
        shard_rows: rows per shard (S/P).
        block: the kernel's kv block; where given, each rank's call also holds `pads`.
    """

    runs: tuple[tuple[tuple[Run, ...], ...], ...]
    shard_rows: int
    block: int = 0

    def pads(self, dst: int) -> tuple[tuple[Run, ...], ...]:
        """pads[src]: rows of src's shard that dst's queries do not read, held as zeros beside
        the rows dst receives so that their count is a power-of-two number of blocks
        (pairs.pow2_blocks). Each rank's keys would otherwise have a length of their own, and
        the kernel compile anew for each rank and each mask; these rows move nowhere, and are
        exact: the mask keeps none of them for any of dst's queries, so their blocks are
        skipped. Taken from just before a run read first, so that a halo and the shard it
        leads into stay one run of positions."""
        return self._pads[dst]

    @functools.cached_property
    def _pads(self) -> tuple[tuple[tuple[Run, ...], ...], ...]:
        P, n = len(self.runs), self.shard_rows
        out = []
        for dst in range(P):
            left = 0
            if self.block and self.moves and not self.gathers and self.received(dst):
                held = self.received(dst)
                left = pow2_blocks(held, (P - 1) * n, self.block) - held
            pads: list[list[Run]] = [[] for _ in range(P)]
            for src in sorted(range(P), key=lambda src: not self.runs[dst][src]):
                for a, b, before in _gaps(self.runs[dst][src], n) if src != dst else ():
                    take = min(left, b - a)
                    if take:  # the rows next to the run the gap comes before, or after
                        pads[src].append((b - take, b) if before else (a, a + take))
                        left -= take
            out.append(tuple(tuple(sorted(x)) for x in pads))
        return tuple(out)

    def rows(self, dst: int, src: int) -> int:
        """Rows dst receives from src."""
        return sum(b - a for a, b in self.runs[dst][src])

    def received(self, dst: int) -> int:
        """Rows dst receives in all."""
        return self._received[dst]

    @functools.cached_property
    def _received(self) -> tuple[int, ...]:
        P = len(self.runs)
        return tuple(sum(self.rows(dst, src) for src in range(P)) for dst in range(P))

    @functools.cached_property
    def gathers(self) -> bool:
        """Some rank reads every other shard whole: one all-gather of the whole shards moves them
        (the slowest rank receives as much in an exchange)."""
        P = len(self.runs)
        return P > 1 and max(self._received) == (P - 1) * self.shard_rows

    @functools.cached_property
    def moves(self) -> bool:
        """Some rank reads another's shard."""
        return any(self._received)

    def overlaps(self, overlap: bool | None) -> bool:
        """Whether the calls are split around the exchange (AllGatherOptions.overlap; None: where
        some rank receives at least a shard's rows). Never for whole-shard gathers."""
        if self.gathers or not self.moves:
            return False
        return max(self._received) >= self.shard_rows if overlap is None else overlap


# Variant -> {(layout, B, H, block size, backend, device): ReadPlan}.
_READ_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def read_plan(call: CPCall, q: torch.Tensor) -> ReadPlan:
    """The ReadPlan of this call (memoised per variant)."""
    key = (call.layout, *q.shape[:2], call.options.block_size, call.backend, q.device)
    per = _READ_PLANS.setdefault(call.variant, {})
    if key not in per:
        P = call.world_size
        runs = tuple(
            tuple(() if src == dst else runs_read(call, q, dst, src) for src in range(P))
            for dst in range(P)
        )
        per[key] = ReadPlan(runs, call.seq_len // P, call.options.block_size[1])
    return per[key]


def _gaps(runs: tuple[Run, ...], n: int) -> list[tuple[int, int, bool]]:
    """(start, stop, before): the rows of [0, n) outside `runs` (in order, merged), each gap
    before a run (before=True), then the one after the last run (all of [0, n) where none)."""
    gaps, prev = [], 0
    for a, b in runs:
        if a > prev:
            gaps.append((prev, a, True))
        prev = b
    return gaps + ([(prev, n, not runs)] if prev < n else [])


@functools.lru_cache(maxsize=256)
def key_pieces(
    layout: Layout, rank: int, plan: ReadPlan
) -> tuple[tuple[int, int, int, int | None], ...]:
    """(src, start, stop, offset): the pieces of rank `rank`'s keys when it exchanges, its own
    chunks (src == rank), the runs it receives (at `offset` rows of what it received) and its
    pads (ReadPlan.pads: offset None, zeros), in the order of their first global position.
    Memoised: every forward asks."""
    pieces: list[tuple[int, int, int, int | None]] = []
    start = 0
    for _, n in layout.chunks(rank):
        pieces.append((rank, start, start + n, 0))
        start += n
    offset = 0
    for src, runs in enumerate(plan.runs[rank]):
        for a, b in runs:
            pieces.append((src, a, b, offset))
            offset += b - a
    pieces += [(src, a, b, None) for src, pads in enumerate(plan.pads(rank)) for a, b in pads]
    first = [layout.positions(p, "cpu") for p in range(layout.world_size)]
    return tuple(sorted(pieces, key=lambda piece: int(first[piece[0]][piece[1]])))


@functools.lru_cache(maxsize=256)
def received_pieces(
    layout: Layout, rank: int, plan: ReadPlan
) -> tuple[tuple[int, int, int, int | None], ...]:
    """key_pieces without the rank's own chunks: the keys of the overlap's received call (its
    rows received and their pads, a power-of-two number of blocks however the batch's documents
    fall, so that a workload's calls compile a few kernel shapes, not one per rank and batch)."""
    return tuple(piece for piece in key_pieces(layout, rank, plan) if piece[0] != rank)


@functools.lru_cache(maxsize=64)
def _call_rows(layout: Layout, rank: int, plan: ReadPlan, device) -> torch.Tensor:
    """For each row of what rank `rank` received (sources in rank order), its row among the
    received call's keys (received_pieces): where its gradient is read to be sent home."""
    rows, start = [], 0
    for _, a, b, offset in received_pieces(layout, rank, plan):
        if offset is not None:
            rows.append((offset, torch.arange(start, start + b - a)))
        start += b - a
    ordered = [r for _, r in sorted(rows, key=lambda x: x[0])]
    return torch.cat(ordered).to(device) if ordered else torch.zeros(0, dtype=torch.long).to(device)


def key_positions(layout: Layout, rank: int, plan: ReadPlan, device) -> torch.Tensor:
    """The global position of each key of rank `rank`'s call, in the order the call holds them."""
    every = [layout.positions(p, device) for p in range(layout.world_size)]
    if plan.gathers:  # whole shards: the gathered buffer itself
        return torch.cat(every)
    if not plan.moves:
        return every[rank]
    return torch.cat([every[src][a:b] for src, a, b, _ in key_pieces(layout, rank, plan)])


def _gather(call: CPCall, k: torch.Tensor):
    from attngym.distributed.transport import cached

    return cached(
        call.transport.allgather, tuple(k.shape), 2, 2, dtype=k.dtype, device=k.device,
        timeout_s=call.options.timeout_s, group=call.group,
    )  # fmt: skip


def _exchange(call: CPCall, plan: ReadPlan, k: torch.Tensor):
    """The transport's exchange of this plan's rows (K and V of one row: 2·B·G·D elements)."""
    from attngym.distributed.transport import cached

    row = 2 * k.shape[0] * k.shape[1] * k.shape[3]
    return cached(
        call.transport.exchange, _sizes(plan, row), dtype=k.dtype, device=k.device,
        timeout_s=call.options.timeout_s, group=call.group,
    )  # fmt: skip


@functools.lru_cache(maxsize=64)
def _sizes(plan: ReadPlan, row: int) -> tuple[tuple[int, ...], ...]:
    """sizes[src][dst]: the elements src sends dst, `row` per K/V row."""
    P = len(plan.runs)
    return tuple(tuple(plan.rows(dst, src) * row for dst in range(P)) for src in range(P))


@functools.lru_cache(maxsize=64)
def _sent_rows(plan: ReadPlan, rank: int, device: torch.device) -> torch.Tensor:
    """The local rows rank `rank` sends, destinations in rank order (its send buffer's rows)."""
    rows = [torch.arange(a, b) for dst in range(len(plan.runs)) for a, b in plan.runs[dst][rank]]
    return torch.cat(rows).to(device) if rows else torch.zeros(0, dtype=torch.long, device=device)


class _ExchangeRows(torch.autograd.Function):
    """The exchange of K/V rows as an autograd node: forward packs the rows each peer reads and
    exchanges them, returning (2, B, G, received rows, D); backward sends each received row's
    gradient home, where the owner adds them into dK/dV."""

    @staticmethod
    def forward(ctx, ex, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx.ex, ctx.rows, ctx.shape = ex, rows, k.shape
        b, g, _, d = k.shape
        packed = torch.stack([k.index_select(2, rows), v.index_select(2, rows)])
        out = ex.exchange(packed.permute(3, 0, 1, 2, 4).reshape(-1))  # rows outermost
        return out.view(-1, 2, b, g, d).permute(1, 2, 3, 0, 4)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        b, g, n, d = ctx.shape
        back = ctx.ex.inverse().exchange(grad.permute(3, 0, 1, 2, 4).reshape(-1))
        back = back.view(-1, 2, b, g, d).permute(1, 2, 3, 0, 4)
        dk, dv = (grad.new_zeros(ctx.shape).index_add_(2, ctx.rows, back[j]) for j in (0, 1))
        return None, None, dk, dv


def _call_keys(pieces, take, tail=()) -> tuple[torch.Tensor, torch.Tensor]:
    """The call's K and V: `take(src, start, stop, offset)` -> (k piece, v piece), concatenated
    (then the `tail` pairs)."""
    kv = [take(*piece) for piece in pieces] + list(tail)
    return tuple(torch.cat([x[j] for x in kv], dim=2) for j in (0, 1))


# Variant -> {(layout, rank, device, block size, backend, plan, tables, backward, part):
# PositionedCall; the same + ("rows",): the received call's query rows}.
_MAPPED: weakref.WeakKeyDictionary[Variant, dict[tuple, PositionedCall | slice]] = (
    weakref.WeakKeyDictionary()
)


def _mapped(
    call: CPCall, q: torch.Tensor, plan: ReadPlan, part: str = "all", folding=None
) -> PositionedCall:
    """This rank's call at the global positions of its queries and its keys: `part` "all" (the
    one call's keys, key_positions), "own" (its own shard's) or "received" (the exchange's rows
    and their pads, received_pieces; its queries only `_reading_rows`), folded where `folding`
    (_folding) says. Memoised per variant."""
    key = _mapped_key(call, q, plan, part, folding)
    per = _MAPPED.setdefault(call.variant, {})
    if key not in per:
        layout, r = call.layout, call.rank
        q_pos = layout.positions(r, q.device)
        if part == "all":
            kv_pos = key_positions(layout, r, plan, q.device)
        elif part == "own":
            kv_pos = layout.positions(r, q.device)
        else:
            every = [layout.positions(p, q.device) for p in range(layout.world_size)]
            pieces = received_pieces(layout, r, plan)
            kv_pos = torch.cat([every[src][a:b] for src, a, b, _ in pieces])
        name = f"{call.variant.name}@{layout.name}.rank{r}.{part}"
        pc = positioned(call, q_pos, kv_pos, name)
        if part == "received":
            rows = _reading_rows(pc.block_mask, q_pos.numel())
            if rows != slice(0, q_pos.numel()):
                q_pos = q_pos[rows]
                pc = positioned(call, q_pos, kv_pos, f"{name}[{rows.start}:{rows.stop}]")
            per[key + ("rows",)] = rows
        if folding is not None and pc.block_mask is not None:
            *heads, forced = folding
            if forced or fold.worth_it(pc.block_mask):
                folded = fold.fold(call.variant, q_pos, kv_pos, pc.block_mask, heads,
                                   exact=call.backend != "flex")  # fmt: skip
                pc = pc if folded is None else dataclasses.replace(pc, fold=folded)
        per[key] = pc
    return per[key]


def _mapped_key(call: CPCall, q: torch.Tensor, plan: ReadPlan, part: str, folding=None) -> tuple:
    tables = kernels.offsets_as_tables(call.options.kernel_options)
    return (call.layout, call.rank, q.device, call.options.block_size, call.backend, plan,
            tables, call.backward, part, folding)  # fmt: skip


def _folding(call: CPCall, q: torch.Tensor, k: torch.Tensor, option: bool | None):
    """(B, H, G, forced) where this rank's calls may fold their heads into their rows
    (AllGatherOptions.fold: True forced, None on CUDA flex where fold.worth_it), else None."""
    if option is False or (option is None and (call.backend != "flex" or q.device.type != "cuda")):
        return None
    return (*q.shape[:2], k.shape[1], option is True)


def _received_rows(call: CPCall, q: torch.Tensor, plan: ReadPlan, folding=None) -> slice:
    """The query rows of this rank's "received" call (_mapped)."""
    _mapped(call, q, plan, "received", folding)
    return _MAPPED[call.variant][_mapped_key(call, q, plan, "received", folding) + ("rows",)]


def _reading_rows(block_mask, n: int) -> slice:
    """The span of query rows whose blocks read any key of `block_mask` (all n where it is None),
    widened to a power-of-two number of blocks (pow2_blocks: a few kernel shapes, however the
    batch's documents fall; the rows added read nothing). The received rows of a window's halo
    are read by the shard's first rows only: the rest of a call over every row would run empty
    blocks, and its backward write dq rows of zeros."""
    if block_mask is None:
        return slice(0, n)
    reads = block_mask.kv_num_blocks.sum(dim=(0, 1))
    if block_mask.full_kv_num_blocks is not None:
        reads = reads + block_mask.full_kv_num_blocks.sum(dim=(0, 1))
    blocks = torch.nonzero(reads).flatten().tolist()
    if not blocks:
        return slice(0, n)
    size = block_mask.BLOCK_SIZE[0]
    start = blocks[0] * size
    rows = pow2_blocks(min(n, (blocks[-1] + 1) * size) - start, n, size)
    start = min(start, n - rows)
    return slice(start, start + rows)


class _MappedCall(torch.autograd.Function):
    """The rank's one call, differentiated by flex's backward op (CPOptions.backward flex): from
    the call's own out and lse, the kernel flex's own autograd runs, without its wrappers (on a
    GPU, compiled flex's autograd costs the host about as much as a 16K-row call costs the
    device). Where the op fails under backward=auto, the call runs again under autograd."""

    @staticmethod
    def forward(ctx, q, k, v, call: CPCall, pc: PositionedCall):
        q, k, v = (t.detach() for t in (q, k, v))
        out, lse = attend_at(call, q, k, v, pc)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.call, ctx.pc = call, pc
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # no zeros for the lse's missing gradient
        return out, lse

    @staticmethod
    def backward(ctx, dout, _):
        q, k, v, out, lse = ctx.saved_tensors
        return *grads_at(ctx.call, Saved(q, out, lse, dout), k, v, ctx.pc), None, None


def _merged_rows(call: CPCall, q, out, lse, rows: slice, part) -> tuple:
    """(out, lse) of the own keys' call with `part`, the received rows' (out, lse) over query
    rows `rows`, merged in by their lse (accumulate.Accumulator) and written back into those
    rows."""
    n = rows.stop - rows.start
    acc = Accumulator.of(call, q[:, :, rows], out.shape[-1])
    acc.add(slice(0, n), out[:, :, rows], lse[:, :, rows])
    acc.add(slice(0, n), *part)
    merged_out, merged_lse = acc.result()
    if n == q.shape[2]:  # every row: the merged tensors are the result
        return merged_out, merged_lse
    out[:, :, rows] = merged_out
    lse = lse.to(merged_lse.dtype)
    lse[:, :, rows] = merged_lse
    return out, lse


def _rows_of(saved: Saved, rows: slice) -> Saved:
    """`saved` at query rows `rows` (the received call's), its converted lse with them."""
    if rows == slice(0, saved.q.shape[2]):
        return saved
    lse2 = (
        None
        if saved.lse2 is None
        else {(0, rows.stop - rows.start): saved.lse2[(0, saved.q.shape[2])][:, :, rows]}
    )
    return Saved(*(t[:, :, rows] for t in (saved.q, saved.out, saved.lse, saved.dout)), lse2)


def mapped_call(call: CPCall, q, k, v, pc: PositionedCall):
    """(out, lse) of the rank's call at positions `pc`, differentiable w.r.t. q, k, v: through
    flex's backward op (_MappedCall) where the call's backward is flex, else through the kernel's
    own autograd (the reference's on a CPU)."""
    if call.backward == "flex":
        return _MappedCall.apply(q, k, v, call, pc)
    return attend_at(call, q, k, v, pc)


def _packed(k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """K and V at `rows` (local rows of the shard), flat, rows outermost: an exchange's send."""
    return (
        torch.stack([k.index_select(2, rows), v.index_select(2, rows)])
        .permute(3, 0, 1, 2, 4)
        .reshape(-1)
    )


def _unpacked(flat: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """An exchange's flat output as (2, B, G, rows, D) (K, V), of shards shaped like `like`."""
    b, g, _, d = like.shape
    return flat.view(-1, 2, b, g, d).permute(1, 2, 3, 0, 4)


class _Overlapped(torch.autograd.Function):
    """The exchange and the two calls of AllGatherOptions.overlap, as one node: forward starts
    the exchange, attends the own keys, waits, attends the received rows and merges; backward
    differentiates the received rows' call, sends its dK/dV home, differentiates the own keys'
    call meanwhile and adds what comes back (module docstring). Every rank runs both exchanges,
    also one that sends or receives nothing."""

    @staticmethod
    def forward(ctx, q, k, v, call: CPCall, plan: ReadPlan, ex, clock: StepClock, folding):
        q, k, v = (t.detach() for t in (q, k, v))
        rows = _sent_rows(plan, call.rank, k.device)
        started = ex.start(_packed(k, v, rows))
        received = plan.received(call.rank)
        own = _mapped(call, q, plan, "own", folding)
        got = _mapped(call, q, plan, "received", folding) if received else None
        reading = _received_rows(call, q, plan, folding) if received else slice(0, 0)
        clock.start()
        out, lse = attend_at(call, q, k, v, own)
        clock.stop("step_compute_ms")
        clock.start()
        kv = _unpacked(ex.wait(started), k)
        clock.stop("step_wait_ms")
        k_r, v_r = kv[0], kv[1]
        if received:  # the call's keys: the rows received and their pads, in position order
            k_r, v_r = _call_keys(
                received_pieces(call.layout, call.rank, plan),
                lambda src, a, b, o: tuple(
                    kv[j][:, :, o : o + b - a]
                    if o is not None
                    else kv[j].new_zeros(*k.shape[:2], b - a, k.shape[3])
                    for j in (0, 1)
                ),  # fmt: skip
            )
            clock.start()
            out, lse = _merged_rows(
                call,
                q,
                out,
                lse,
                reading,
                attend_at(call, q[:, :, reading], k_r, v_r, got),
            )
            clock.stop("step_compute_ms")
        ctx.save_for_backward(q, k, v, k_r, v_r, out, lse, rows)
        ctx.call, ctx.ex, ctx.parts, ctx.reading = call, ex, (own, got), reading
        ctx.received = _call_rows(call.layout, call.rank, plan, k.device) if received else None
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _):
        from attngym.distributed.call import flex_backward

        q, k, v, k_r, v_r, out, lse, rows = ctx.saved_tensors
        call, (own, got) = ctx.call, ctx.parts
        n = q.shape[2]
        lse2 = None
        if call.backward == "flex":
            lse2 = {(0, n): flex_backward.kernel_lse(lse, call.options.kernel_options, q.dtype)}
        saved = Saved(q, out, lse, dout, lse2)
        a = ctx.reading.start
        dq = GradSum.of(call, q.shape, lse.dtype, q.device)
        home = k_r.new_zeros((2, *k_r.shape))
        if got is not None:
            dq_r, dk_r, dv_r = grads_at(call, _rows_of(saved, ctx.reading), k_r, v_r, got)
            dq.add(a, dq_r)
            home = torch.stack([dk_r, dv_r]).index_select(3, ctx.received)  # pads' dropped
        back = ctx.ex.inverse()
        started = back.start(home.permute(3, 0, 1, 2, 4).reshape(-1))
        dq_o, dk, dv = grads_at(call, saved, k, v, own)
        dq.add(0, dq_o)
        arrived = _unpacked(back.wait(started), k)
        dk = dk.index_add(2, rows, arrived[0].to(dk.dtype))
        dv = dv.index_add(2, rows, arrived[1].to(dv.dtype))
        return dq.total(q.dtype), dk, dv, None, None, None, None, None


def _allgather(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    call: CPCall,
    overlap: bool | None = None,
    fold: bool | None = None,
) -> torch.Tensor:
    stats, clock = call.stats, StepClock(call.stats, q.device)
    P, r = call.world_size, call.rank
    plan = read_plan(call, q) if P > 1 else ReadPlan((((),),), k.shape[2])
    folding = _folding(call, q, k, fold)
    if plan.overlaps(overlap):
        ex = _exchange(call, plan, k)
        out, lse = _Overlapped.apply(q, k, v, call, plan, ex, clock, folding)
        if stats is not None:
            stats.bytes_sent += ex.sent(r) * k.element_size()
        _record(call, q, out, lse)
        return out
    sent = 0
    clock.start()
    if plan.gathers:
        ag = _gather(call, k)
        ag.start([k, v])
        kv = ag.wait([k, v])  # differentiable: its backward reduce-scatters dK/dV
        k_all, v_all = kv[0], kv[1]
        saved = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        if getattr(ag, "OUTPUT_REUSED", True) and saved:
            # The kernel saves its keys for the backward (dq needs them too), and the transport's
            # buffer belongs to the next call (a second layer's forward before this one's
            # backward).
            k_all, v_all = k_all.clone(), v_all.clone()
        sent = 2 * k.numel() * (P - 1)
    elif plan.moves:
        ex = _exchange(call, plan, k)
        got = _ExchangeRows.apply(ex, _sent_rows(plan, r, k.device), k, v)
        own = (k, v)
        k_all, v_all = _call_keys(
            key_pieces(call.layout, r, plan),
            lambda src, a, b, o: tuple(
                own[j][:, :, a:b]
                if src == r
                else own[j].new_zeros(*k.shape[:2], b - a, own[j].shape[3])
                if o is None
                else got[j][:, :, o : o + b - a]
                for j in (0, 1)
            ),  # fmt: skip
            # an empty piece of what arrived: a rank that receives nothing still joins the
            # exchange's backward, which every rank must call
            tail=[(got[0][:, :, :0], got[1][:, :, :0])],
        )
        sent = ex.sent(r)
    else:  # one rank, or no rank reads another's shard
        k_all, v_all = k, v
    if plan.moves:
        clock.stop("step_wait_ms")
    if stats is not None:
        stats.bytes_sent += sent * k.element_size()
    clock.start()
    out, lse = mapped_call(call, q, k_all, v_all, _mapped(call, q, plan, folding=folding))
    clock.stop("step_compute_ms")
    _record(call, q, out, lse)
    return out


def _record(call: CPCall, q: torch.Tensor, out, lse) -> None:
    """The call's lse, backward and pairs in its stats (when given)."""
    stats = call.stats
    if stats is not None:
        stats.lse = lse.detach()
        # flex's backward op, or the kernel's own autograd (the reference's on a CPU; the
        # overlapped calls re-run their forwards there)
        stats.backward = "flex" if call.backward == "flex" else "kernel"
        for p in range(call.world_size):  # the chunk pairs the one call covers, for comparison
            pairs(call, q, p, masks=False)


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
    overlap: bool | None = None,
    fold: bool | None = None,
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
        overlap: AllGatherOptions.overlap (None: where the exchange brings some rank at least a
            shard's rows).
        fold: AllGatherOptions.fold (None: on CUDA flex, where the call's block rows differ in
            cost).

    Returns:
        (B, H, S/P, D) this rank's output shard, in q's dtype; differentiable w.r.t. q, k, v.
    """
    return run(
        functools.partial(_allgather, overlap=overlap, fold=fold),
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
# Simulated and priced (topology.simulate=true; attngym.distributed.model.simulate, transfer_model).


def simulate_allgather(sc: SimulatedCall, whole: bool = False) -> Simulation:
    """Every rank's call (cp.attend) on the keys it would hold (the gathered shards, or its own
    and the rows the ReadPlan sends it), with the positioned variant and block mask the
    algorithm builds; backward: the call's, as the algorithm differentiates it. Overlapped
    (AllGatherOptions.overlap), its two calls apart. Also the ranks of PyTorch's scheme, one
    call with whole shards gathered (Simulation.extra["torch_cp"]). `whole`: every rank gathers
    every shard whole, whatever its queries read (simulate_torch_cp)."""
    ranks = SequenceRanks(sc)
    works, whole_shards, sent, buffers, pattern = [], [], 0, 0, "allgather"
    overlap = sc.scheme_options.get("overlap")
    # PyTorch's scheme (whole) runs its calls as they are
    option = False if whole else sc.scheme_options.get("fold")
    folded = False
    for r in range(sc.world_size):
        work, received, buffer, pattern, rank_folded = _simulated_rank(
            ranks, r, sc.clock, overlap, whole, option
        )
        folded |= rank_folded
        works.append(work)
        sent, buffers = max(sent, received), max(buffers, buffer)
        gathered = nbytes(2, *ranks.ks[r].shape, itemsize=ranks.ks[r].element_size())
        gathered *= sc.world_size - 1
        whole_shards.append(
            RankWork(fwd_ms=(work.compute_fwd_ms,), bwd_ms=(sum(work.bwd_ms),),
                     fwd_bytes=(gathered,), bwd_bytes=(gathered,), host_fwd_ms=work.host_fwd_ms,
                     host_bwd_ms=work.host_bwd_ms)
        )  # fmt: skip
    sim = ranks.simulation(works)
    sim.bytes_moved, sim.peak_mem_bytes = sent, buffers
    sim.extra["torch_cp"] = whole_shards
    sim.extra["pattern"] = pattern
    plan = read_plan(ranks.call(0), ranks.qs[0]) if sc.world_size > 1 and not whole else None
    if overlap is None and plan is not None and plan.moves and not plan.gathers:
        # The default split (or not) around the exchange is a rule of thumb: the other way may
        # be faster (a halo's small second call once the host is out of the way, CUDA graphs).
        sim.extra["alternatives"] = [{"overlap": not plan.overlaps(None)}]
    if option is None and folded:
        # So is folding by the spread of the rows: on a batch of many short documents the
        # folded calls measured slower (one H100, 2026-12-08, experiments/workloads).
        sim.extra.setdefault("alternatives", []).append({"fold": False})
    return sim


def simulate_torch_cp(sc: SimulatedCall) -> Simulation:
    """PyTorch's CP's ranks: every shard gathered whole, one call per rank over all S keys at
    their positions in the balancer's placement, as PyTorch's scheme runs them (priced as its
    `torch_cp` contender). Its calls have one shape on every rank and under every balancer, so
    the kernel compiles once where keys of each rank's own length would compile per rank."""
    return simulate_allgather(sc, whole=True)


def whole_plan(world_size: int, shard_rows: int) -> ReadPlan:
    """The ReadPlan of every rank reading every other shard whole (ReadPlan.gathers)."""
    P, n = world_size, shard_rows
    runs = tuple(tuple(() if src == dst else ((0, n),) for src in range(P)) for dst in range(P))
    return ReadPlan(runs, n)


def _simulated_rank(
    ranks: SequenceRanks,
    r: int,
    clock,
    overlap: bool | None,
    whole: bool = False,
    fold: bool | None = False,
) -> tuple[RankWork, int, int, str, bool]:
    """Rank r's RankWork, the bytes it receives, its received buffer's bytes, the transfer's
    pattern (allgather, or alltoall for the exchange) and whether its calls were folded;
    `whole`: every shard gathered whole; `fold`: AllGatherOptions.fold."""
    P, q_r, ks, vs = ranks.world_size, ranks.qs[r], ranks.ks, ranks.vs
    call, counted = ranks.call(r), ranks.call(r, counted=True)
    saved = ranks.saved[r] if ranks.saved is not None else None
    if P == 1:
        plan = ReadPlan((((),),), ks[0].shape[2])
    else:
        plan = whole_plan(P, ks[0].shape[2]) if whole else read_plan(call, q_r)
    b, g, n, d = ks[0].shape
    row = nbytes(2, b, g, 1, d, itemsize=ks[0].element_size())
    for p in range(P):  # the chunk pairs the calls cover, counted as the algorithm does
        pairs(counted, q_r, p, masks=False)
    pattern = "allgather" if plan.gathers else "alltoall"
    grads = 2 if saved is not None else 1
    if plan.overlaps(overlap):
        received = row * plan.received(r)
        folding = _folding(call, q_r, ks[r], fold)
        work = _overlapped_rank(ranks, r, clock, plan, folding)
        parts = ("own", "received") if plan.received(r) else ("own",)
        folded = any(_mapped(call, q_r, plan, p, folding).fold is not None for p in parts)
        return work, received, received * grads, pattern, folded
    if plan.gathers:  # the gathered buffer, rank order
        k_all, v_all = torch.cat(ks, dim=2), torch.cat(vs, dim=2)
        received, buffer = row * n * (P - 1), row * n * P
    elif plan.moves:  # this rank's chunks and the rows it receives, in position order
        k_all, v_all = _call_keys(
            key_pieces(call.layout, r, plan),
            # a pad's rows as they are: the mask keeps none of them for this rank
            lambda src, a, b, o: (ks[src][:, :, a:b], vs[src][:, :, a:b]),
        )
        received = buffer = row * plan.received(r)
    else:
        k_all, v_all, received, buffer = ks[r], vs[r], 0, 0
    pc = _mapped(call, q_r, plan, folding=_folding(call, q_r, ks[r], fold))

    def fwd():
        with torch.no_grad():
            attend_at(call, q_r, k_all, v_all, pc)

    bwd = None
    if saved is not None:
        leaves = [t.detach().requires_grad_() for t in (q_r, k_all, v_all)]

        def bwd():
            with torch.enable_grad():
                out, _ = mapped_call(call, *leaves, pc)
                torch.autograd.grad(out, leaves, saved.dout)

    key = ("allgather", *_read_through(pc), tuple(q_r.shape), tuple(k_all.shape),
           clock.mask_key(pc.block_mask))  # fmt: skip
    item = Item(key=key, fwd=fwd, bwd=bwd, block_masks=(pc.block_mask,))
    fwd = clock.time(item, "fwd")
    both = clock.time(item, "bwd") if saved is not None else None
    # fwd-and-bwd as one item: the backward item re-runs the forward under autograd (flex's
    # backward needs its graph), so its time is fwd+bwd; the backward alone is the difference.
    work = RankWork(
        fwd_ms=(fwd.ms,),
        bwd_ms=() if both is None else (max(both.ms - fwd.ms, 0.0),),
        fwd_bytes=(received,),
        bwd_bytes=(received,),
        host_fwd_ms=fwd.host_ms,
        host_bwd_ms=0.0 if both is None else max(both.host_ms - fwd.host_ms, 0.0),
    )
    return work, received, buffer * grads, pattern, pc.fold is not None


def _read_through(pc: PositionedCall) -> tuple[str, ...]:
    """("tables",) for a call whose callbacks read positions through tables (a rank's rows or
    keys in several runs), ("folded",) for a folded call (AllGatherOptions.fold): kinds of item
    the model prices apart from calls with offsets (on CPU ranks tables timed 1.5 times the
    offsets' line)."""
    if pc.fold is not None:
        return ("folded",)
    maps = pc.maps
    return ("tables",) if maps is not None and maps.q_positions is not None else ()


def _overlapped_rank(ranks: SequenceRanks, r: int, clock, plan: ReadPlan, folding) -> RankWork:
    """Rank r's two calls of the overlap, as _Overlapped runs them: forward (own keys, then the
    received rows with the merge), backward (the received rows', then the own keys') from the
    whole problem's merged out and lse at its rows."""
    q_r, ks, vs = ranks.qs[r], ranks.ks, ranks.vs
    call, saved = ranks.call(r), ranks.saved[r] if ranks.saved is not None else None
    n = q_r.shape[2]
    parts = [("own", ks[r], vs[r])]
    if plan.received(r):  # a pad's rows as they are: the mask keeps none of them for this rank
        parts.append(("received", *_call_keys(
            received_pieces(call.layout, r, plan),
            lambda src, a, b, o: (ks[src][:, :, a:b], vs[src][:, :, a:b]),
        )))  # fmt: skip
    fwd_ms, bwd_ms, host = [], [], [0.0, 0.0]
    own = _mapped(call, q_r, plan, "own", folding)
    with torch.no_grad():  # the own keys' partial, which the received rows' call merges into
        own_partial = attend_at(call, q_r, ks[r], vs[r], own)
    for part, k_p, v_p in parts:
        pc = _mapped(call, q_r, plan, part, folding)
        rows = _received_rows(call, q_r, plan, folding) if part == "received" else slice(0, n)
        q_p = q_r[:, :, rows]

        def fwd(pc=pc, q_p=q_p, k_p=k_p, v_p=v_p, rows=rows, merged=part == "received"):
            with torch.no_grad():
                out, lse = attend_at(call, q_p, k_p, v_p, pc)
                if merged:  # into the own keys' partial at its rows, as _Overlapped does
                    _merged_rows(call, q_r, *own_partial, rows, (out, lse))

        def bwd(pc=pc, k_p=k_p, v_p=v_p, rows=rows):
            with torch.no_grad():
                grads_at(call, _rows_of(saved, rows), k_p, v_p, pc)

        key = ("allgather", part, *_read_through(pc), tuple(q_p.shape), tuple(k_p.shape),
               clock.mask_key(pc.block_mask))  # fmt: skip
        item = Item(key=key, fwd=fwd, bwd=bwd if saved is not None else None,
                    block_masks=(pc.block_mask,))  # fmt: skip
        timed = clock.time(item, "fwd")
        fwd_ms.append(timed.ms)
        host[0] += timed.host_ms
        if saved is not None:
            timed = clock.time(item, "bwd")
            bwd_ms.insert(0, timed.ms)  # the received rows' backward runs first
            host[1] += timed.host_ms
    received = nbytes(2, *ks[r].shape[:2], plan.received(r), ks[r].shape[3],
                      itemsize=ks[r].element_size())  # fmt: skip
    return RankWork(
        fwd_ms=tuple(fwd_ms), bwd_ms=tuple(bwd_ms), fwd_bytes=(received,),
        bwd_bytes=(received,), host_fwd_ms=host[0], host_bwd_ms=host[1],
    )  # fmt: skip


def gather_rank_ms(
    work: RankWork, fab: Fabric, backward: bool, crossing: float = 0.0, pattern="allgather"
) -> float:
    """The transfer, then the call; backward: the call's, then the gradients home (as long as
    the transfer). Overlapped (two calls: fwd_ms (own, received), bwd_ms (received, own)): the
    transfer beside the own keys' call, then the received rows'; backward: the received rows',
    then the gradients home beside the own keys'. `crossing`: the share received from other
    NVLink domains; `pattern`: allgather for whole shards, alltoall for the exchange of the rows
    each rank reads."""
    transfer = fab.ms(pattern, work.fwd_bytes[0] if work.fwd_bytes else 0.0, crossing)
    if len(work.fwd_ms) == 2:
        total = max(transfer, work.fwd_ms[0]) + work.fwd_ms[1]
        if backward:
            total += work.bwd_ms[0] + max(transfer, work.bwd_ms[1])
        return total
    total = transfer + work.compute_fwd_ms
    if backward:
        total += sum(work.bwd_ms) + transfer
    return total


def price_allgather(sim: Simulation, fab: Fabric, backward: bool) -> Prediction:
    """The all-gather's call on `fab` (gather_rank_ms), and PyTorch's scheme beside it: one call
    per rank with every rank's whole K/V shard gathered first (`torch_cp`)."""
    crossing = fab.collective_crossing(len(sim.ranks), sim.stride)
    pattern = sim.extra.get("pattern", "allgather")
    ours = predict(
        functools.partial(gather_rank_ms, crossing=crossing, pattern=pattern), sim.ranks, fab,
        backward,
    )  # fmt: skip
    theirs = predict(
        functools.partial(gather_rank_ms, crossing=crossing), sim.extra["torch_cp"], fab, backward
    )
    return dataclasses.replace(ours, contenders={"torch_cp": theirs})


ALLGATHER = TopologySpec(
    name="allgather",
    attention=allgather_attention,
    layouts=LAYOUTS,
    user_layouts=True,
    options=AllGatherOptions,
    timer=allgather_transfer_ms,
    simulate=simulate_allgather,
    price=price_allgather,
    pickable=True,
)


def torch_cp_simulation() -> TopologySpec:
    """The spec that simulates PyTorch's CP (simulate_torch_cp; the run layer's predicted
    torch_cp contender). Made on request: a TopologySpec of a module of this folder is a
    topology users can select (topologies.py), and this one is not."""
    return dataclasses.replace(
        ALLGATHER, name="torch_cp", simulate=simulate_torch_cp, pickable=False
    )
