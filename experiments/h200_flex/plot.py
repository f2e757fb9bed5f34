"""Plots for the H200 FlexAttention study, read from the summary CSVs next to this file.

    python experiments/h200_flex/plot.py

Writes tflops_vs_seq_len_{fwd,fwd_bwd}[_d64].png, speedup_vs_best_sdpa.png, block_size_sweep.png,
bwd_options_sweep.png and flash_backend.png into this folder.
"""

from __future__ import annotations

import csv
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator  # noqa: E402

HERE = Path(__file__).resolve().parent
VARIANTS = [
    "full",
    "causal",
    "sliding_window",
    "document",
    "prefix_lm",
    "alibi",
    "softcap",
    "gemma2",
]
COLORS = dict(zip(VARIANTS, plt.get_cmap("tab10").colors, strict=False))
MARKERS = dict(zip(VARIANTS, "oDs^v<>P", strict=True))
# causal and prefix_lm lie within 1% of each other: causal drawn wide, prefix_lm thin on top
LINE_STYLE = {
    "causal": {"lw": 5, "alpha": 0.6, "ms": 9},
    "prefix_lm": {"lw": 1.2, "mfc": "none", "ms": 9, "mew": 1.5},
}
PASS_LABEL = {"fwd": "forward", "fwd_bwd": "forward + backward"}
SDPA_LABEL = {
    "sdpa": "SDPA dispatch",
    "sdpa_cudnn": "SDPA cuDNN",
    "sdpa_flash": "SDPA flash",
    "sdpa_efficient": "SDPA efficient",
    "sdpa_dense_mask": "SDPA dense mask",
}
SDPA_SHORT = {
    "sdpa": "SDPA",
    "sdpa_cudnn": "cuDNN",
    "sdpa_flash": "flash",
    "sdpa_efficient": "efficient",
    "sdpa_dense_mask": "dense mask",
}


def read_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return [row for row in csv.DictReader(f) if row["status"] == "ok"]


def num(value: str) -> float | None:
    return float(value) if value not in ("", None) else None


def best_sdpa_tflops(row: dict[str, str], pass_: str) -> float | None:
    """TFLOP/s of the best SDPA contender for this pass (same FLOP count as flex), or None."""
    best = row.get(f"best_sdpa_{pass_}", "")
    return num(row.get(f"{best}_{pass_}_tflops", "")) if best else None


def plot_tflops_vs_seq_len(rows: list[dict[str, str]], pass_: str, head_dim: int = 128) -> Path:
    fig, ax = plt.subplots(figsize=(10, 6))
    seq_lens = sorted({int(r["seq_len"]) for r in rows})
    for variant in VARIANTS:
        vrows = sorted(
            (r for r in rows if r["variant"] == variant), key=lambda r: int(r["seq_len"])
        )
        if not vrows:
            continue
        xs = [int(r["seq_len"]) for r in vrows]
        style = {"lw": 2, "ms": 6, **LINE_STYLE.get(variant, {})}
        ax.plot(
            xs,
            [float(r[f"{pass_}_tflops"]) for r in vrows],
            ls="-",
            marker=MARKERS[variant],
            color=COLORS[variant],
            label=f"flex {variant}",
            **style,
        )
        sdpa = [(x, best_sdpa_tflops(r, pass_)) for x, r in zip(xs, vrows, strict=True)]
        sdpa = [(x, y) for x, y in sdpa if y is not None]
        if sdpa:
            names = {SDPA_LABEL[r[f"best_sdpa_{pass_}"]] for r in vrows if r[f"best_sdpa_{pass_}"]}
            ax.plot(
                [x for x, _ in sdpa],
                [y for _, y in sdpa],
                ls="--",
                marker=MARKERS[variant],
                color=COLORS[variant],
                lw=1.3,
                ms=5,
                alpha=0.85,
                label=f"best SDPA {variant} ({' / '.join(sorted(names))})",
            )
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(seq_lens))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{int(x) // 1024}K"))
    ax.set_yscale("log")
    ticks = [2, 5, 10, 20, 50, 100, 200, 300, 500, 700]
    ax.yaxis.set_major_locator(FixedLocator(ticks))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    ax.set_ylim(2, 800)
    ax.set_xlabel("sequence length (batch = 32768 / seq_len, 16 heads)")
    ax.set_ylabel(f"{PASS_LABEL[pass_]} TFLOP/s (useful FLOPs, log scale)")
    ax.set_title(
        f"FlexAttention vs best SDPA on H200, {PASS_LABEL[pass_]}, head_dim {head_dim}, bf16\n"
        "solid: flex; dashed: best SDPA contender that can express the variant"
    )
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=9, frameon=False)
    suffix = "" if head_dim == 128 else f"_d{head_dim}"
    out = HERE / f"tflops_vs_seq_len_{pass_}{suffix}.png"
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return out


