"""Plots for the two-GPU context-parallel study, read from the files next to this one.

    python experiments/multi_gpu_cp/plot.py

Writes transfer_bandwidth.png (copy engine against NCCL, 1 MiB to 1 GiB per rank),
transfer_bandwidth_alltoall.png (the same for the all-to-all and the Ulysses exchange),
cp_efficiency.png (before the CP rework: efficiency against one GPU per sequence length, kind,
layout and transport) and cp_study.png (after it: forward + backward time of ring, all-gather and
Ulysses against PyTorch's own flex CP and one GPU, per case).
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
    "alltoall": "all-to-all (CopyEngineAllToAll vs all_to_all_single)",
    "ulysses": "Ulysses q exchange, zigzag to global order",
}
STUDY_CASES = [  # (file, variant, seq_len, panel title)
    ("study_causal.csv", "causal", 32768, "causal, S=32K"),
    ("study_causal.csv", "causal", 131072, "causal, S=128K"),
    ("study_window.csv", "sliding_window", 131072, "sliding_window(1024), S=128K"),
    ("study_document.csv", "document", 131072, "document (8 unequal), S=128K"),
]


def plot_bandwidth(path: Path, source: str, patterns: tuple[str, ...]) -> None:
    data = json.loads((HERE / source).read_text())
    fig, axes = plt.subplots(1, len(patterns), figsize=(6 * len(patterns), 4.5), sharey=True)
    for ax, pattern in zip(axes, patterns, strict=True):
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


def _read_ok(name: str) -> list[dict[str, str]]:
    with open(HERE / name, newline="") as f:
        return [r for r in csv.DictReader(f) if r["status"] == "ok"]


def plot_study(path: Path) -> None:
    """One panel per case: fwd+bwd ms of each attngym topology/layout, torch_cp (the fastest of
    the jobs' own measurements of it) and one GPU, with one GPU / 2 as perfect scaling."""
    fig, axes = plt.subplots(1, len(STUDY_CASES), figsize=(4.2 * len(STUDY_CASES), 4.5))
    for ax, (name, variant, seq_len, title) in zip(axes, STUDY_CASES, strict=True):
        rows = [
            r for r in _read_ok(name) if r["variant"] == variant and int(r["seq_len"]) == seq_len
        ]
        labels = [f"{r['topology']}\n{r['layout']}" for r in rows]
        values = [float(r["fwd_bwd_ms"]) for r in rows]
        colors = ["tab:blue"] * len(rows)
        peer = [float(r["torch_cp_fwd_bwd_ms"]) for r in rows if r["torch_cp_fwd_bwd_ms"]]
        if peer:
            labels.append("torch_cp")
            values.append(min(peer))
            colors.append("tab:orange")
        single = min(float(r["single_fwd_bwd_ms"]) for r in rows)
        labels.append("one GPU")
        values.append(single)
        colors.append("tab:grey")
        bars = ax.bar(range(len(values)), values, color=colors)
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
        ax.axhline(single / 2, color="black", lw=0.8, ls="--", label="one GPU / 2")
        ax.set_xticks(range(len(values)), labels, fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.margins(y=0.12)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("forward + backward ms (lower is better)")
    axes[0].legend(fontsize=8, loc="upper left")
    fig.suptitle(
        "after the CP rework: 2 x H200, B=1 H=8 D=128 bf16, copy engine (blue: attngym)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    plot_bandwidth(
        HERE / "transfer_bandwidth.png", "transfer_bandwidth.json", ("allgather", "channel")
    )
    plot_bandwidth(
        HERE / "transfer_bandwidth_alltoall.png",
        "transfer_bandwidth_alltoall.json",
        ("allgather", "channel", "alltoall", "ulysses"),
    )
    plot_efficiency(HERE / "cp_efficiency.png")
    plot_study(HERE / "cp_study.png")


if __name__ == "__main__":
    main()
