"""How a sequence is spread over ranks: which global positions each rank's shard holds.

Layouts (S tokens, P ranks, sharded along `dim`, the sequence dim 2 of (B, H, S, D)):

    contiguous  rank r holds positions [r·S/P, (r+1)·S/P): one chunk per rank.
    zigzag      S is cut into 2P equal chunks; rank r holds chunk r, then chunk 2P-1-r. Under a
                causal mask every rank then does the same amount of work (the early chunk is cheap,
                the late one expensive).
    balanced    placed from the variant's block mask: S is cut into n = 2P·m equal pieces
                (m = 1, 2 or 4, whichever gives the fastest slowest rank), each piece costs the
                predicted time of its query rows (BLOCK_COSTS: a full block, and a partial one,
                which evaluates the mask per entry, in units of a full block's time), and a
                greedy placement (largest piece first, to the least loaded rank that still has
                room) gives every rank n/P pieces of about equal time. Pieces adjacent on a rank
                merge into one chunk. For causal it finds zigzag; for packed documents it spreads
                each document's expensive tail (the designs PyTorch's per-document head-tail and
                PTRR load balancers follow; those count blocks, this weighs them by what they
                cost). With `PairKernels` (the ring: one kernel per chunk pair) a piece is
                priced by the kernels it takes part in, each as long as the slower of its blocks
                spread over the device and its longest block row or column.

A rank's shard is the concatenation of its chunks in that order; `chunks` gives them as
(global offset, length) pairs, which is what the context-parallel kernels pass as q/kv offsets.
A `Layout` (from `plan`) holds every rank's chunks; contiguous and zigzag need only (P, S), a
balanced one needs the variant, so shard/unshard/chunks take either a name with the variant or a
precomputed Layout. `load_imbalance` is max over mean of the non-empty blocks per rank.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Sequence

import torch

LAYOUTS = ("contiguous", "zigzag", "balanced")

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


# A kernel launch and its fixed work (fwd+bwd), in full-block times of one program: about 20 us
# per chunk pair (two launches, the backward's preprocessing) against 9.6 us per full block and
# program (305.1 ms for 523776 blocks x 8 heads over 132 SMs, causal 128K in BLOCK_COSTS' source).
LAUNCH_COST = 2.0


@dataclasses.dataclass(frozen=True)
class PairKernels:
    """How `balanced` prices pieces for a scheme that runs one kernel per (q chunk, kv chunk)
    pair (the ring). Such a kernel runs one program per (batch, head, block row) over `slots`
    parallel units, so it takes the slower of its blocks spread over the units and its longest
    block row (its longest column, in the backward), plus a launch: a thin pair whose rows read
    whole documents costs more than its blocks say. Priced by blocks alone, a ring over packed
    documents was 1.43x imbalanced in time at a block imbalance of 1.02 (experiments/cp_model).

    Attributes:
        programs: programs per block row, batch x query heads.
        slots: programs the device runs at once (CUDA: its SM count).
        launch: a kernel's fixed cost, in full-block times (LAUNCH_COST).
    """

    programs: int
    slots: int
    launch: float = LAUNCH_COST

    def __post_init__(self):
        for name in ("programs", "slots"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PairKernels.{name} must be a positive integer, got {value!r}")
        if not self.launch >= 0:
            raise ValueError(f"PairKernels.launch must be >= 0, got {self.launch!r}")


def pair_kernels(batch_heads: int, device: torch.device | str) -> PairKernels | None:
    """The pair-kernel pricing on `device`: its SM count on CUDA; None elsewhere (a CPU kernel
    has no waves to speak of, and blocks price it)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return PairKernels(batch_heads, torch.cuda.get_device_properties(device).multi_processor_count)