def plot_speedup(rows: list[dict[str, str]]) -> Path:
    at = {r["variant"]: r for r in rows if int(r["seq_len"]) == 8192}
    variants = [v for v in VARIANTS if v in at]
    fig, ax = plt.subplots(figsize=(12, 5.5))
    width = 0.38
    for i, (pass_, color) in enumerate((("fwd", "tab:blue"), ("fwd_bwd", "tab:orange"))):
        for j, variant in enumerate(variants):
            ratio = num(at[variant][f"flex_over_best_sdpa_{pass_}"])
            x = j + (i - 0.5) * width
            if ratio is None:
                continue
            ax.bar(x, ratio, width, color=color, label=PASS_LABEL[pass_] if j == 0 else None)
            ax.text(x, ratio * 1.04, f"{ratio:.2f}", ha="center", va="bottom", fontsize=8)
    for j, variant in enumerate(variants):
        if num(at[variant]["flex_over_best_sdpa_fwd"]) is None:
            ax.text(j, 1.15, "no SDPA\ncontender\n(score_mod\nnot a bias)", ha="center", fontsize=8)
    ax.axhline(1.0, color="black", lw=1)
    ax.set_yscale("log")
    ticks = [0.5, 1, 2, 5, 10, 20]
    ax.yaxis.set_major_locator(FixedLocator(ticks))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}x"))
    ax.set_ylim(0.4, 30)
    labels = []
    for variant in variants:
        names = []
        for pass_ in ("fwd", "fwd_bwd"):
            best = at[variant][f"best_sdpa_{pass_}"]
            if best and SDPA_SHORT[best] not in names:
                names.append(SDPA_SHORT[best])
        labels.append(f"{variant}\nvs {' / '.join(names)}" if names else variant)
    ax.set_xticks(range(len(variants)), labels, fontsize=9)
    ax.set_ylabel("best-SDPA time / flex time (log; > 1: flex faster)")
    ax.set_xlabel("variant, and the fastest SDPA contender (fwd / fwd+bwd where they differ)")
    ax.set_title("FlexAttention speed over the best SDPA contender, H200, S=8192, D=128, B=4, H=16")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(loc="upper right")
    out = HERE / "speedup_vs_best_sdpa.png"
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return out


def option_label(row: dict[str, str]) -> str:
    short = {
        "fwd_BLOCK_M": "M",
        "fwd_BLOCK_N": "N",
        "fwd_num_warps": "w",
        "fwd_num_stages": "s",
    }
    parts = [
        f"{s}{row[f'kernel_options.{k}']}"
        for k, s in short.items()
        if row.get(f"kernel_options.{k}")
    ]
    if row.get("kernel_options.USE_TMA", "").lower() == "true":
        parts.append("TMA")
    return " ".join(parts) if parts else "default"


def bwd_option_label(row: dict[str, str]) -> str:
    """e.g. "TMA" over "(64,128,128,64)" over "w8 s2"."""
    option = {
        k.split(".", 1)[1]: v for k, v in row.items() if k.startswith("kernel_options.") and v
    }
    lines = ["TMA"] if option.get("USE_TMA", "").lower() == "true" else ["default"]
    if "bwd_BLOCK_M1" in option:
        tiles = ",".join(option[f"bwd_BLOCK_{t}"] for t in ("M1", "N1", "M2", "N2"))
        lines += [f"({tiles})", f"w{option['bwd_num_warps']} s{option['bwd_num_stages']}"]
    return "\n".join(lines)


