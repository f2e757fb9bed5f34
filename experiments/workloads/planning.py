"""The balanced placement's planning per batch of the workload, on this machine: the time
`layout.plan` takes for the all-gather's pricing (one call per rank) and the ring's (one kernel
per shard pair, the swap search), as a CP run's `planning_ms` counts it.

    python experiments/workloads/planning.py [--batches 4] [--device cpu]

The workload is run.sh's: lognormal documents (median 2K, sigma 1.2, tail to 64K) packed into
128K, P=8, blocks of 128; the ring priced for 8 heads on an H100's 132 SMs.
"""

from __future__ import annotations

import argparse
import statistics
import time

from attngym.distributed.placement import layout
from attngym.runner.config import workload_batches
from attngym.variants.spec import build_variant

SEQ_LEN, WORLD, HEADS, SMS = 131072, 8, 8, 132
WORKLOAD = {"name": "documents", "distribution": "lognormal", "seed": 0, "median": 2048,
            "sigma": 1.2, "max_len": 65536}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    data = {"workload": {**WORKLOAD, "batches": args.batches}, "shape": {"seq_len": SEQ_LEN}}
    pricing = {
        "allgather": None,
        "ring": layout.PairKernels(HEADS, SMS, layout.STEP_LAUNCH, True),
    }
    ms: dict[str, list[float]] = {name: [] for name in pricing}
    for i, docs in enumerate(workload_batches(data)):
        for name, kernels in pricing.items():
            # a fresh variant a batch, as each batch of a run builds its own
            variant = build_variant({"name": "document", "doc_lengths": list(docs)},
                                    seq_len=SEQ_LEN, heads=HEADS)  # fmt: skip
            start = time.perf_counter()
            layout.plan("balanced", WORLD, SEQ_LEN, variant, (128, 128), args.device,
                        kernels=kernels)  # fmt: skip
            ms[name].append(1e3 * (time.perf_counter() - start))
            print(f"batch {i} ({len(docs)} documents, longest {max(docs)}): {name} "
                  f"{ms[name][-1]:.1f} ms")  # fmt: skip
    for name, times in ms.items():
        print(f"{name}: planning mean {statistics.fmean(times):.1f} ms, most {max(times):.1f} ms")


if __name__ == "__main__":
    main()
