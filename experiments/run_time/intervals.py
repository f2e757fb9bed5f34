"""The seconds a default run spends on its speed ratios' 95 % intervals (bench.ratio_ci95):
six contenders and flex, three passes, 1,000 timed calls a side (a budget's most for a small
kernel); each contender's interval against flex, and the three best contenders' headline ones.

    python experiments/run_time/intervals.py [--runs 2]
"""

from __future__ import annotations

import argparse
import random
import time

from attngym import bench

CALLS, CONTENDERS, PASSES, HEADLINES = 1000, 6, 3, 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    for run in range(args.runs):
        rng = random.Random(run)
        if hasattr(bench, "_resampled_medians"):  # as a fresh process (an older bench.py
            bench._resampled_medians.cache_clear()  # keeps nothing)
        start = time.perf_counter()
        for _ in range(PASSES):
            flex = [1 + rng.random() for _ in range(CALLS)]
            others = [[1 + rng.random() for _ in range(CALLS)] for _ in range(CONTENDERS)]
            for other in others + others[:HEADLINES]:
                bench.ratio_ci95(other, flex)
        print(f"run {run}: {PASSES * (CONTENDERS + HEADLINES)} intervals in "
              f"{time.perf_counter() - start:.2f} s")  # fmt: skip


if __name__ == "__main__":
    main()
