"""Plots for the two-GPU context-parallel study, read from the files next to this one.

    python experiments/multi_gpu_cp/plot.py

Writes transfer_bandwidth.png (copy engine against NCCL, 1 MiB to 1 GiB per rank) and
cp_efficiency.png (efficiency against one GPU, forward and forward + backward, per sequence
length, kind, layout and transport).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
TRANSPORT_STYLE = {"copy_engine": {"color": "tab:blue"}, "nccl": {"color": "tab:orange"}}
PATTERN_LABEL = {
    "allgather": "all-gather (CopyEngineAllGather vs all_gather_into_tensor)",
    "channel": "ring step (CopyEngineChannel vs batch_isend_irecv)",
}


def plot_bandwidth(path: Path) -> None:
    data = json.loads((HERE / "transfer_bandwidth.json").read_text())
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, pattern in zip(axes, PATTERN_LABEL, strict=True):
        for transport, style in TRANSPORT_STYLE.items():
            rows = [
                r for r in data["rows"] if (r["pattern"], r["transport"]) == (pattern, transport)
            ]
            rows.sort(key=lambda r: r["bytes_per_rank"])
            ax.plot(
                [r["bytes_per_rank"] / 2**20 for r in rows],
                [r["busbw_GBps"] for r in rows],
                marker="o",
                label=transport.replace("_", " "),
                **style,
            )
        ax.set_xscale("log", base=2)
        sizes = sorted({r["bytes_per_rank"] // 2**20 for r in data["rows"]})
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.minorticks_off()
        ax.set_xlabel("bytes per rank (MiB)")
        ax.set_title(PATTERN_LABEL[pattern], fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("bus bandwidth (GB/s received per rank)")
    axes[0].legend()
    fig.suptitle(f"{data['world_size']} x {data['gpu']}, torch {data['torch']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_efficiency(path: Path) -> None:
    with open(HERE / "cp_efficiency.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["status"] == "ok"]
    series = sorted({(r["topology"], r["layout"], r["transport"]) for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, (key, title) in zip(
        axes, [("efficiency", "forward"), ("efficiency_fwd_bwd", "forward + backward")], strict=True
    ):
        for topology, layout, transport in series:
            points = sorted(
                (int(r["seq_len"]), float(r[key]))
                for r in rows
                if (r["topology"], r["layout"], r["transport"]) == (topology, layout, transport)
            )
            ax.plot(
                [s // 1024 for s, _ in points],
                [e for _, e in points],
                marker="o" if topology == "ring" else "s",
                linestyle="-" if layout == "zigzag" else ":",
                label=f"{topology} {layout} {transport.replace('_', ' ')}",
                **TRANSPORT_STYLE[transport],
            )
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        lengths = sorted({int(r["seq_len"]) // 1024 for r in rows})
        ax.set_xticks(lengths, [f"{k}K" for k in lengths])
        ax.minorticks_off()
        ax.set_xlabel("sequence length (both GPUs together)")
        ax.set_title(f"causal, {title}", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("efficiency = (one-GPU time / 2) / CP time")
    axes[0].legend(fontsize=8)
    fig.suptitle("context parallelism on 2 x H200, B=1 H=8 D=128 bf16", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    plot_bandwidth(HERE / "transfer_bandwidth.png")
    plot_efficiency(HERE / "cp_efficiency.png")


if __name__ == "__main__":
    main()