def _check(layout: str, world_size: int) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}; got {layout!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")


def pieces(layout: str, world_size: int) -> int:
    """How many equal pieces S is at least cut into: P (contiguous) or 2P (zigzag, balanced)."""
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
    if layout == "contiguous":
        placement = [((r * size, size),) for r in range(world_size)]
    else:
        placement = [((r * size, size), ((n - 1 - r) * size, size)) for r in range(world_size)]
    return Layout(layout, world_size, seq_len, tuple(placement))


def row_block_costs(
    variant, seq_len: int, block: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """(S/block,) non-empty (block x block) key blocks of each query block row of the variant."""
    from attngym import kernels

    block_mask = kernels.make_block_mask(
        variant, seq_len, seq_len, block_size=(block, block), device=device
    )
    if block_mask is None:  # no mask: every block is kept
        return torch.full((seq_len // block,), seq_len // block, dtype=torch.long)
    dense = block_mask.to_dense()  # (1, 1, S/block, S/block)
    return dense[0, 0].ne(0).sum(-1).cpu()


def row_time_costs(
    variant,
    seq_len: int,
    block: int,
    device: torch.device | str = "cpu",
    block_costs: tuple[float, float] = BLOCK_COSTS,
) -> torch.Tensor:
    """(S/block,) float64: each query block row's predicted time, full blocks at block_costs[0]
    and partial ones at block_costs[1] (a block mask without full blocks counts every kept block
    as partial)."""
    from attngym import kernels

    full_cost, partial_cost = block_costs
    block_mask = kernels.make_block_mask(
        variant, seq_len, seq_len, block_size=(block, block), device=device
    )
    if block_mask is None:  # no mask: every block is kept, and full
        return torch.full((seq_len // block,), full_cost * (seq_len // block), dtype=torch.float64)
    partial = block_mask.kv_num_blocks[0, 0].to("cpu", torch.float64)
    full = block_mask.full_kv_num_blocks
    full = torch.zeros_like(partial) if full is None else full[0, 0].to("cpu", torch.float64)
    return full * full_cost + partial * partial_cost


def piece_pair_costs(
    variant,
    seq_len: int,
    n: int,
    block: int,
    kernels: PairKernels,
    device: torch.device | str = "cpu",
    block_costs: tuple[float, float] = BLOCK_COSTS,
) -> torch.Tensor:
    """(n,) float64: each of n equal pieces' predicted time as the queries of pair kernels
    against every piece (PairKernels), from the variant's block mask at (block x block)."""
    from attngym import kernels as kernel_lib

    R = seq_len // block
    per = R // n
    block_mask = kernel_lib.make_block_mask(
        variant, seq_len, seq_len, block_size=(block, block), device=device
    )
    if block_mask is None:  # no mask: every block is kept, and full
        rows = torch.full((R, n), block_costs[0] * per, dtype=torch.float64)
        cols = rows
    else:
        rows = _per_piece(block_mask.kv_num_blocks, block_mask.kv_indices,
                          block_mask.full_kv_num_blocks, block_mask.full_kv_indices,
                          per, n, block_costs)  # fmt: skip
        cols = _per_piece(block_mask.q_num_blocks, block_mask.q_indices,
                          block_mask.full_q_num_blocks, block_mask.full_q_indices,
                          per, n, block_costs)  # fmt: skip
    rows = rows.view(n, per, n)  # [q piece, its row, kv piece]
    cols = cols.view(n, per, n).transpose(0, 2)  # [q piece, kv piece's column, kv piece]
    total = rows.sum(1)
    longest = torch.maximum(rows.amax(1), cols.amax(1))
    price = torch.maximum(total * kernels.programs / kernels.slots, longest)
    return (price + kernels.launch * (total > 0)).sum(1)


def _per_piece(num, idx, full_num, full_idx, per: int, n: int, block_costs) -> torch.Tensor:
    """(rows, n) float64: each block row's kept blocks in each piece, priced at block_costs.
    Counted in integers (exact, so every rank plans the same placement), priced on the CPU."""
    out = torch.zeros(num.shape[-1], n, dtype=torch.float64)
    for count, index, cost in ((num, idx, block_costs[1]), (full_num, full_idx, block_costs[0])):
        if count is None:
            continue
        count, index = count[0, 0], index[0, 0].long()
        kept = torch.arange(index.shape[-1], device=index.device) < count.unsqueeze(-1)
        blocks = torch.zeros(count.shape[-1], n, dtype=torch.long, device=index.device)
        blocks.scatter_add_(1, index // per, kept.long())
        out += blocks.cpu().to(torch.float64) * cost
    return out


def _greedy(costs: list[float], world_size: int) -> list[list[int]]:
    """Pieces per rank: largest first, to the least loaded rank with room (ties: lower index)."""
    per_rank = len(costs) // world_size
    load = [0] * world_size
    owned: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min((r for r in range(world_size) if len(owned[r]) < per_rank), key=lambda r: load[r])
        owned[r].append(i)
        load[r] += costs[i]
    return [sorted(o) for o in owned]


def _merged(indices: list[int], size: int) -> tuple[tuple[int, int], ...]:
    """(offset, length) chunks of the pieces `indices` (sorted), adjacent pieces merged."""
    out: list[list[int]] = []
    for i in indices:
        if out and out[-1][0] + out[-1][1] == i * size:
            out[-1][1] += size
        else:
            out.append([i * size, size])
    return tuple((o, n) for o, n in out)


def _balanced(
    world_size: int,
    seq_len: int,
    variant,
    block_size: Sequence[int],
    device,
    block_costs: tuple[float, float] = BLOCK_COSTS,
    kernels: PairKernels | None = None,
) -> Layout:
    if variant is None:
        raise ValueError(
            "layout='balanced' is placed from the variant's block mask: pass variant= (or a "
            "Layout from attngym.distributed.layout.plan)"
        )
    check_seq_len(seq_len, world_size, "balanced")
    best = None
    for m in BALANCE_SPLITS:
        n = 2 * world_size * m
        if seq_len % n:
            break
        size = seq_len // n
        block = min(int(block_size[0]), size)
        if size % block:
            block = size
        if kernels is None:
            rows = row_time_costs(variant, seq_len, block, device, block_costs)
            rows = rows.view(n, size // block).sum(-1)
        else:
            rows = piece_pair_costs(variant, seq_len, n, block, kernels, device, block_costs)
        owned = _greedy(rows.tolist(), world_size)
        loads = [sum(rows[i].item() for i in o) for o in owned]
        # The slowest rank sets the call's time. Priced by blocks the total is the same for
        # every m; priced per pair kernel more pieces cost more launches and waves.
        if best is None or max(loads) < best[0] * (1 - 1e-9):
            best = (max(loads), tuple(_merged(o, size) for o in owned))
        if max(loads) <= GOOD_ENOUGH * sum(loads) / world_size:
            break
    return Layout("balanced", world_size, seq_len, best[1])


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
    """Every rank's chunks for `layout` (a name, or a Layout checked against P and S).

    Args:
        layout: contiguous | zigzag | balanced, or a Layout made earlier.
        world_size, seq_len: P and S.
        variant: the attention variant; `balanced` needs it (its block mask decides).
        block_size: (q, kv) block size whose non-empty blocks `balanced` evens out.
        device: where `balanced` builds the block mask (large S: CUDA, see kernels.make_block_mask).
        block_costs: `balanced`'s (full, partial) block time (BLOCK_COSTS; (1, 1) counts blocks).
        kernels: `balanced` prices pieces per pair kernel (the ring's; see PairKernels), else
            by the blocks of one call per rank.
    """
    if isinstance(layout, Layout):
        if (layout.world_size, layout.seq_len) != (world_size, seq_len):
            raise ValueError(
                f"layout was planned for world_size={layout.world_size}, seq_len="
                f"{layout.seq_len}; this call has world_size={world_size}, seq_len={seq_len}"
            )
        return layout
    _check(layout, world_size)
    if layout == "balanced":
        return _balanced(world_size, seq_len, variant, block_size, device, block_costs, kernels)
    return _fixed(layout, world_size, seq_len)


def resolve(
    layout, world_size: int, seq_len: int, variant, device, kernels: PairKernels | None = None
) -> Layout:
    """The Layout a context-parallel call uses: `plan` with its defaults, memoised per variant
    for `balanced` (so a call given the name agrees with `shard(..., variant=)`, which prices by
    blocks; the run layer plans the ring's with `kernels` and hands that Layout to both; pass a
    Layout to plan with other block sizes)."""
    if not isinstance(layout, str) or layout != "balanced":
        return plan(layout, world_size, seq_len)
    key = (world_size, seq_len, kernels)
    memo = _BALANCED.setdefault(variant, {})
    if key not in memo:
        memo[key] = plan(layout, world_size, seq_len, variant, device=device, kernels=kernels)
    return memo[key]


# Variant -> {(P, S, PairKernels or None): Layout}: a balanced placement lives as long as its
# variant.
_BALANCED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def chunks(
    rank: int, world_size: int, seq_len: int, layout: str | Layout, variant=None
) -> list[tuple[int, int]]:
    """The (global offset, length) chunks rank `rank` holds, in shard order.

    Args:
        rank: 0 <= rank < world_size.
        world_size: P.
        seq_len: S, the whole sequence.
        layout: contiguous | zigzag | balanced (with `variant`), or a Layout.

    Returns:
        One pair for contiguous, two for zigzag; lengths sum to S/P.
    """
    if isinstance(layout, str) and layout == "balanced" and variant is not None:
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
        layout: contiguous | zigzag | balanced (with `variant`), or a Layout.
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
        layout: the layout they were cut with (a name, with `variant` for balanced, or a Layout).
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
    """max over mean of the non-empty (q block, kv block) pairs each rank's queries attend.

    Counted on the whole sequence's block mask at square blocks of `block_size[0]`, or of the
    largest size below it that divides every chunk boundary (small shapes); 1.0 is perfect
    balance.
    """
    placement = plan(layout, world_size, seq_len, variant, block_size, device)
    block = math.gcd(int(block_size[0]), *(x for c in placement.placement for o, n in c
                                            for x in (o, n)))  # fmt: skip
    rows = row_block_costs(variant, seq_len, block, device)
    loads = [
        sum(int(rows[o // block : (o + n) // block].sum()) for o, n in placement.chunks(r))
        for r in range(world_size)
    ]
    return max(loads) / max(sum(loads) / world_size, 1e-9)
