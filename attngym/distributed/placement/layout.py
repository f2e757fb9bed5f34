"""How a sequence is spread over ranks: which global positions each rank's shard holds.

Layouts (S tokens, P ranks, sharded along `dim`, the sequence dim 2 of (B, H, S, D)):

    contiguous  rank r holds positions [r·S/P, (r+1)·S/P): one chunk per rank.
    zigzag      S is cut into 2P equal chunks; rank r holds chunk r, then chunk 2P-1-r. Under a
                causal mask every rank then does the same amount of work (the early chunk is cheap,
                the late one expensive).
    double_zigzag  each half of S a zigzag: S is cut into 4P equal chunks; rank r holds chunks r,
                2P-1-r, 2P+r and 4P-1-r, as even under a causal mask. The ranks' j-th chunks are
                the sequence's j-th quarter, so Ulysses exchanges it in four rounds
                (attngym.distributed.schemes.ulysses_rounds) where zigzag gives two.
    balanced    placed from the variant's block mask: S is cut into n = 2P·m equal pieces
                (m = 1, 2 or 4), each piece priced by the cost model below, and a greedy
                placement (largest piece first, to the least loaded rank that still has room)
                gives every rank n/P pieces; pieces adjacent on a rank merge into one chunk.
                Priced per ring step (PairKernels.shards), the greedy placement is then improved
                by swapping pieces between ranks while the slowest rank gets faster (at every
                split, as a step's fixed part makes the mean depend on the split).
                Each such placement, zigzag and contiguous are then priced as a whole, and the
                one whose slowest rank is fastest is kept (named "balanced" whichever it is): a
                piece's price is only a guide (a rank's blocks may straddle its pieces), so
                balanced is never predicted slower than the fixed layouts. With one call per
                rank over pieces of whole blocks a rank's price is its pieces' sum, and the
                pieces are priced once from the whole sequence's blocks (_piece_costs).
                For causal it finds zigzag; for packed documents it spreads each document's
                expensive tail (the designs PyTorch's per-document head-tail and PTRR load
                balancers follow; those count blocks, this weighs them by what they cost).
    documents   packed documents placed whole, from their lengths (the variant's varlen form),
                the long ones split head-and-tail over a few ranks
                (attngym.distributed.placement.documents): on short documents a rank reads
                little of another's shard, where balanced spreads every document over all.
    module.fn   a user's balancer by import path (is_user_layout; attngym.user_code resolves it):
                called once per variant with the keywords it names out of BALANCER_ARGUMENTS,
                it returns each rank's (offset, length) chunks, checked here (see plan).

The cost model (`_TimeModel`, the one home of a layout's predicted time): every block a kernel
runs costs BLOCK_COSTS (full, partial) in units of a full block's time. Without `PairKernels`
each rank runs one call, its shard's rows in shard order against the whole sequence's keys in
position order, cut into blocks of `block_size` from the shard's start; with `PairKernels` (a
TopologySpec with pair_kernels) each rank runs one kernel per (its q chunk, any kv chunk) pair,
blocks cut from each chunk's start, or with `shards` (step_kernels: the ring) one per (its q
shard, any kv shard) pair, blocks cut from each shard's start, priced as PairKernels says. Two
measures, named apart:

    time_imbalance  predicted time imbalance: max over mean of the ranks' predicted times under
                    this model (with PairKernels a layout's total varies with its launches and
                    waves, so the fastest slowest rank, which `balanced` keeps, may be less even
                    than zigzag's).
    load_imbalance  block imbalance: max over mean of the non-empty blocks per rank, a count
                    whatever the blocks cost (the runs' load_imbalance metric).

A rank's shard is the concatenation of its chunks in that order; `chunks` gives them as
(global offset, length) pairs, which is what the context-parallel kernels pass as q/kv offsets.
A `Layout` (from `plan`) holds every rank's chunks; contiguous and zigzag need only (P, S),
balanced and a user's balancer need the variant, so shard/unshard/chunks take either a name with
the variant or a precomputed Layout.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import operator
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

import torch

from attngym.errors import ConfigError

LAYOUTS = ("contiguous", "zigzag", "double_zigzag", "balanced", "documents")
# Those placed from (P, S) alone, without the variant.
FIXED_LAYOUTS = ("contiguous", "zigzag", "double_zigzag")
# Those `topology=auto` tries where topology.options.layouts names none: double_zigzag is
# zigzag's calls on twice the chunks for a ring or an all-gather, and Ulysses' four rounds on it
# were slower than its one call on packed documents at 128K over 8 simulated ranks of an H100
# (experiments/workloads). documents only where the variant names its documents (applies).
PICKED_LAYOUTS = ("contiguous", "zigzag", "balanced", "documents")

# The keywords a user's balancer may name (it gets those it names; with **kwargs, all of them).
BALANCER_ARGUMENTS = ("variant", "block_mask", "seq_len", "world_size", "block_size", "device")

# Pieces per 2P that `balanced` tries, fewest first (more pieces: finer balance, more chunk pairs).
BALANCE_SPLITS = (1, 2, 4)
# A placement this close to perfect (max/mean) stops the search for more pieces.
GOOD_ENOUGH = 1.02
# (full, partial) block time, in units of a full block's: fitted to the one-GPU fwd+bwd times of
# experiments/multi_gpu_cp (H200, bf16, B=1, H=8, D=128, blocks of 128): causal 128K, 523776
# full + 1024 partial blocks in 305.1 ms (study_causal.csv), and sliding_window(1024) 128K, 7168
# full + 2048 partial in 6.32 ms (study_window.csv), give 0.580 us a full block and 1.054 us a
# partial one. (1.0, 1.0) counts blocks (the placement before time was weighed).
BLOCK_COSTS = (1.0, 1.82)


def block_row_prices(block_mask) -> torch.Tensor:
    """Each block row's price (B, H, rows; the batches and heads the mask holds): its full
    and partial blocks at BLOCK_COSTS."""
    full_cost, partial_cost = BLOCK_COSTS
    price = block_mask.kv_num_blocks.double() * partial_cost
    if block_mask.full_kv_num_blocks is not None:
        price = price + block_mask.full_kv_num_blocks.double() * full_cost
    return price


# A kernel launch and its fixed work (fwd+bwd), in full-block times of one program: about 20 us
# per chunk pair (two launches, the backward's preprocessing) against 9.6 us per full block and
# program (305.1 ms for 523776 blocks x 8 heads over 132 SMs, causal 128K in BLOCK_COSTS' source).
LAUNCH_COST = 2.0

# A ring step call over a whole q shard (PairKernels.shards), fitted to the ring's 64 step calls
# on packed documents at P=8 (experiments/cp_model, step_times.py, H200, 128K, B=1 H=8 D=128;
# R^2 0.976 in two runs): in units of the blocks' spread over the SMs (7.95 us per full block and
# program), each call also waits 0.34 of its longest block row (forward, dq) and 0.16 of its
# longest block column (dK/dV) and costs 46 of its own (the merge, the gradient sums, the
# backward's preprocessing and each kernel's reads and writes of the whole shard).
STEP_TAIL = (0.34, 0.16)
STEP_LAUNCH = 46.0
# The swap search's work per split, in (q block, rank) entries priced (counted, not timed, so
# every rank stops at the same swap): P=8 at 128K searches to its end inside it (0.6e8, under a
# second on a CPU core); P=64 stops after about 1500 swaps tried at 128K, 190 at 1M.
SWAP_SEARCH = 10**8
# Swaps priced together (_ShardPairPrices.swapped_times), in (swap, q block, rank) entries: 64
# swaps at P=8 and 128K; more per batch stop paying once the batch outgrows the CPU's caches.
SWAP_BATCH = 2**19


@dataclasses.dataclass(frozen=True)
class PairKernels:
    """How the cost model (`balanced`, `time_imbalance`) prices a scheme that runs one kernel per
    pair of q and kv pieces: per (q chunk, kv chunk) pair (TopologySpec.pair_kernels: a pairwise
    scheme of your own), or with `shards` per (q shard, kv shard) pair (TopologySpec.step_kernels:
    the ring, whose step is one call over shards of several chunks). Such a kernel runs one program
    per (batch, head, block row) over `slots` parallel units, so beside its blocks spread over the
    units it waits for its longest block row (its longest column, in the backward): a thin pair
    whose rows read whole documents costs more than its blocks say. Priced by blocks alone, a ring
    of pair kernels over packed documents was 1.43x imbalanced in time at a block imbalance of
    1.02 (experiments/cp_model). A chunk pair's kernel takes the slower of its spread and its
    longest row or column, plus `launch`; a shard pair's (many programs, of rows cut from the
    shard's start) its spread plus STEP_TAIL of its longest row and column, plus `launch`.

    Attributes:
        programs: programs per block row, batch x query heads.
        slots: programs the device runs at once (CUDA: its SM count).
        launch: a kernel's fixed cost, in full-block times of one program.
        shards: one kernel per (q shard, kv shard) pair rather than per chunk pair.
    """

    programs: int
    slots: int
    launch: float = LAUNCH_COST
    shards: bool = False

    def __post_init__(self):
        for name in ("programs", "slots"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PairKernels.{name} must be a positive integer, got {value!r}")
        if not self.launch >= 0:
            raise ValueError(f"PairKernels.launch must be >= 0, got {self.launch!r}")


def pair_kernels(
    batch_heads: int, device: torch.device | str, shards: bool = False
) -> PairKernels | None:
    """The pair-kernel pricing on `device` (per shard pair with `shards`: STEP_LAUNCH): its SM
    count on CUDA; None elsewhere (a CPU kernel has no waves to speak of, and blocks price it)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    slots = torch.cuda.get_device_properties(device).multi_processor_count
    launch = STEP_LAUNCH if shards else LAUNCH_COST
    return PairKernels(batch_heads, slots, launch, shards)


