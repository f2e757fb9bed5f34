"""layout=documents: packed documents placed whole on the ranks, from their lengths alone.

A balanced placement (layout.py) spreads every document's expensive tail over the ranks, so
each rank reads keys of every other rank's shard: on batches of many short documents a ring then
moves every shard whole, where a rank's own documents would need nothing moved. The systems
built for packed documents (WLB-LLM, FlexSP, ByteScale, Megatron's dynamic CP) place whole
documents instead and split only the long ones. So does this layout:

    * The sequence is cut at its documents' starts, rounded to whole units (unit_rows: a kernel
      block of 128 rows at most), into items; an item's price is its block rows' blocks, full
      and partial, as one call against every key computes them (block_prices, from the
      variant's varlen form: documents, and a window inside each).
    * An item priced above a rank's share (the whole price over P), or longer than a shard, is
      split over k ranks (k its price over the share, at least its rows over a shard's): cut
      into 2k chunks of whole units, rank j holding chunks j and 2k-1-j (head and tail, as
      PyTorch's per-document head-tail balancer does; under a causal mask each pair costs the
      same), on the k least loaded ranks with room for them.
    * The other items go whole, most expensive first, to the least loaded rank with room, where
      that keeps its price within SLACK of the share; else the item's first rows fill that rank
      to it, and the rest goes on to the next least loaded rank.

Every rank holds S/P rows; a rank's chunks are in position order. Planning is a pass over the
documents (no block mask is built): about 1 ms a batch of 128K on a 2-core CPU box, where the
ring's balanced placement takes 0.7 s (experiments/workloads/planning.py).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence

import torch

# The rows placed together, at most (unit_rows): a kernel block.
UNIT = 128
# How far above its share (the whole price over P) a rank's price may go before an item is split
# to fill it (each split moves the part before it to the rank holding the rest).
SLACK = 0.1


def block_prices(
    documents: Sequence[int], unit: int, left: int, right: int, costs: tuple[float, float]
) -> list[float]:
    """The price of the rows before each unit boundary (units + 1 values, from 0): each block
    row of `unit` rows priced as one call against every key prices it, its full and partial
    blocks at `costs` (layout.BLOCK_COSTS: the kernel computes a partial block whole, so a
    short document costs more than the keys it reads), a row j of a document reading its keys
    [j - left, j + right] (-1: no bound; the Varlen form's window). In closed form for the
    block rows inside one document, counted for the few that straddle two, so that planning
    builds no block mask."""

    def floor(x: torch.Tensor) -> torch.Tensor:
        return x.div(unit, rounding_mode="floor")

    starts = list(itertools.accumulate(documents, initial=0))
    at = torch.tensor(starts)
    first = torch.arange(sum(documents) // unit) * unit  # each block row's first row
    doc = torch.searchsorted(at, first, right=True) - 1
    s, t = at[doc], at[doc + 1]  # its first row's document
    lo = s if left < 0 else torch.maximum(s, first - left)  # the keys its rows read
    hi = t if right < 0 else torch.minimum(t, first + unit + right)
    touched = floor(hi - 1) - floor(lo) + 1
    # the whole blocks of its document that every row of it reads
    full_lo = -floor(-s)
    if left >= 0:  # from the first key its last row reads
        full_lo = torch.maximum(full_lo, -floor(left + 1 - first - unit))
    full_hi = floor(t) - 1
    if right >= 0:  # to the last key its first row reads
        full_hi = torch.minimum(full_hi, floor(first + right + 1) - 1)
    full = (full_hi - full_lo + 1).clamp(min=0)
    cheap, costly = costs
    price = full.double() * cheap + (touched - full).double() * costly
    for u in torch.nonzero(t < first + unit).flatten().tolist():  # block rows of two documents
        a, seen = u * unit, set()
        for d in range(bisect.bisect_right(starts, a) - 1, len(documents)):
            if starts[d] >= a + unit:
                break
            rows = (max(a, starts[d]), min(a + unit, starts[d + 1]))  # its rows in the block row
            since = starts[d] if left < 0 else max(starts[d], rows[0] - left)  # its keys
            until = starts[d + 1] if right < 0 else min(starts[d + 1], rows[1] + right)
            seen.update(range(since // unit, (until - 1) // unit + 1))
        price[u] = len(seen) * costly  # none whole: rows of two documents read different keys
    return torch.cat([price.new_zeros(1), price.cumsum(0)]).tolist()


def unit_rows(seq_len: int, world_size: int) -> int:
    """The rows placed together: a kernel block's 128 where a shard holds at least 8 of them,
    else the largest power of two that does (and divides the shard). Not the run's block size,
    so that every call placing the same documents agrees (shard, unshard, the CP call)."""
    shard, unit = seq_len // world_size, UNIT
    while unit > 1 and (shard % unit or shard < 8 * unit):
        unit //= 2
    return unit


def place(
    documents: Sequence[int],
    world_size: int,
    left: int,
    right: int,
    costs: tuple[float, float],
) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Each rank's (offset, length) chunks, in position order (module docstring); `left` and
    `right` are the window inside each document (the Varlen form's, -1: no bound); `costs` a
    full and a partial block's time (layout.BLOCK_COSTS).

    Raises:
        ValueError: where S does not split into P shards.
    """
    seq_len, P = sum(documents), world_size
    if seq_len % P:
        raise ValueError(f"seq_len={seq_len} must be divisible by world_size={P}")
    unit = unit_rows(seq_len, P)
    units, shard = seq_len // unit, seq_len // (P * unit)  # in units
    starts = list(itertools.accumulate(documents, initial=0))
    before = block_prices(documents, unit, left, right, costs)
    cuts = sorted({min(units, round(s / unit)) for s in starts} | {0, units})
    items = [(a, b) for a, b in zip(cuts, cuts[1:], strict=False) if b > a]

    def price(a: int, b: int) -> float:  # of units [a, b)
        return before[b] - before[a]

    share = price(0, units) / P
    load, room = [0.0] * P, [shard] * P
    held: list[list[tuple[int, int]]] = [[] for _ in range(P)]

    def give(r: int, a: int, b: int) -> None:
        held[r].append((a, b))
        load[r] += price(a, b)
        room[r] -= b - a

    rest = []
    for a, b in sorted(items, key=lambda item: -price(*item)):
        n = b - a
        # (an item of exactly the share stays whole)
        k = min(P, n // 2, max(math.ceil(price(a, b) / share - 1e-9), -(-n // shard)))
        if k < 2:
            rest.append((a, b))
            continue
        edges = [a + (n * i) // (2 * k) for i in range(2 * k + 1)]
        pairs = [(j, 2 * k - 1 - j) for j in range(k)]
        sizes = [edges[i + 1] - edges[i] + edges[o + 1] - edges[o] for i, o in pairs]
        ranks = sorted((r for r in range(P) if room[r] >= max(sizes)), key=load.__getitem__)
        if len(ranks) < k:  # no k ranks with room for a pair: filled in order, below
            rest.append((a, b))
            continue
        # a pair to each of the k least loaded ranks, the middle pair (which reads the fewest
        # rows of the others: 40.7K against 42.6K a batch with pair 0 first, planning.py) first
        for r, (i, o) in zip(ranks, pairs[::-1], strict=False):
            give(r, edges[i], edges[i + 1])
            give(r, edges[o], edges[o + 1])
    cap = share * (1 + SLACK)
    for a, b in sorted(rest, key=lambda item: -price(*item)):
        while a < b:  # whole where it fits, else the part that fills the least loaded rank
            r = min((x for x in range(P) if room[x]), key=load.__getitem__)
            take = min(room[r], b - a)
            if load[r] + price(a, a + take) > cap:
                # the most units from a that keep the rank within cap (at least one)
                fits = range(1, take + 1)
                take = max(bisect.bisect_right(fits, cap - load[r], key=lambda m: price(a, a + m)),
                           1)  # fmt: skip
            give(r, a, a + take)
            a += take
    assert not any(room), room  # every unit placed: P shards of S/P rows
    return tuple(tuple(sorted((a * unit, (b - a) * unit) for a, b in chunks)) for chunks in held)