def plot_block_size_sweep(rows: list[dict[str, str]], which: str = "forward") -> Path:
    fig, ax = plt.subplots(figsize=(10 if which == "forward" else 12, 5.5))
    width = 0.38
    labels = [(option_label if which == "forward" else bwd_option_label)(r) for r in rows]
    for i, (pass_, color) in enumerate((("fwd", "tab:blue"), ("fwd_bwd", "tab:orange"))):
        xs = [j + (i - 0.5) * width for j in range(len(rows))]
        ys = [float(r[f"{pass_}_tflops"]) for r in rows]
        ax.bar(xs, ys, width, color=color, label=f"flex {PASS_LABEL[pass_]}")
        for x, y in zip(xs, ys, strict=True):
            ax.text(x, y + 5, f"{y:.0f}", ha="center", va="bottom", fontsize=8)
        cudnn = [float(r[f"sdpa_cudnn_{pass_}_tflops"]) for r in rows]
        ax.axhline(
            statistics.median(cudnn),
            color=color,
            ls="--",
            lw=1.5,
            label=f"SDPA cuDNN {PASS_LABEL[pass_]} (median of the {len(rows)} jobs; "
            f"{min(cudnn):.0f}-{max(cudnn):.0f})",
        )
    if which == "forward":
        ax.set_xticks(range(len(rows)), labels, fontsize=9)
        ax.set_xlabel("forward kernel options (M/N: BLOCK_M/N, w: num_warps, s: num_stages)")
    else:
        ax.set_xticks(range(len(rows)), labels, fontsize=8)
        ax.set_xlabel(
            "backward kernel options (M1/N1: dk,dv loop tile, M2/N2: dq loop tile, w: warps, "
            "s: stages); default = (64, 128, 128, 64) w8 s3"
        )
    ax.set_ylabel("TFLOP/s (useful FLOPs)")
    ax.set_ylim(0, 760)
    ax.set_title(
        f"Causal flex {which} kernel options vs SDPA cuDNN, H200, B=4, H=16, S=8192, D=128, bf16"
    )
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(loc="upper left", fontsize=8, ncol=2)
    out = HERE / ("block_size_sweep.png" if which == "forward" else "bwd_options_sweep.png")
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return out


def plot_flash(rows: list[dict[str, str]]) -> Path:
    """Per variant at S=8192, D=128: Triton flex, FLASH flex and cuDNN where SDPA can run it."""
    at = {r["variant"]: r for r in rows if r["head_dim"] == "128"}
    variants = [v for v in VARIANTS if v in at]
    fig, axes = plt.subplots(1, 2, figsize=(14, 5), sharey=True)
    bars = (
        ("flex_default", "flex, Triton (default)", "tab:blue"),
        ("", "flex, BACKEND=FLASH", "tab:red"),
        ("sdpa_cudnn", "SDPA cuDNN", "tab:gray"),
    )
    width = 0.27
    for ax, pass_ in zip(axes, ("fwd", "fwd_bwd"), strict=True):
        for i, (name, label, color) in enumerate(bars):
            column = f"{name}_{pass_}_tflops" if name else f"{pass_}_tflops"
            for j, variant in enumerate(variants):
                y = num(at[variant].get(column, ""))
                if y is None:
                    continue
                x = j + (i - 1) * width
                ax.bar(
                    x,
                    y,
                    width,
                    color=color,
                    label=label if j == 0 or name == "sdpa_cudnn" else None,
                )
                ax.text(x, y + 8, f"{y:.0f}", ha="center", va="bottom", fontsize=7)
        handles, labels = ax.get_legend_handles_labels()
        unique = dict(zip(labels, handles, strict=True))
        ax.legend(unique.values(), unique.keys(), loc="upper right", fontsize=8)
        ax.set_xticks(range(len(variants)), variants, fontsize=8, rotation=20)
        ax.set_title(PASS_LABEL[pass_])
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].set_ylabel("TFLOP/s (useful FLOPs)")
    axes[0].set_ylim(0, 800)
    fig.suptitle(
        "FlexAttention's FLASH backend (flash-attn-4, CuTe DSL) vs its Triton kernels and "
        "cuDNN, H200, B=4, H=16, S=8192, D=128, bf16"
    )
    out = HERE / "flash_backend.png"
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return out


def main() -> None:
    d128 = read_rows(HERE / "flex_vs_sdpa_d128.csv")
    d64 = read_rows(HERE / "flex_vs_sdpa_d64.csv")
    outs = [
        plot_tflops_vs_seq_len(d128, "fwd"),
        plot_tflops_vs_seq_len(d128, "fwd_bwd"),
        plot_tflops_vs_seq_len(d64, "fwd", head_dim=64),
        plot_tflops_vs_seq_len(d64, "fwd_bwd", head_dim=64),
        plot_speedup(d128),
        plot_block_size_sweep(read_rows(HERE / "block_size_sweep" / "summary.csv")),
        plot_block_size_sweep(
            read_rows(HERE / "bwd_options_sweep" / "summary.csv"), which="backward"
        ),
        plot_flash(read_rows(HERE / "flash_backend.csv")),
    ]
    for out in outs:
        print(out.relative_to(HERE.parent.parent))


if __name__ == "__main__":
    main()
