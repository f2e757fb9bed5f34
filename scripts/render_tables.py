"""The tables of docs/results.md, rendered from the data files they come from.

    python scripts/render_tables.py           # rewrite the page's tables from the data
    python scripts/render_tables.py --check   # exit 1, naming the table, where they differ

A table sits in docs/results.md between `<!-- table: NAME -->` and `<!-- /table -->`, NAME one of
TABLES; tests/test_readme_tables.py runs --check, so a table edited by hand, or data re-made
without rendering, fails the suite. Each caption says when, on which commit and on what device
its data was made: scaling.json's rows carry it; older data files carry it in `measured.json`
beside them (the date and the commit that brought the data, and what changed since).
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "results.md"
EXPERIMENTS = ROOT / "experiments"
# The catalogue's defaults the one-GPU study ran with, for the labels.
LABELS = {"sliding_window": "sliding_window(256)", "softcap": "softcap(20)"}
CONTENDERS = {"sdpa": "SDPA", "sdpa_cudnn": "cuDNN", "sdpa_flash": "SDPA flash",
              "sdpa_efficient": "SDPA efficient", "sdpa_dense_mask": "SDPA, dense",
              "varlen": "varlen_attn", "flash_varlen": "flash-attn varlen"}  # fmt: skip
SCHEMES = ("ring", "allgather", "ulysses", "hybrid")


def _csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return [row for row in csv.DictReader(f) if row.get("status", "ok") == "ok"]


def _measured(folder: Path, name: str) -> dict[str, str]:
    return json.loads((folder / "measured.json").read_text())[name]


def _caption(made: dict[str, str], source: str) -> str:
    since = f" {made['since']}" if made.get("since") else ""
    return _italic(
        f"Measured {made['date']} on {made['device']} (torch {made['torch']}), data committed in "
        f"{made['commit']}; rendered from {source}.{since}"
    )


def _italic(text: str) -> str:
    """A caption in italics, wrapped at the docs' 100 columns."""
    return "\n".join(textwrap.wrap(f"*{text}*", 100))


def _ratio(row: dict[str, str], which: str, best_of: str = "best_sdpa") -> str:
    """flex's speed-up over the fastest contender of `best_of` (best_sdpa, or best: SDPA and
    varlen), naming it; a tie where the ratio's 95 % interval holds 1."""
    best = row.get(f"{best_of}_{which}")
    if not best:
        return "no equivalent"
    ratio = float(row[f"flex_over_{best_of}_{which}"])
    interval = row.get(f"flex_over_{best_of}_{which}_ci95") or ""
    bounds = [float(x) for x in re.findall(r"[-+0-9.eE]+", interval)]
    tie = len(bounds) == 2 and bounds[0] <= 1 <= bounds[1]
    shown = f"{ratio:.{2 if ratio < 10 else 1}f}x" + (" (tie" if tie else " (")
    return f"{shown}{', ' if tie else ''}{CONTENDERS.get(best, best)})"


def one_gpu() -> str:
    """FlexAttention against the fastest contender, one GPU, B=4 H=16 S=8192 D=128: of SDPA
    and FlashAttention's varlen kernels where experiments/workloads has measured them, else of
    SDPA alone (experiments/h200_flex). The FLASH column is experiments/h200_flex's; its header
    names that device where the rows come from another."""
    folder = EXPERIMENTS / "h200_flex"
    against = EXPERIMENTS / "workloads" / "flex_vs_best_d128.csv"
    source, best_of, vs = folder / "flex_vs_sdpa_d128.csv", "best_sdpa", "best SDPA"
    if against.exists():
        source, best_of, vs = against, "best", "best of SDPA and varlen"
    flex = [r for r in _csv(source) if r["seq_len"] == "8192"]
    flash: dict[str, dict[str, str]] = {}
    for r in _csv(folder / "flash_backend.csv"):
        if (r["seq_len"], r["head_dim"]) == ("8192", "128"):
            flash.setdefault(r["variant"], r)  # the first run of each variant
    made, flash_made = _measured(source.parent, source.name), _measured(folder, "flash_backend.csv")
    on = "" if flash_made["device"] == made["device"] else f" ({flash_made['device']})"
    lines = [
        f"| variant | flex fwd TFLOP/s | flex fwd+bwd TFLOP/s | vs {vs} fwd | "
        f"vs {vs} fwd+bwd | FLASH fwd / fwd+bwd TFLOP/s{on} |",
        "|---|--:|--:|--:|--:|--:|",
    ]
    for r in flex:
        f = flash.get(r["variant"])
        both = f"{float(f['fwd_tflops']):.0f} / {float(f['fwd_bwd_tflops']):.0f}" if f else ""
        lines.append(
            f"| {LABELS.get(r['variant'], r['variant'])} | {float(r['fwd_tflops']):.0f} | "
            f"{float(r['fwd_bwd_tflops']):.0f} | {_ratio(r, 'fwd', best_of)} | "
            f"{_ratio(r, 'fwd_bwd', best_of)} | {both} |"
        )
    return "\n".join([*lines, "", _caption(made, f"experiments/{source.parent.name}")])