def is_user_layout(layout: Any) -> bool:
    """Whether `layout` names a user's balancer by import path (`module.function`, or
    `module:function` as attngym.user_code also takes it) rather than a built-in layout."""
    return isinstance(layout, str) and layout not in LAYOUTS and ("." in layout or ":" in layout)


def _check(layout: str, world_size: int) -> None:
    if not (isinstance(layout, str) and (layout in LAYOUTS or is_user_layout(layout))):
        raise ValueError(
            f"layout must be one of {', '.join(LAYOUTS)} or a balancer's import path "
            f"(module.function); got {layout!r}"
        )
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")


def pieces(layout: str, world_size: int) -> int:
    """How many equal pieces S is at least cut into: 2P (zigzag, balanced), 4P (double_zigzag)
    or P (contiguous, and a user's balancer, which may place any S/P positions on a rank)."""
    _check(layout, world_size)
    return world_size * {"zigzag": 2, "balanced": 2, "double_zigzag": 4}.get(layout, 1)


def check_seq_len(seq_len: int, world_size: int, layout: str) -> None:
    """ValueError unless `seq_len` splits evenly into the layout's pieces."""
    n = pieces(layout, world_size)
    if seq_len % n:
        raise ValueError(
            f"seq_len={seq_len} must be divisible by {n} for layout={layout!r} with "
            f"world_size={world_size} ({n // world_size if n > world_size else ''}P equal chunks)"
        )


