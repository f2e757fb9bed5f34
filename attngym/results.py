"""The short table printed at the end of a single run: the metrics the table marks as shown.

Rows, their order and their labels come from attngym.metrics (a row's `shown`: "run" for every
run, "cp" for context-parallel runs as well); values read as in every other table
(attngym.metrics.format_value). Standard library and attngym.metrics only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from attngym.metrics import METRICS, format_cell, format_value, label, printable
from attngym.timeline import largest

# Notes printed once under a CPU run's table, each where its rows show (the labels stay short).
# The one-device comparison attends densely (every masked entry computed, then dropped) while the
# ranks skip masked blocks, so efficiency there compares unequal work.
CPU_EFFICIENCY_NOTE = "efficiency on a CPU: one device computes masked pairs too; not scaling"
# Flex runs eagerly (FlexAttention compiles for CUDA) while SDPA runs its fused CPU kernel.
CPU_SPEEDUP_NOTE = "speed-ups on a CPU: eager flex against SDPA's fused kernel"
# FlexAttention's CPU kernel has no backward; a context-parallel CPU run differentiates through
# attngym's dense kernel (attngym.kernels, backend "reference") instead.
CPU_CP_BWD_NOTE = "bwd on a CPU: the dense reference kernel (FlexAttention has no CPU backward)"


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
    rows = [
        (_label(key, metrics), _value(key, metrics))
        for key in result_rows(metrics)
        if not _said_already(key, metrics)
    ]
    width = max((len(text) for text, _ in rows), default=0)
    for text, value in rows:
        lines.append(f"  {text:<{width}}  {value}")
    lines += [f"  note: {note}" for note in _cpu_notes(metrics)]
    lines += _limits_lines(metrics)
    if (spread := timing_spread(metrics)) is not None:
        lines.append(f"  warning: {spread}")
    if metrics.get("error"):
        lines.append(f"  error: {printable(str(metrics['error']))}")
    if where := largest(metrics):
        lines.append(f"  {where}")
    lines.append(f"run folder: {run_dir}")
    return "\n".join(lines)


# Above this max/min over the timed calls, the machine was busy with other work while timing.
BUSY_SPREAD = 2.0


def timing_spread(metrics: dict[str, Any]) -> str | None:
    """A warning when the forward's timed calls spread more than BUSY_SPREAD (max / min), else
    None: the median of such calls measures the machine's load as much as the kernel."""
    low, high = metrics.get("fwd_ms_min"), metrics.get("fwd_ms_max")
    if not low or not high or high / low <= BUSY_SPREAD:
        return None
    return (
        f"timed forwards spread {format_value('fwd_ms', low)}-{format_value('fwd_ms', high)} "
        f"ms ({high / low:.1f}x): the machine was busy, times are rough"
    )


def _said_already(key: str, metrics: dict[str, Any]) -> bool:
    """A headline another headline row says already: flex against the best SDPA when the best
    contender is that SDPA one, against a contender that is the best or the best SDPA."""
    if not key.startswith("flex_over_"):
        return False
    rest = key.removeprefix("flex_over_")
    pass_name = next(p for p in ("fwd_bwd", "fwd", "bwd") if rest.endswith(f"_{p}"))
    baseline = rest.removesuffix(f"_{pass_name}")
    best, best_sdpa = (metrics.get(f"{h}_{pass_name}") for h in ("best", "best_sdpa"))
    if baseline == "best":
        return False
    if baseline == "best_sdpa":
        return best_sdpa == best
    return baseline in (best, best_sdpa)


_HEADLINE_LABELS = {"best": "best", "best_sdpa": "best SDPA"}


def _label(key: str, metrics: dict[str, Any]) -> str:
    for headline, words in _HEADLINE_LABELS.items():
        prefix = f"flex_over_{headline}_"
        if key.startswith(prefix) and key.removeprefix(prefix) in ("fwd", "bwd", "fwd_bwd"):
            winner = metrics.get(f"{headline}_{key.removeprefix(prefix)}")
            return label(key).replace(headline, f"{words} ({winner})" if winner else words)
    return label(key)


def _value(key: str, metrics: dict[str, Any]) -> str:
    """format_cell (a ratio whose interval holds 1 reads "(tie)"), and for a speed-up below 1
    how many times slower that is: a "speed-up" of 0.096 reads as what it is."""
    value = metrics[key]
    text = format_cell(key, metrics)
    speedup = key.startswith(("flex_over_", "attngym_over_"))
    if speedup and not text.endswith("(tie)") and isinstance(value, int | float) and 0 < value < 1:
        text += f" ({1 / value:.3g}x slower)"
    return text


def _limits_lines(metrics: dict[str, Any]) -> list[str]:
    """Which kernels ran and whether FLASH could have, then what this device could not measure
    (tasks.phases.limits), each wrapped to the table's width."""
    import textwrap

    paths = [
        f"{p} {str(metrics[f'kernel_path_{p}']).split(' (')[0]}"
        for p in ("fwd", "bwd")
        if metrics.get(f"kernel_path_{p}")
    ]
    said = [f"kernels: {', '.join(paths)}"] if paths else []
    if metrics.get("flash") and metrics.get("device") != "cpu":  # FLASH is a CUDA kernel
        said.append(f"FLASH: {metrics['flash']}")
    if metrics.get("not_measured"):
        said.append(f"not measured here: {metrics['not_measured']}")
    return [
        line
        for text in said
        for line in textwrap.wrap(
            printable(text), 96, initial_indent="  ", subsequent_indent="    "
        )
    ]


def _cpu_notes(metrics: dict[str, Any]) -> list[str]:
    """What the CPU numbers of this run compare, once each (see the notes' definitions)."""
    if metrics.get("device") != "cpu":
        return []
    keys = result_rows(metrics)
    notes = []
    if any(k.startswith("flex_over_") for k in keys):
        notes.append(CPU_SPEEDUP_NOTE)
    if any(k.startswith("efficiency") for k in keys):
        notes.append(CPU_EFFICIENCY_NOTE)
    if metrics.get("topology") not in (None, "single") and metrics.get("bwd_status") == "ok":
        notes.append(CPU_CP_BWD_NOTE)
    return notes