def two_gpu_cp() -> str:
    """CP on two H200s against torch_cp and one GPU, fwd+bwd ms (efficiency)."""
    folder = EXPERIMENTS / "multi_gpu_cp"
    cases: dict[str, dict[str, Any]] = {}
    for study, label in (("causal", "causal"), ("window", "sliding_window(1024)"),
                         ("document", "document, 8 unequal")):  # fmt: skip
        for r in _csv(folder / f"study_{study}.csv"):
            case = cases.setdefault(f"{label} {int(r['seq_len']) // 1024}K", {})
            if cp := r.get("torch_cp_fwd_bwd_ms"):  # on the layout torch_cp can take
                case.setdefault("torch_cp", f"{float(cp):.1f} ({r['layout']})")
            case.setdefault("single", f"{float(r['single_fwd_bwd_ms']):.1f}")
            if r["topology"] in case:  # the first layout measured of a scheme
                continue
            cell = f"{float(r['fwd_bwd_ms']):.1f} ({float(r['efficiency_fwd_bwd']):.2f}"
            case[r["topology"]] = cell + (f", {r['layout']})" if study == "document" else ")")
    lines = ["| case | ring | all-gather | ulysses | torch_cp | one GPU |",
             "|---|--:|--:|--:|--:|--:|"]  # fmt: skip
    for name, case in cases.items():
        cells = [case.get(k, "") for k in ("ring", "allgather", "ulysses", "torch_cp", "single")]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    made = _measured(folder, "study")
    return "\n".join([*lines, "", _caption(made, "experiments/multi_gpu_cp/study_*.csv")])


def scaling() -> str:
    """Simulated ranks on one H200, priced on the fabric: efficiency (predicted fwd+bwd ms)."""
    rows = json.loads((EXPERIMENTS / "cp_model" / "scaling.json").read_text())["rows"]
    groups: dict[tuple[str, int, str], dict[str, str]] = {}
    for r in rows:
        cell = f"{r['efficiency_fwd_bwd']:.2f} ({r['predicted_fwd_bwd_ms']:.3g} ms)"
        groups.setdefault((r["case"], r["world_size"], r["fabric"]), {})[r["topology"]] = cell
    lines = ["| case | P | fabric / transport | ring | all-gather | ulysses | hybrid |",
             "|---|--:|---|--:|--:|--:|--:|"]  # fmt: skip
    for (case, world, fabric), cells in groups.items():
        lines.append(
            f"| {case} | {world} | {fabric} | " + " | ".join(cells.get(s, "") for s in SCHEMES)
            + " |"
        )  # fmt: skip
    made = {(m["date"], m["commit"], m["device_name"], m["torch"]) for r in rows
            if (m := r.get("measured"))}  # fmt: skip
    dates = sorted({d for d, *_ in made})
    commits = ", ".join(sorted({c for _, c, *_ in made}))
    devices = ", ".join(sorted({f"{g} (torch {t})" for *_, g, t in made}))
    caption = _italic(
        f"Predicted on {', '.join(dates)} at commits {commits} on {devices}: each rank's compute "
        "timed on the one GPU with CUDA graphs, transfers priced on the fabric; rendered from "
        "experiments/cp_model/scaling.json."
    )
    return "\n".join([*lines, "", caption])


TABLES: dict[str, Callable[[], str]] = {
    "one_gpu": one_gpu,
    "two_gpu_cp": two_gpu_cp,
    "scaling": scaling,
}
_BLOCK = re.compile(r"(<!-- table: (\w+) -->\n)(.*?)(<!-- /table -->)", re.DOTALL)


def render(text: str) -> str:
    """`text` with each table block rendered anew from its data."""

    def one(match: re.Match[str]) -> str:
        name = match[2]
        if name not in TABLES:
            raise KeyError(f"docs/results.md names table {name!r}; tables: {', '.join(TABLES)}")
        return f"{match[1]}{TABLES[name]()}\n{match[4]}"

    return _BLOCK.sub(one, text)


def stale(text: str) -> list[str]:
    """The names of the tables in `text` that differ from their data."""
    fresh = dict((m[2], m[0]) for m in _BLOCK.finditer(render(text)))
    return [m[2] for m in _BLOCK.finditer(text) if fresh[m[2]] != m[0]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 where a table is stale")
    args = parser.parse_args(argv)
    text = PAGE.read_text()
    if args.check:
        if names := stale(text):
            print(f"docs/results.md: stale tables {', '.join(names)}: run python scripts/"
                  "render_tables.py", file=sys.stderr)  # fmt: skip
            return 1
        return 0
    PAGE.write_text(render(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