@dataclasses.dataclass(frozen=True)
class Layout:
    """Every rank's chunks: `placement[r]` is rank r's (global offset, length) list, shard order."""

    name: str
    world_size: int
    seq_len: int
    placement: tuple[tuple[tuple[int, int], ...], ...]

    def chunks(self, rank: int) -> list[tuple[int, int]]:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        return list(self.placement[rank])

    def positions(self, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """(S/P,) the global position of each row of `rank`'s shard."""
        return torch.cat([torch.arange(o, o + n, device=device) for o, n in self.placement[rank]])


def _fixed(layout: str, world_size: int, seq_len: int) -> Layout:
    check_seq_len(seq_len, world_size, layout)
    n = pieces(layout, world_size)
    size = seq_len // n
    zigzags = n // (2 * world_size)  # each over 2P chunks of its part of S (contiguous: none)
    if not zigzags:
        placement = [((r * size, size),) for r in range(world_size)]
    else:
        span = 2 * world_size
        placement = [
            tuple(((z * span + i) * size, size) for z in range(zigzags) for i in (r, span - 1 - r))
            for r in range(world_size)
        ]
    return Layout(layout, world_size, seq_len, tuple(placement))


def _joined(chunks: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """The chunks in the same order, each one that starts where the previous ends merged into it
    (the shard is the same tensor, cut into fewer chunk pairs)."""
    out: list[list[int]] = []
    for offset, length in chunks:
        if out and out[-1][0] + out[-1][1] == offset:
            out[-1][1] += length
        else:
            out.append([offset, length])
    return tuple((o, n) for o, n in out)


def of_positions(name: str, positions: Sequence[torch.Tensor]) -> Layout:
    """The Layout whose rank r holds `positions[r]` (global positions, in shard order): another
    system's placement (PyTorch's load balancers) as chunks attngym shards and unshards by."""
    world_size = len(positions)
    seq_len = sum(int(p.numel()) for p in positions)
    placement = tuple(_joined([(int(x), 1) for x in p.tolist()]) for p in positions)
    return Layout(name, world_size, seq_len, placement)


EMPTY, PARTIAL, FULL = 0, 1, 2


def _block_classes(variant, seq_len: int, block: int, device) -> torch.Tensor:
    """(S/block, S/block) int8 on the CPU: each (block x block) tile of the variant's whole mask
    EMPTY, PARTIAL (evaluated per entry) or FULL, from its block grid (exact integers, so every
    rank prices alike)."""
    from attngym.distributed.placement.grid import block_grid

    n = seq_len // block
    grid = block_grid(variant, seq_len, (block, block), device)
    if grid is None:  # no mask: every block is kept, and full
        return torch.full((n, n), FULL, dtype=torch.int8)
    partial, full = (g.cpu() for g in grid)
    out = torch.zeros(n, n, dtype=torch.int8)
    out[partial] = PARTIAL
    out[full] = FULL
    return out


def _kernel_blocks(groups, tile: int, block: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which kernel block each tile of the sequence falls in, when each group's chunks are laid
    end to end and cut into blocks of `block` positions from the group's start (the last one may
    be short), and which group each kernel block belongs to.

    Returns:
        (tiles,) kernel block of each tile (global tile order); (blocks,) group of each block.
    """
    per = block // tile
    block_of = torch.empty(tiles, dtype=torch.long)
    group_of: list[int] = []
    for g, chunks in enumerate(groups):
        rows = torch.cat([torch.arange(o // tile, (o + n) // tile) for o, n in chunks])
        local = torch.arange(rows.numel()) // per
        block_of[rows] = len(group_of) + local
        group_of += [g] * (int(local[-1]) + 1)
    return block_of, torch.tensor(group_of)


@dataclasses.dataclass
class _TimeModel:
    """Each rank's predicted time for a placement (module docstring: the cost model), the one
    price that `balanced` places by and `time_imbalance` and `load_imbalance` report.

    The variant's mask is read once per tile size (the largest that divides the block sizes and
    every chunk boundary), so blocks that straddle chunks are classed exactly: empty when all
    their tiles are, full when all are, else partial.
    """

    variant: Any
    seq_len: int
    block_size: tuple[int, int]
    device: Any
    kernels: PairKernels | None = None
    block_costs: tuple[float, float] = BLOCK_COSTS
    _tiles: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict, init=False)
    _whole: tuple[torch.Tensor, torch.Tensor] | None = dataclasses.field(default=None, init=False)

    def rank_times(self, placement: Sequence[Sequence[tuple[int, int]]]) -> list[float]:
        """Predicted time of each rank of `placement` (any number of ranks: `balanced` prices
        single pieces as one-piece ranks), in full-block times."""
        chunks = [c for rank in placement for c in rank]
        k = self.kernels
        if k is None:  # one call per rank: its shard against every key in order
            q_groups, kv_groups = placement, [[(0, self.seq_len)]]
        elif k.shards:  # one kernel per (q shard, kv shard) pair
            q_groups = kv_groups = placement
        else:  # one kernel per (q chunk, kv chunk) pair
            q_groups = kv_groups = [[c] for c in chunks]
        full, partial, q_group, kv_group = self.block_kinds(q_groups, kv_groups, chunks)
        cost = self.cost(full, partial)
        # [q group, kv group]: the blocks' total time, then the pair kernel's price.
        by_kv = torch.zeros(len(q_group), len(kv_groups), dtype=torch.float64)
        by_kv.index_add_(1, kv_group, cost)  # [q block, kv group]
        total = torch.zeros(len(q_groups), len(kv_groups), dtype=torch.float64)
        total.index_add_(0, q_group, by_kv)
        if k is None:
            return total.sum(1).tolist()
        by_q = torch.zeros(len(q_groups), len(kv_group), dtype=torch.float64)
        by_q.index_add_(0, q_group, cost)  # [q group, kv block]
        rows = q_group.unsqueeze(1).expand_as(by_kv)
        cols = kv_group.unsqueeze(0).expand_as(by_q)
        row = torch.zeros_like(total).scatter_reduce_(0, rows, by_kv, "amax")  # longest row
        col = torch.zeros_like(total).scatter_reduce_(1, cols, by_q, "amax")  # longest column
        price = _pair_price(k, total, row, col)
        if k.shards:
            return price.sum(1).tolist()
        rank_of = torch.tensor([r for r, rank in enumerate(placement) for _ in rank])
        times = torch.zeros(len(placement), dtype=torch.float64)
        return times.index_add_(0, rank_of, price.sum(1)).tolist()

    def whole_block_kinds(self) -> tuple[torch.Tensor, torch.Tensor]:
        """([q block, kv block] full, partial) int32 flags of the whole sequence in position
        order (computed once): exact, so sums of them are the same on every rank."""
        if self._whole is None:
            block_q, block_kv = self.block_size
            if block_q == block_kv and not self.seq_len % block_q:  # each tile is a block
                classes = self._tile_classes(block_q)
                self._whole = ((classes == FULL).int(), (classes == PARTIAL).int())
            else:
                whole = [[(0, self.seq_len)]]
                self._whole = self.block_kinds(whole, whole)[:2]
        return self._whole

    def _tile_classes(self, tile: int) -> torch.Tensor:
        """The variant's (tile x tile) classes (_block_classes), read once per tile size."""
        if tile not in self._tiles:
            self._tiles[tile] = _block_classes(self.variant, self.seq_len, tile, self.device)
        return self._tiles[tile]

    def cost(self, full: torch.Tensor, partial: torch.Tensor) -> torch.Tensor:
        """float64 time of `full` and `partial` blocks (flags, or exact counts of them)."""
        full_cost, partial_cost = self.block_costs
        return full.double() * full_cost + partial.double() * partial_cost

    def block_kinds(self, q_groups, kv_groups, chunks=()) -> tuple[torch.Tensor, ...]:
        """Which kernel blocks are full and which partial when each group's chunks are laid end
        to end and cut into blocks from the group's start: ([q block, kv block] full flags,
        partial flags, both int32; the q group of each q block, the kv group of each kv block).
        `chunks`: boundaries the tiles must also divide."""
        block_q, block_kv = self.block_size
        tile = math.gcd(block_q, block_kv, *(x for c in chunks for x in c))
        classes = self._tile_classes(tile)
        tiles = self.seq_len // tile
        q_block, q_group = _kernel_blocks(q_groups, tile, block_q, tiles)
        kv_block, kv_group = _kernel_blocks(kv_groups, tile, block_kv, tiles)

        def per_block(x: torch.Tensor) -> torch.Tensor:  # (tiles, tiles) -> (q blocks, kv blocks)
            cols = torch.zeros(tiles, len(kv_group), dtype=torch.int32).index_add_(1, kv_block, x)
            return torch.zeros(len(q_group), len(kv_group), dtype=torch.int32).index_add_(
                0, q_block, cols
            )

        size = torch.outer(torch.bincount(q_block), torch.bincount(kv_block))
        kept = per_block((classes != EMPTY).int()) > 0
        full = per_block((classes == FULL).int()) == size
        return full.int(), (kept & ~full).int(), q_group, kv_group


def _pair_price(k: PairKernels, total, row, col) -> torch.Tensor:
    """[q piece, kv piece] kernel prices (PairKernels) from the blocks' total time and the
    longest block row and column of each pair; a chunk pair that computes nothing costs 0."""
    spread = total * k.programs / k.slots
    if k.shards:  # a ring step pays its fixed part computing or not: its transfers pass through
        return spread + STEP_TAIL[0] * row + STEP_TAIL[1] * col + k.launch
    return torch.maximum(spread, torch.maximum(row, col)) + k.launch * (total > 0)


class _ShardPairPrices:
    """PairKernels.shards' rank times of placements made of whole equal pieces aligned to the
    blocks (a rank's kernel blocks are then the pieces' own, whatever their order), from
    per-piece sums of the block costs: a swap of two pieces is priced in microseconds, not by
    reading the mask's tiles again, so `balanced` can search swaps."""

    def __init__(self, model: _TimeModel, piece: int):
        full, partial = model.whole_block_kinds()
        n, nq, nkv = model.seq_len // piece, *full.shape
        self.piece = piece
        self.q_per, self.kv_per = nq // n, nkv // n
        # Exact block counts per piece, priced once each.
        by_kv = [k.reshape(nq, n, self.kv_per).sum(2) for k in (full, partial)]
        by_q = [k.reshape(n, self.q_per, nkv).sum(1) for k in (full, partial)]
        self.by_kv_piece = model.cost(*by_kv)  # [q block, kv piece]
        self.by_q_piece = model.cost(*by_q)  # [q piece, kv block]
        self.total = model.cost(*(k.reshape(n, self.q_per, n).sum(1) for k in by_kv))
        self.kernels = model.kernels

    def rank_times(self, owner: torch.Tensor, ranks: int) -> torch.Tensor:
        """(ranks,) predicted times when piece i is on rank owner[i] (sums in a fixed order,
        index_add rather than a BLAS product, so every rank searches alike)."""
        return self.swapped_times(owner, ranks, torch.empty(0, 2, dtype=torch.long))[0]

    def swapped_times(self, owner: torch.Tensor, ranks: int, pairs: torch.Tensor) -> torch.Tensor:
        """(len(pairs), ranks) predicted times of `owner` with pieces i and j swapped, for each
        (i, j) of `pairs` (an empty `pairs`: (1, ranks), `owner`'s own). A swap changes two ranks'
        sums: they are updated from `owner`'s, not summed again, so a round of the search prices
        its swaps together in about the time of one placement."""
        f64 = torch.float64
        n, nq = len(owner), len(self.by_kv_piece)
        by_q_rank = torch.zeros(ranks, n, dtype=f64).index_add_(0, owner, self.total)
        rows = torch.zeros(nq, ranks, dtype=f64).index_add_(1, owner, self.by_kv_piece)
        cols = torch.zeros(ranks, self.by_q_piece.shape[1], dtype=f64).index_add_(
            0, owner, self.by_q_piece
        )
        # Each piece's longest block row against each kv rank, and each rank's longest block
        # column in each kv piece (a piece's blocks are consecutive): a swap changes only the
        # two ranks' own, so only theirs are taken again, and a max is exact in any order.
        piece_rows = rows.reshape(n, self.q_per, ranks).amax(1)  # [q piece, kv rank]
        piece_cols = cols.reshape(ranks, n, self.kv_per).amax(2)  # [q rank, kv piece]
        if len(pairs) == 0:
            owners, by_q_rank, piece_rows, piece_cols = (
                x.unsqueeze(0) for x in (owner, by_q_rank, piece_rows, piece_cols)
            )
        else:  # pieces of two ranks (ri != rj)
            i, j, at = pairs[:, 0], pairs[:, 1], torch.arange(len(pairs))
            trials, ri, rj = len(pairs), owner[i], owner[j]
            owners = owner.repeat(trials, 1)
            owners[at, i], owners[at, j] = rj, ri
            by_q_rank, piece_rows, piece_cols = (
                x.repeat(trials, 1, 1) for x in (by_q_rank, piece_rows, piece_cols)
            )
            change = self.total[j] - self.total[i]  # rank ri's queries gain piece j, lose piece i
            by_q_rank[at, ri] += change
            by_q_rank[at, rj] -= change
            change = self.by_kv_piece[:, j].T - self.by_kv_piece[:, i].T  # [swap, q block]
            for r, new in ((ri, rows[:, ri].T + change), (rj, rows[:, rj].T - change)):
                piece_rows[at, :, r] = new.reshape(trials, n, self.q_per).amax(2)
            change = self.by_q_piece[j] - self.by_q_piece[i]  # [swap, kv block]
            for r, new in ((ri, cols[ri] + change), (rj, cols[rj] - change)):
                piece_cols[at, r] = new.reshape(trials, n, self.kv_per).amax(2)
        trials = len(owners)
        # [trial, q rank, kv rank]: each trial's ranks numbered apart, so one index_add sums all.
        flat = (owners + ranks * torch.arange(trials).unsqueeze(1)).reshape(-1)
        total = torch.zeros(ranks, trials * ranks, dtype=f64).index_add_(
            1, flat, by_q_rank.transpose(0, 1).reshape(ranks, -1)
        )
        total = total.reshape(ranks, trials, ranks).transpose(0, 1)
        q_rank = owners.unsqueeze(2).expand_as(piece_rows)
        row = torch.zeros_like(total).scatter_reduce_(1, q_rank, piece_rows, "amax")  # longest row
        kv_rank = owners.unsqueeze(1).expand_as(piece_cols)
        col = torch.zeros_like(total).scatter_reduce_(2, kv_rank, piece_cols, "amax")  # longest col
        price = _pair_price(self.kernels, total, row, col).reshape(trials * ranks, ranks)
        times = torch.zeros(trials * ranks, 1, dtype=f64).index_add_(
            1, owner.new_zeros(ranks), price
        )
        return times.reshape(trials, ranks)


def _owner(owned: Sequence[Sequence[int]], n: int) -> torch.Tensor:
    """(n,) the rank of each piece, from each rank's pieces."""
    owner = torch.empty(n, dtype=torch.long)
    for r, pieces_r in enumerate(owned):
        owner[list(pieces_r)] = r
    return owner


def _swapped(owner: torch.Tensor, prices: _ShardPairPrices, ranks: int) -> torch.Tensor:
    """The placement `owner` improved by swapping pieces between ranks while some swap of a
    piece of the slowest rank makes the slowest rank of all faster (a local search: each round
    takes the best such swap), within SWAP_SEARCH's work (counted, not timed: every rank stops
    at the same swap)."""
    owner = owner.clone()
    times = prices.rank_times(owner, ranks)
    trials = SWAP_SEARCH // (len(prices.by_kv_piece) * ranks)
    while trials > 0:
        slowest, best = float(times.max()), None
        swaps = [(i, j) for i in (owner == int(times.argmax())).nonzero()[:, 0].tolist()
                 for j in (owner != owner[i]).nonzero()[:, 0].tolist()][:trials]  # fmt: skip
        batch = max(1, SWAP_BATCH // (len(prices.by_kv_piece) * ranks))
        for start in range(0, len(swaps), batch):
            pairs = torch.tensor(swaps[start : start + batch])
            trial_times = prices.swapped_times(owner, ranks, pairs)
            for t, worst in enumerate(trial_times.max(1).values.tolist()):
                if worst < slowest * (1 - 1e-9):
                    slowest, best = worst, (*swaps[start + t], trial_times[t])
        trials -= len(swaps)
        if best is None:
            break
        i, j, times = best
        owner[[i, j]] = owner[[j, i]]
    return owner


def _piece_costs(model: _TimeModel, size: int) -> list[float]:
    """Each piece's time of one call per rank (the pieces of `size` in order, whole blocks):
    its query blocks' rows of the whole sequence's blocks, summed once, so a placement of them
    is priced without reading the mask again."""
    full, partial = model.whole_block_kinds()
    rows = model.cost(full.sum(1), partial.sum(1))  # (q blocks,): exact counts, priced once
    return [math.fsum(piece) for piece in rows.reshape(-1, size // model.block_size[0]).tolist()]


def _summed(costs: list[float], owned: Sequence[Sequence[int]]) -> list[float]:
    """Each rank's time: the sum of its pieces' `costs` (_piece_costs)."""
    return [math.fsum(costs[i] for i in pieces) for pieces in owned]


def _greedy(costs: list[float], world_size: int) -> list[list[int]]:
    """Pieces per rank: largest first, to the least loaded rank with room (ties: lower index)."""
    per_rank = len(costs) // world_size
    load = [0.0] * world_size
    owned: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min((r for r in range(world_size) if len(owned[r]) < per_rank), key=lambda r: load[r])
        owned[r].append(i)
        load[r] += costs[i]
    return [sorted(o) for o in owned]


def _needs_variant(layout: str, variant) -> None:
    if variant is None:
        raise ValueError(
            f"layout={layout!r} is placed from the variant: pass variant= (or a Layout from "
            "attngym.distributed.placement.layout.plan)"
        )


def applies(layout: Any, variant) -> bool:
    """Whether `layout` can place `variant`: documents needs the documents' lengths."""
    return layout != "documents" or _documents_of(variant) is not None


def check_applies(layout: Any, variant, key: str = "topology.layout") -> None:
    """ConfigError naming `key` unless `layout` can place `variant` (applies)."""
    if not applies(layout, variant):
        raise ConfigError(
            key,
            f"documents places packed documents from their lengths, and {variant.name!r} names "
            "none (its varlen form has no documents): use balanced, which places from the mask",
        )


def _documents_of(variant):
    """The variant's varlen form where it names documents (layout=documents), else None."""
    varlen = variant.varlen
    return varlen if varlen is not None and varlen.documents is not None else None


def _documents(world_size: int, seq_len: int, variant) -> Layout:
    from attngym.distributed.placement import documents

    _needs_variant("documents", variant)
    check_applies("documents", variant)
    varlen = _documents_of(variant)
    if sum(varlen.documents) != seq_len:
        raise ValueError(f"the documents hold {sum(varlen.documents)} tokens, seq_len={seq_len}")
    placed = documents.place(varlen.documents, world_size, varlen.left, varlen.right, BLOCK_COSTS)
    return Layout("documents", world_size, seq_len, tuple(_joined(c) for c in placed))


def _balanced(
    world_size: int,
    seq_len: int,
    variant,
    block_size: tuple[int, int],
    device,
    block_costs: tuple[float, float] = BLOCK_COSTS,
    kernels: PairKernels | None = None,
) -> Layout:
    _needs_variant("balanced", variant)
    check_seq_len(seq_len, world_size, "balanced")  # so zigzag and contiguous fit as well
    model = _TimeModel(variant, seq_len, block_size, device, kernels, block_costs)
    # One call per rank over pieces of whole blocks: a rank's time is its pieces' sum.
    additive = kernels is None and not seq_len % (2 * world_size * max(BALANCE_SPLITS)
                                                  * math.lcm(*block_size))  # fmt: skip
    candidates, by_pieces = [], {}
    for m in BALANCE_SPLITS:
        n = 2 * world_size * m
        if seq_len % n:
            break
        size = seq_len // n
        # A ring's steps (shard pairs) of whole pieces: priced from per-piece sums, and swaps
        # searched at every split, as a step's fixed part makes the mean depend on the split.
        searched = kernels is not None and kernels.shards and not size % math.lcm(*block_size)
        if searched:
            prices = by_pieces[size] = _ShardPairPrices(model, size)
            owned = _greedy(prices.rank_times(torch.arange(n), n).tolist(), world_size)
            owner = _swapped(_owner(owned, n), prices, world_size)
            owned = [(owner == r).nonzero()[:, 0].tolist() for r in range(world_size)]
            times = prices.rank_times(owner, world_size).tolist()
        elif additive:
            costs = _piece_costs(model, size)
            owned = _greedy(costs, world_size)
            times = _summed(costs, owned)
        else:
            owned = _greedy(model.rank_times([[(i * size, size)] for i in range(n)]), world_size)
        placement = tuple(_joined([(i * size, size) for i in o]) for o in owned)
        if not (searched or additive):
            times = model.rank_times(placement)
        candidates.append((max(times), placement))
        if max(times) <= GOOD_ENOUGH * sum(times) / world_size and not searched:
            break
    for fixed in ("zigzag", "contiguous"):
        placement = _fixed(fixed, world_size, seq_len).placement
        piece = seq_len // (2 * world_size)  # their pieces are these
        prices = by_pieces.get(piece)
        owned = [[i for o, n in chunks for i in range(o // piece, (o + n) // piece)]
                 for chunks in placement]  # fmt: skip
        if prices is not None:
            times = prices.rank_times(_owner(owned, 2 * world_size), world_size).tolist()
        elif additive:
            times = _summed(_piece_costs(model, piece), owned)
        else:
            times = model.rank_times(placement)
        candidates.append((max(times), placement))
    # The slowest rank sets the call's time; the first of equals wins (fewest pieces).
    slowest, best = candidates[0]
    for its_slowest, placement in candidates[1:]:
        if its_slowest < slowest * (1 - 1e-9):
            slowest, best = its_slowest, placement
    return Layout("balanced", world_size, seq_len, best)


def _user_balancer(path: str) -> tuple[Callable[..., Any], tuple[str, ...]]:
    """The function `path` names and the BALANCER_ARGUMENTS it takes, judged before it runs."""
    from attngym import user_code

    balancer = user_code.resolve(path, key="layout")
    if not callable(balancer):
        raise ConfigError("layout", f"{path} is not callable ({type(balancer).__name__})")
    try:
        params = inspect.signature(balancer).parameters.values()
    except (TypeError, ValueError) as err:
        raise ConfigError("layout", f"{path} has no signature to read ({err})") from None
    if any(p.kind == p.VAR_KEYWORD for p in params):
        return balancer, BALANCER_ARGUMENTS
    for p in params:
        if p.kind == p.VAR_POSITIONAL or p.default is not p.empty:
            continue
        if p.name not in BALANCER_ARGUMENTS or p.kind == p.POSITIONAL_ONLY:
            raise ConfigError(
                "layout",
                f"{path} requires parameter {p.name!r}"
                f"{' positional-only' if p.kind == p.POSITIONAL_ONLY else ''}; a balancer is "
                f"called with the keywords it names out of {', '.join(BALANCER_ARGUMENTS)} (or "
                "**kwargs)",
            )
    keywords = (p.name for p in params if p.kind != p.POSITIONAL_ONLY)
    return balancer, tuple(name for name in keywords if name in BALANCER_ARGUMENTS)


def _user_placement(
    path: str, world_size: int, seq_len: int, variant, block_size: tuple[int, int], device
) -> Layout:
    """Call the user's balancer (once per variant: `plan` memoises) and check what it returns."""
    from attngym import kernels, user_code
    from attngym.errors import CODE_ERRORS, Interrupted

    balancer, takes = _user_balancer(path)
    given = {
        "variant": variant,
        "seq_len": seq_len,
        "world_size": world_size,
        "block_size": block_size,
        "device": torch.device(device),
    }
    if "block_mask" in takes:  # the whole sequence's, built only for a balancer that reads it
        given["block_mask"] = kernels.make_block_mask(
            variant, seq_len, seq_len, block_size=block_size, device=device
        )
    try:
        placed = balancer(**{name: given[name] for name in takes})
    except Interrupted:
        raise
    except CODE_ERRORS as err:
        raise ConfigError("layout", f"{path} raised {user_code.raised(err)}") from err
    placement = _checked_placement(placed, path, world_size, seq_len)
    return Layout(path, world_size, seq_len, tuple(_joined(chunks) for chunks in placement))


def _checked_placement(placed, path: str, world_size: int, seq_len: int) -> list[list[tuple]]:
    """A user balancer's return value as per-rank (offset, length) lists, or ConfigError
    ("layout: <path> ...") naming the first thing wrong with it."""

    def refuse(what: str) -> NoReturn:
        raise ConfigError("layout", f"{path} {what}")

    if not isinstance(placed, list | tuple):
        refuse(
            f"returned a {type(placed).__name__}; a balancer returns one list of (offset, "
            f"length) pairs per rank, {world_size} lists"
        )
    if len(placed) != world_size:
        refuse(
            f"returned a list of {len(placed)} for world_size={world_size}; a balancer returns "
            "one list per rank"
        )
    placement = []
    for r, chunks in enumerate(placed):
        if not isinstance(chunks, list | tuple):
            refuse(
                f"gives rank {r} a {type(chunks).__name__}, not a list of (offset, length) pairs"
            )
        placement.append([])
        for i, chunk in enumerate(chunks):
            try:
                if isinstance(chunk, str | bytes | Mapping | set) or len(chunk) != 2:
                    raise TypeError
                if any(isinstance(x, bool) for x in chunk):
                    raise TypeError
                offset, length = (operator.index(x) for x in chunk)
            except TypeError:
                refuse(f"rank {r} chunk {i} is {chunk!r}, not two ints (offset, length)")
            where = f"rank {r} chunk {i} ({offset}, {length})"
            if offset < 0:
                refuse(f"{where} has a negative offset")
            if length < 1:
                refuse(f"{where} has length {length}; a chunk holds at least one position")
            if offset + length > seq_len:
                refuse(f"{where} ends at {offset + length}, past seq_len={seq_len}")
            placement[r].append((offset, length))
    # How many chunks hold each position: +1 at each start, -1 at each end, summed.
    steps = torch.zeros(seq_len + 1, dtype=torch.long)
    for chunks in placement:
        for offset, length in chunks:
            steps[offset] += 1
            steps[offset + length] -= 1
    held = steps.cumsum(0)[:seq_len]
    wrong = []
    if bool((held == 0).any()):
        wrong.append(f"puts position {int((held == 0).nonzero()[0])} in no chunk")
    if bool((held > 1).any()):
        twice = int((held > 1).nonzero()[0])
        holders = [
            f"rank {r} chunk {i}"
            for r, chunks in enumerate(placement)
            for i, (o, n) in enumerate(chunks)
            if o <= twice < o + n
        ]
        wrong.append(f"puts position {twice} in {len(holders)} chunks ({', '.join(holders)})")
    if wrong:
        refuse(f"{' and '.join(wrong)}; every position must be held exactly once")
    share = seq_len // world_size
    sizes = [sum(n for _, n in chunks) for chunks in placement]
    if any(size != share for size in sizes):
        odd = ", ".join(f"rank {r} {size}" for r, size in enumerate(sizes) if size != share)
        refuse(
            f"gives {odd} positions; every rank must hold seq_len/world_size = {share} (the "
            "shards are tensors of one shape)"
        )
    return placement


def plan(
    layout: str | Layout,
    world_size: int,
    seq_len: int,
    variant=None,
    block_size: Sequence[int] = (128, 128),
    device: torch.device | str = "cpu",
    block_costs: tuple[float, float] = BLOCK_COSTS,
    kernels: PairKernels | None = None,
) -> Layout:
    """Every rank's chunks for `layout` (a name, a balancer's path, or a Layout checked against
    P and S).

    Args:
        layout: contiguous | zigzag | double_zigzag | balanced | documents, a user's balancer as
            `module.function`, or a Layout made earlier.
        world_size, seq_len: P and S.
        variant: the attention variant; `balanced`, `documents` (its varlen form's documents)
            and a user's balancer need it.
        block_size: (q, kv) kernel block size the cost model prices (and a balancer is given).
        device: where the block mask is built (large S: CUDA, see kernels.make_block_mask).
        block_costs: `balanced`'s (full, partial) block time (BLOCK_COSTS; (1, 1) counts blocks).
        kernels: `balanced` prices ranks per pair kernel (see PairKernels), else by the blocks
            of one call per rank.

    A user's balancer is called with the keywords it names out of BALANCER_ARGUMENTS: variant,
    block_mask (the whole sequence's at `block_size`, None for a variant without a mask),
    seq_len, world_size, block_size ((q, kv) ints) and device (torch.device); it returns one
    list of (offset, length) pairs per rank, which must hold every position once and S/P on
    each rank. It is called once per (variant, P, S, path, block_size) in a process; the
    Layout is named by the path.

    Raises:
        ValueError: a bad name, P or S; ConfigError (a ValueError, "layout: <path> ...") for a
            balancer that cannot be imported or called, or whose placement is wrong.
    """
    if isinstance(layout, Layout):
        if (layout.world_size, layout.seq_len) != (world_size, seq_len):
            raise ValueError(
                f"layout was planned for world_size={layout.world_size}, seq_len="
                f"{layout.seq_len}; this call has world_size={world_size}, seq_len={seq_len}"
            )
        return layout
    _check(layout, world_size)
    block_size = (int(block_size[0]), int(block_size[1]))
    if layout == "balanced":
        return _balanced(world_size, seq_len, variant, block_size, device, block_costs, kernels)
    if layout == "documents":
        return _remembered(
            variant, (layout, world_size, seq_len), lambda: _documents(world_size, seq_len, variant)
        )
    if is_user_layout(layout):
        check_seq_len(seq_len, world_size, layout)
        _needs_variant(layout, variant)
        return _remembered(
            variant,
            (layout, world_size, seq_len, block_size),
            lambda: _user_placement(layout, world_size, seq_len, variant, block_size, device),
        )
    return _fixed(layout, world_size, seq_len)


def resolve(
    layout,
    world_size: int,
    seq_len: int,
    variant,
    device,
    kernels: PairKernels | None = None,
    block_size: Sequence[int] = (128, 128),
) -> Layout:
    """The Layout a context-parallel call uses: `plan`, memoised per variant for `balanced` (as
    a user's balancer always is), so a call given the name agrees with `shard(..., variant=)`,
    which prices by blocks; the run layer plans the ring's with `kernels` and hands that Layout
    to both. `block_size` is the kernels' (q, kv), which the cost model prices and a user's
    balancer is given."""
    if not (isinstance(layout, str) and layout == "balanced"):
        return plan(layout, world_size, seq_len, variant, block_size, device)
    _needs_variant(layout, variant)
    block_size = (int(block_size[0]), int(block_size[1]))
    return _remembered(
        variant,
        (layout, world_size, seq_len, block_size, kernels),
        lambda: plan(layout, world_size, seq_len, variant, block_size, device, kernels=kernels),
    )


def _remembered(variant, key: tuple, place: Callable[[], Layout]) -> Layout:
    memo = _PLACED.setdefault(variant, {})
    if key not in memo:
        memo[key] = place()
    return memo[key]


# Variant -> {(name or path, P, S, block size[, PairKernels or None]): Layout}: a balanced or a
# user's placement lives as long as its variant.
_PLACED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def chunks(
    rank: int, world_size: int, seq_len: int, layout: str | Layout, variant=None
) -> list[tuple[int, int]]:
    """The (global offset, length) chunks rank `rank` holds, in shard order.

    Args:
        rank: 0 <= rank < world_size.
        world_size: P.
        seq_len: S, the whole sequence.
        layout: contiguous | zigzag | double_zigzag | balanced or a balancer's path (with
            `variant`), or a Layout.

    Returns:
        One pair for contiguous, two for zigzag, four for double_zigzag; lengths sum to S/P.
    """
    placed_from_variant = layout == "balanced" or is_user_layout(layout)
    if isinstance(layout, str) and placed_from_variant and variant is not None:
        # The same memoised placement the CP call resolves; built on the GPU where there is one
        # (the whole sequence's block mask; the placement does not depend on the device).
        device = "cuda" if torch.cuda.is_available() else "cpu"
        return resolve(layout, world_size, seq_len, variant, device).chunks(rank)
    return plan(layout, world_size, seq_len, variant).chunks(rank)


def shard(
    x: torch.Tensor,
    rank: int,
    world_size: int,
    layout: str | Layout,
    dim: int = 2,
    *,
    variant=None,
) -> torch.Tensor:
    """This rank's shard of `x` along `dim` (a contiguous copy).

    Args:
        x: the whole tensor, e.g. q_BHSD with S at `dim`.
        rank, world_size: which shard of how many.
        layout: contiguous | zigzag | double_zigzag | balanced or a balancer's path (with
            `variant`), or a Layout.
        dim: the sequence dimension.

    Returns:
        (…, S/P, …): the rank's chunks concatenated in shard order.
    """
    parts = [
        x.narrow(dim, off, length)
        for off, length in chunks(rank, world_size, x.shape[dim], layout, variant)
    ]
    return torch.cat(parts, dim=dim).contiguous()


def unshard(
    shards: Sequence[torch.Tensor], layout: str | Layout, dim: int = 2, *, variant=None
) -> torch.Tensor:
    """Reassemble the whole tensor from every rank's shard (rank order), the inverse of `shard`.

    Args:
        shards: P tensors (…, S/P, …), shard r from rank r.
        layout: the layout they were cut with (a name or a balancer's path, with `variant`
            for balanced and a path, or a Layout).
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
        for off, length in chunks(rank, world_size, seq_len, layout, variant):
            placed.append((off, s.narrow(dim, start, length)))
            start += length
    return torch.cat([t for _, t in sorted(placed, key=lambda p: p[0])], dim=dim)


def load_imbalance(
    layout: str | Layout,
    variant,
    world_size: int,
    seq_len: int,
    block_size: Sequence[int] = (128, 128),
    device: torch.device | str = "cpu",
) -> float:
    """Block imbalance: max over mean of the non-empty (q block, kv block) pairs each rank's
    queries attend (a count, whatever the blocks cost; time_imbalance weighs them).

    `layout` is a name, a balancer's path or a Layout. Counted on the whole sequence's block mask
    at square blocks of `block_size[0]`, or of the largest size below it that divides every
    chunk boundary (small shapes); 1.0 is perfect balance.
    """
    placed = resolve(layout, world_size, seq_len, variant, device, block_size=block_size)
    bounds = (x for rank in placed.placement for chunk in rank for x in chunk)
    block = math.gcd(int(block_size[0]), *bounds)
    blocks = _TimeModel(variant, seq_len, (block, block), device, block_costs=(1.0, 1.0))
    return _max_over_mean(blocks.rank_times(placed.placement))


def time_imbalance(
    layout: str | Layout,
    variant,
    world_size: int,
    seq_len: int,
    block_size: Sequence[int] = (128, 128),
    device: torch.device | str = "cpu",
    kernels: PairKernels | None = None,
) -> float:
    """Predicted time imbalance: max over mean of each rank's predicted time under the cost
    model `balanced` places by (module docstring): BLOCK_COSTS by the blocks of one call per
    rank, or per pair kernel with `kernels`. `layout` is a name (balanced is planned with
    `kernels`), a balancer's path or a Layout; 1.0 is perfect balance.
    """
    return _max_over_mean(
        rank_times(layout, variant, world_size, seq_len, block_size, device, kernels)
    )


def rank_times(
    layout: str | Layout,
    variant,
    world_size: int,
    seq_len: int,
    block_size: Sequence[int] = (128, 128),
    device: torch.device | str = "cpu",
    kernels: PairKernels | None = None,
) -> list[float]:
    """Each rank's predicted time under the cost model `balanced` places by (time_imbalance's
    arguments), in full-block times."""
    block_size = (int(block_size[0]), int(block_size[1]))
    placed = resolve(layout, world_size, seq_len, variant, device, kernels, block_size)
    return _TimeModel(variant, seq_len, block_size, device, kernels).rank_times(placed.placement)


def _max_over_mean(loads: list[float]) -> float:
    return max(loads) / max(sum(loads) / len(loads), 1e-9)
