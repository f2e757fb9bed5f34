"""The scaling picture of a simulated sweep: predicted time and efficiency against world size.

Reads SWEEP/summary.csv (a sweep of topology.simulate=true jobs, e.g. +experiment=cp_scaling)
and draws scaling.png beside it: per (topology, layout, variant, seq_len) line, the predicted
fwd+bwd ms (forward where the jobs ran no backward) and the predicted efficiency over
topology.world_size, each point marked by its bottleneck.

    python scripts/plot_cp_scaling.py multirun/scaling
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

MARKERS = {"compute": "o", "transfer": "s", "imbalance": "^"}


def _float(value: str | None) -> float | None:
    try:
        return float(value) if value not in (None, "") else None
    except ValueError:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep", type=Path)
    args = parser.parse_args(argv)
    summary = args.sweep / "summary.csv"
    with summary.open(newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("status") == "ok" and r.get("simulate")]
    if not rows:
        print(f"no simulated jobs in {summary}", file=sys.stderr)
        return 1
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines: dict[tuple, list[tuple[int, float, float | None, str]]] = {}
    for r in rows:
        ms = _float(r.get("predicted_fwd_bwd_ms")) or _float(r.get("predicted_fwd_ms"))
        eff = _float(r.get("predicted_efficiency_fwd_bwd")) or _float(r.get("predicted_efficiency"))
        key = (r["topology"], r["layout"], r["variant"], r["seq_len"], r.get("fabric", ""))
        lines.setdefault(key, []).append((int(r["world_size"]), ms, eff, r.get("bottleneck", "")))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for key, points in sorted(lines.items()):
        points.sort()
        label = f"{key[0]} {key[1]}, {key[2]} {int(key[3]) // 1024}K, {key[4]}"
        xs = [p[0] for p in points]
        (line,) = left.plot(xs, [p[1] for p in points], label=label)
        right.plot(xs, [p[2] for p in points], color=line.get_color())
        for x, ms, eff, neck in points:
            marker = MARKERS.get(neck, "x")
            left.plot([x], [ms], marker, color=line.get_color())
            if eff is not None:
                right.plot([x], [eff], marker, color=line.get_color())
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("ranks (simulated)")
    left.set_yscale("log")
    left.set_ylabel("predicted ms (fwd+bwd)")
    right.set_ylabel("predicted efficiency")
    right.axhline(1.0, color="grey", lw=0.5)
    left.legend(fontsize=7)
    right.set_title("o compute, s transfer, ^ imbalance", fontsize=8)
    fig.tight_layout()
    out = args.sweep / "scaling.png"
    fig.savefig(out, dpi=120)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
