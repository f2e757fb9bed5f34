"""The short table printed at the end of a single run: the metrics the table marks as shown.

Rows, their order and their labels come from attngym.metrics (a row's `shown`: "run" for every
run, "cp" for context-parallel runs as well); values read as in every other table
(attngym.metrics.format_value). Standard library and attngym.metrics only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from attngym.metrics import METRICS, format_value, label

# On a CPU the one-device comparison attends densely (every masked entry computed, then
# dropped) while the ranks skip masked blocks, so efficiency there compares unequal work.
CPU_EFFICIENCY_NOTE = " (CPU: one device computes masked pairs too; not scaling)"


def result_rows(metrics: dict[str, Any]) -> list[str]:
    """The keys the printed table shows for these metrics, in the metric table's order: those
    marked "run", and "cp" ones too for a context-parallel run, where they have a value."""
    context_parallel = metrics.get("topology") not in (None, "single")
    shown = ("run", "cp") if context_parallel else ("run",)
    return [
        key
        for row in METRICS
        if row.shown in shown
        for key in row.names()
        if metrics.get(key) is not None
    ]


def format_results(metrics: dict[str, Any], run_dir: Path) -> str:
    """The short table printed at the end of a single run."""
    lines = [f"attngym: {metrics.get('status')}"]
    rows = [(_label(key, metrics), format_value(key, metrics[key])) for key in result_rows(metrics)]
    width = max((len(text) for text, _ in rows), default=0)
    for text, value in rows:
        lines.append(f"  {text:<{width}}  {value}")
    if metrics.get("error"):
        lines.append(f"  error: {metrics['error']}")
    lines.append(f"run folder: {run_dir}")
    return "\n".join(lines)


def _label(key: str, metrics: dict[str, Any]) -> str:
    if key.startswith("efficiency") and metrics.get("device") == "cpu":
        return label(key) + CPU_EFFICIENCY_NOTE
    return label(key)
