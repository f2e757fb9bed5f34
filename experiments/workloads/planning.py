"""The placements of the workload's batches, on this machine: the time `layout.plan` takes (as a
CP run's `planning_ms` counts it), and what each placement asks of the ranks: the rows of other
ranks' shards the busiest rank reads (what an exchange or a ring must bring it) and the ranks'
predicted time imbalance under the ring's cost model (one kernel per shard pair).

    python experiments/workloads/planning.py [--batches 4] [--device cpu]
        [--layouts balanced_allgather balanced_ring documents]

balanced_allgather is `balanced` priced for one call per rank, balanced_ring the same priced
per ring step (the swap search); documents places whole documents from their lengths. The
workload is run.sh's: lognormal documents (median 2K, sigma 1.2, tail to 64K) packed into 128K,
P=8, blocks of 128; the ring priced for 8 heads on an H100's 132 SMs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from attngym.distributed.placement import layout
from attngym.runner.config import workload_batches
from attngym.variants.spec import build_variant

SEQ_LEN, WORLD, HEADS, SMS = 131072, 8, 8, 132
WORKLOAD = {"name": "documents", "distribution": "lognormal", "seed": 0, "median": 2048,
            "sigma": 1.2, "max_len": 65536}  # fmt: skip
RING = layout.PairKernels(HEADS, SMS, layout.STEP_LAUNCH, True)
PLANS = {
    "balanced_allgather": ("balanced", None),
    "balanced_ring": ("balanced", RING),
    "documents": ("documents", None),
}


def rows_read(docs: list[int], placed: layout.Layout) -> int:
    """The rows of other ranks' shards the busiest rank's queries read (causal documents)."""
    doc = torch.repeat_interleave(torch.arange(len(docs)), torch.tensor(docs))
    owner = torch.empty(SEQ_LEN, dtype=torch.long)
    for r in range(WORLD):
        owner[placed.positions(r)] = r
    most, positions = 0, torch.arange(SEQ_LEN)
    for r in range(WORLD):
        mine = placed.positions(r)
        last = torch.full((len(docs),), -1).scatter_reduce(0, doc[mine], mine, reduce="amax")
        most = max(most, int(((last[doc] >= positions) & (owner != r)).sum()))
    return most


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layouts", nargs="+", default=list(PLANS), choices=list(PLANS))
    args = parser.parse_args()
    data = {"workload": {**WORKLOAD, "batches": args.batches}, "shape": {"seq_len": SEQ_LEN}}
    ms: dict[str, list[float]] = {name: [] for name in args.layouts}
    for i, docs in enumerate(workload_batches(data)):
        for name in args.layouts:
            how, kernels = PLANS[name]
            # a fresh variant a batch, as each batch of a run builds its own
            variant = build_variant({"name": "document", "doc_lengths": list(docs)},
                                    seq_len=SEQ_LEN, heads=HEADS)  # fmt: skip
            start = time.perf_counter()
            placed = layout.plan(how, WORLD, SEQ_LEN, variant, (128, 128), args.device,
                                 kernels=kernels)  # fmt: skip
            ms[name].append(1e3 * (time.perf_counter() - start))
            imbalance = layout.time_imbalance(placed, variant, WORLD, SEQ_LEN, kernels=RING)
            print(f"batch {i} ({len(docs)} documents, longest {max(docs)}): {name} "
                  f"{ms[name][-1]:.1f} ms, busiest rank reads {rows_read(list(docs), placed)} "
                  f"rows of others, ring-model imbalance {imbalance:.3f}")  # fmt: skip
    for name, times in ms.items():
        print(f"{name}: planning mean {statistics.fmean(times):.1f} ms, most {max(times):.1f} ms")


if __name__ == "__main__":
    main()
