"""The workload runs side by side, from their batches.csv: each scheme's fwd+bwd efficiency (mean,
p95 of the batches, and the least), planning as a share of the batch's step, and PyTorch's CP with
its best balancer on the same batches (predicted beside the ring).

    python experiments/workloads/compare.py DIR    (DIR holds workload_<scheme>/batches.csv)
"""

import csv
import statistics
import sys
from pathlib import Path


def rows(path: Path) -> dict[int, dict[str, str]]:
    with path.open(newline="") as f:
        return {int(r["batch"]): r for r in csv.DictReader(f)}


def number(row: dict[str, str], key: str) -> float | None:
    text = row.get(key) or ""
    return float(text) if text else None


def p95(values: list[float]) -> float:
    """The efficiency that 95 % of the batches reach or beat (the low tail)."""
    if len(values) < 2:
        return values[0]
    return statistics.quantiles(values, n=20, method="inclusive")[0]


def main(folder: Path) -> None:
    runs = {p.parent.name.removeprefix("workload_"): rows(p)
            for p in sorted(folder.glob("workload_*/batches.csv"))}  # fmt: skip
    torch_cp = {b: number(r, "predicted_torch_cp_fwd_bwd_ms")
                for r in runs.get("ring", {}).values() for b in [int(r["batch"])]}  # fmt: skip
    print("| scheme | batches | efficiency fwd+bwd mean | p95 (low tail) | least "
          "| planning / step max | torch_cp best / scheme, least |")  # fmt: skip
    print("|---|--:|--:|--:|--:|--:|--:|")
    for scheme, batches in runs.items():
        eff = [e for r in batches.values()
               if (e := number(r, "predicted_efficiency_fwd_bwd")) is not None]  # fmt: skip
        share = [number(r, "planning_ms") / number(r, "predicted_fwd_bwd_ms")
                 for r in batches.values() if number(r, "planning_ms") is not None]  # fmt: skip
        over = [torch_cp[b] / number(r, "predicted_fwd_bwd_ms") for b, r in batches.items()
                if torch_cp.get(b) is not None]  # fmt: skip
        effs = "n/a | n/a | n/a"
        if eff:
            effs = f"{statistics.mean(eff):.3f} | {p95(eff):.3f} | {min(eff):.3f}"
        versus = f"{min(over):.2f}x over {len(over)}" if over else "n/a"
        print(f"| {scheme} | {len(batches)} | {effs} | {max(share):.1%} | {versus} |")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
