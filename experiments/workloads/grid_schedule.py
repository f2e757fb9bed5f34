"""flex's programs as a list schedule: why an all-gather rank's call is slower than its blocks.

Each rank's one call (its q shard against every key, as the all-gather runs it on a causal
document mask) is modelled as flex runs it: one program per (block row, head), taken in grid order
(rows fastest, then heads) by the first of `--sms` free SMs; a program costs its blocks at
layout.BLOCK_COSTS plus one block's fixed work; the backward's programs are the dq rows then the
dK/dV columns of every key block. The call's time is when its last program ends. Printed per
batch, next to what the all-gather measured on 12-06 where the batch is there
(allgather_batches_h100_1206.csv: its ranks' max over min):

    python experiments/workloads/grid_schedule.py [--batches 16] [--layout balanced]

    grid order       max over min of the ranks' times, and the slowest over the one-device
                     call's own schedule / P (the ideal)
    blocks           the same for the blocks spread evenly over the SMs (what the placement prices)
    each head sorted each head's rows costliest first (flex's grid keeps the heads in turn)
    folded           the heads folded into the rows, all of them costliest first (attngym's
                     topology.options.fold)

The workload is run.sh's (lognormal, median 2K, tail to 64K, 128K, P=8, H=8, blocks of 128).
Pure CPU, a few seconds a batch.
"""

from __future__ import annotations

import argparse
import csv
import heapq
import statistics
from pathlib import Path

from attngym.distributed.placement import grid, layout
from attngym.runner.config import workload_batches
from attngym.variants.spec import build_variant

SEQ_LEN, WORLD, HEADS, BLOCK = 131072, 8, 8, 128
WORKLOAD = {"name": "documents", "distribution": "lognormal", "seed": 0, "median": 2048,
            "sigma": 1.2, "max_len": 65536}  # fmt: skip
MEASURED = Path(__file__).with_name("allgather_batches_h100_1206.csv")
LAUNCH = 1.0  # a program's fixed work, in full-block times


def makespan(costs: list[float], sms: int) -> float:
    """When the last of `costs` ends, each taken in order by the first SM to be free."""
    free = [0.0] * sms
    end = 0.0
    for cost in costs:
        t = heapq.heappop(free) + cost
        end = max(end, t)
        heapq.heappush(free, t)
    return end


def call_times(rows: list[float], cols: list[float], sms: int) -> dict[str, float]:
    """fwd+bwd of one call whose block rows cost `rows` and key blocks `cols` (one head)."""
    fwd = [c + LAUNCH for _ in range(HEADS) for c in rows]
    bwd = [c + LAUNCH for _ in range(HEADS) for c in rows + cols]
    by_head = sorted(rows, reverse=True)
    folded = sorted(fwd, reverse=True)
    dkdv = [c + LAUNCH for _ in range(HEADS) for c in cols]
    return {
        "grid order": makespan(fwd, sms) + makespan(bwd, sms),
        "blocks": (sum(fwd) + sum(bwd)) / sms,
        "each head sorted": makespan([c + LAUNCH for _ in range(HEADS) for c in by_head], sms)
        + makespan([c + LAUNCH for _ in range(HEADS) for c in by_head + cols], sms),
        "folded": makespan(folded, sms) + makespan(folded + dkdv, sms),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=16)
    parser.add_argument("--layout", default="balanced", choices=["balanced", "documents"])
    parser.add_argument("--sms", type=int, default=132)
    args = parser.parse_args()
    measured = {}
    if MEASURED.exists():
        for row in csv.DictReader(MEASURED.open()):
            high, low = float(row["rank_compute_ms_max"]), float(row["rank_compute_ms_min"])
            measured[int(row["batch"])] = high / low
    data = {"workload": {**WORKLOAD, "batches": args.batches}, "shape": {"seq_len": SEQ_LEN}}
    full_cost, partial_cost = layout.BLOCK_COSTS
    for i, docs in enumerate(workload_batches(data)):
        variant = build_variant({"name": "document", "doc_lengths": list(docs)},
                                seq_len=SEQ_LEN, heads=HEADS)  # fmt: skip
        placed = layout.plan(args.layout, WORLD, SEQ_LEN, variant, (BLOCK, BLOCK), "cpu")
        partial, full = grid.block_grid(variant, SEQ_LEN, (BLOCK, BLOCK), "cpu")
        price = full.double() * full_cost + partial.double() * partial_cost
        ideal = call_times(price.sum(1).tolist(), price.sum(0).tolist(), args.sms)
        ranks = []
        for r in range(WORLD):
            blocks = placed.positions(r).view(-1, BLOCK)[:, 0] // BLOCK
            mine = price[blocks]
            ranks.append(call_times(mine.sum(1).tolist(), mine.sum(0).tolist(), args.sms))
        parts = []
        for how in ranks[0]:
            times = [t[how] for t in ranks]
            over = max(times) / (ideal["grid order"] / WORLD)
            parts.append(f"{how} {max(times) / min(times):.3f} ({over:.2f}x ideal)")
        known = i in measured and args.layout == "balanced"
        seen = f"; measured {measured[i]:.3f}" if known else ""
        print(f"batch {i} ({len(docs)} documents, longest {max(docs)}), max over min: "
              f"{', '.join(parts)}{seen}", flush=True)  # fmt: skip
    if measured and args.layout == "balanced":
        print(f"measured max over min, mean {statistics.fmean(measured.values()):.3f}")


if __name__ == "__main__":
    main()
