"""The end of a sweep: one table and one plot over every job, and an exit code that tells.

A sweep is judged by its summary, not by scrolling logs, so when the last job ends a Hydra
callback (conf/hydra/default.yaml: hydra.callbacks.sweep_summary) reads each job's metrics.json
and writes, in the sweep folder:

    summary.csv   one row per job: its overrides, status, error and every metric
    summary.md    the columns that vary between jobs, in units a person reads (MiB, ms to 3
                  significant figures); the same table is printed when the sweep ends
    summary.png   TFLOP/s (CUDA) or forward time (CPU) against seq_len, one line per variant

Jobs are read from files, so the summary is the same with the basic launcher and with submitit
(where jobs run on other machines). A job that failed is a row with its error; a job folder
without metrics.json (a killed job) is a row with status failed. `summarize` is also usable on
its own: `attngym.runner.tracking.sweep.summarize(sweep_dir)`.
"""

from __future__ import annotations

import contextlib
import csv
import functools
import io
import json
import logging
import math
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

from attngym.errors import ConfigError, Interrupted, failure_text
from attngym.fileio import ReadRefused, atomic_write, read_inside, write_error
from attngym.metrics import (
    CI_SUFFIX,
    error_line,
    format_cell,
    format_value,
    markdown_cell,
    metric_of,
    printable,
    shortened,
    table_columns,
)
from attngym.results import BUSY_SPREAD, timing_spread
from attngym.runner.overrides import as_typed, resume_command, task_overrides
from attngym.runner.tracking.files import METRICS_FILE, load_metrics
from attngym.runner.tracking.lock import FolderLock, FolderLocked

log = logging.getLogger(__name__)


def md_columns() -> tuple[str, ...]:
    """Columns of summary.md (summary.csv has them all): job, overrides, then the metric names of
    attngym.metrics.table_columns."""
    return ("job", "overrides", *table_columns())


# Always columns of a table, even when every job has the same value there.
KEPT_COLUMNS = ("job", "overrides", "status", "variant")


def without_shared_overrides(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    """Rows whose `overrides` keep only what differs between jobs, and the overrides every job
    shares (`+experiment=variant_gallery`), to be named once."""
    lists = [str(row.get("overrides") or "").split() for row in rows]
    shared = (
        [o for o in lists[0] if all(o in other for other in lists[1:])] if len(rows) > 1 else []
    )
    trimmed = [
        {**row, "overrides": " ".join(o for o in overrides if o not in shared) or None}
        for row, overrides in zip(rows, lists, strict=True)
    ]
    return trimmed, " ".join(shared)


def table_layout(
    rows: list[dict[str, Any]], columns: Sequence[str]
) -> tuple[list[str], dict[str, Any]]:
    """Split `columns` into those that vary between rows and those every row shares.

    A sweep table then shows what the sweep changed and what it measured, and names the shared
    settings (device, dtype, heads, ...) once above it instead of in every row.

    Returns:
        (columns with at least one value that differ between rows, or are KEPT_COLUMNS;
        {column: value} shared by every row, None-only columns left out).
    """
    present = [c for c in columns if any(row.get(c) is not None for row in rows)]
    if len(rows) < 2:
        return present, {}
    shared = {}
    for c in present:  # a failed job's missing values (None) make no column vary
        values = [row.get(c) for row in rows if row.get("status") == "ok" or row.get(c) is not None]
        agreed = len(values) > 1 and all(v == values[0] for v in values)  # one job is no "every"
        if c not in KEPT_COLUMNS and agreed:
            shared[c] = values[0]
    return [c for c in present if c not in shared], shared


# How deep under a sweep folder job folders are looked for: hydra.sweep.subdir may nest them
# (`grp/${hydra.job.num}`).
JOB_DEPTH = 4


def job_dirs(sweep_dir: Path) -> list[Path]:
    """Folders under a sweep that are Hydra jobs (they hold .hydra), up to JOB_DEPTH levels down
    (hydra.sweep.subdir may nest them), in job order; symlinked folders are not followed."""

    def walk(folder: Path, depth: int) -> Iterator[Path]:
        with contextlib.suppress(OSError):
            for entry in os.scandir(folder):
                if not entry.is_dir(follow_symlinks=False) or entry.name.startswith("."):
                    continue
                if os.path.lexists(os.path.join(entry.path, ".hydra")):
                    yield Path(entry.path)
                elif depth > 1:
                    yield from walk(Path(entry.path), depth - 1)

    def order(p: Path) -> tuple[tuple[float, str], ...]:
        parts = p.relative_to(sweep_dir).parts
        return tuple((int(n), "") if n.isdigit() else (math.inf, n) for n in parts)

    sweep_dir = Path(sweep_dir)
    return sorted(walk(sweep_dir, JOB_DEPTH), key=order)


def job_name(sweep_dir: Path, job_dir: Path) -> str:
    """A job's name in tables: its folder under the sweep (`3`, or `grp/3` when nested)."""
    return job_dir.relative_to(sweep_dir).as_posix() if job_dir != sweep_dir else job_dir.name


# Far above a real .hydra/overrides.yaml (a line per override).
OVERRIDES_LIMIT = 1 << 20


def job_overrides(job_dir: Path) -> list[str]:
    """The job's task overrides as the user typed them (attngym.runner.overrides.as_typed), from its
    .hydra/overrides.yaml, which holds what Hydra received; empty, with a warning, when it cannot
    be read safely (a symlink, too large, YAML with aliases, not a list)."""
    try:
        raw = read_inside(job_dir, ".hydra/overrides.yaml", OVERRIDES_LIMIT)
    except FileNotFoundError:
        return []
    except ReadRefused as err:
        log.warning("%s", err)
        return []
    try:
        data = load_yaml(raw)
    except ValueError as err:
        log.warning("skipped %s: %s", job_dir / ".hydra" / "overrides.yaml", err)
        return []
    return [as_typed(str(o)) for o in data] if isinstance(data, list) else []


def load_yaml(raw: bytes) -> Any:
    """YAML as yaml.safe_load reads it, aliases refused (a few lines of them expand to
    gigabytes; what Hydra writes has none). ValueError for anything that is not such YAML."""
    import yaml

    class NoAliases(yaml.SafeLoader):
        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):
                raise yaml.YAMLError("YAML aliases are not read")
            return super().compose_node(parent, index)

    try:
        return yaml.load(raw, Loader=NoAliases)
    except (yaml.YAMLError, RecursionError) as err:
        raise ValueError(str(err).splitlines()[0] if str(err) else type(err).__name__) from None


def collect(sweep_dir: str | Path) -> list[dict[str, Any]]:
    """One row per job folder: job, overrides, status, error and the job's metrics."""
    rows = []
    sweep_dir = Path(sweep_dir)
    for job_dir in job_dirs(sweep_dir):
        rows.append(job_row(job_dir, job_name(sweep_dir, job_dir)))
    return rows


def job_row(job_dir: Path, name: str) -> dict[str, Any]:
    """A job folder as a table row: job, overrides, and its metrics.json's status, error and
    scalar metrics and ratios' intervals (`<ratio>_ci95`, [lo, hi]), or status failed and why its
    metrics.json cannot be used."""
    metrics, problem = load_metrics(job_dir)
    if problem is not None:
        log.warning("%s: %s; the job counts as failed", job_dir / METRICS_FILE, problem)
        metrics = {"status": "failed", "error": f"its metrics.json {problem}"}
    elif metrics is None:
        metrics = {"status": "failed", "error": "no metrics.json (the job did not finish)"}
    row = {"job": name, "overrides": " ".join(job_overrides(job_dir))}
    kept = {k: v for k, v in metrics.items() if k.endswith(CI_SUFFIX)}  # a ratio's [lo, hi]
    row.update({k: v for k, v in metrics.items() if not isinstance(v, dict | list) or k in kept})
    row.setdefault("error", None)
    return row


def format_table(
    rows: list[dict[str, Any]], columns: Sequence[str], *, max_width: int | None = None
) -> str:
    """An aligned Markdown table of `columns` over `rows`, values through `format_cell` (a
    ratio whose interval holds 1 reads "1.03 (tie)").

    Args:
        max_width: cut longer cells (an error message) to this many characters, with "...".
    """

    def cell(column: str, row: dict[str, Any]) -> str:
        text = markdown_cell(format_cell(column, row))
        return text if max_width is None else shortened(text, max_width)

    body = [[cell(c, row) for c in columns] for row in rows]
    widths = [max([len(c)] + [len(line[i]) for line in body]) for i, c in enumerate(columns)]
    numeric = [all(_is_number(row.get(c)) for row in rows) for c in columns]

    def line(cells: Sequence[str]) -> str:
        padded = (
            t.rjust(w) if right else t.ljust(w)
            for t, w, right in zip(cells, widths, numeric, strict=True)
        )
        return "| " + " | ".join(padded) + " |"

    rule = (
        "|"
        + "|".join(
            ("-" * (w + 1)) + (":" if r else "-") for w, r in zip(widths, numeric, strict=True)
        )
        + "|"
    )
    return "\n".join([line(columns), rule, *(line(cells) for cells in body)])


def _is_number(value: Any) -> bool:
    return value is None or (isinstance(value, int | float) and not isinstance(value, bool))


# An error's characters in a table cell (summary.md lists every error whole below its table).
ERROR_WIDTH = 60


def outcome_count(rows: list[dict[str, Any]]) -> str:
    """`5 jobs, 1 failed, 1 interrupted`: an interrupted job is not a failed one."""
    statuses = [row.get("status") for row in rows]
    failed = sum(s not in ("ok", "interrupted") for s in statuses)
    interrupted = statuses.count("interrupted")
    return f"{len(rows)} jobs, {failed} failed" + (
        f", {interrupted} interrupted" if interrupted else ""
    )


# A terminal's width: the printed summary fits it (summary.md, a file, has every column).
PRINT_WIDTH = 100


def _wrapped(text: str) -> list[str]:
    import textwrap

    return textwrap.wrap(text, PRINT_WIDTH, subsequent_indent="  ", break_on_hyphens=False)


def headline(column: str) -> bool:
    """Whether a column is one a reader looks at first: the job, overrides, status, variant and
    the metrics a run's own results table shows (attngym.metrics `shown`), speed-ups included."""
    row = metric_of(column)
    return column in KEPT_COLUMNS or (row is not None and bool(row.shown))


def _fitting(rows: list[dict[str, Any]], columns: list[str]) -> tuple[list[str], list[str]]:
    """The columns of the printed table: the job, its overrides, status and variant, then the
    metrics a run's results table shows (attngym.metrics `shown`), dropped until the table fits
    PRINT_WIDTH (each failed job's error is logged under it whole): first the settings with one
    value in every job that has one (a sweep beside a failed job: its topology, transport, ...),
    then the measurements with one value, then the rightmost, so what a sweep changed and what
    it measured (fwd_ms) stay."""
    keep = [c for c in columns if headline(c)]
    dropped = [c for c in columns if not headline(c)]

    def one_value(column: str) -> bool:
        return len({repr(r.get(column)) for r in rows if r.get(column) is not None}) <= 1

    def measured(column: str) -> bool:
        row = metric_of(column)
        return row is not None and bool(row.unit)

    rightmost_first = [c for c in reversed(keep) if c not in KEPT_COLUMNS]
    order = (
        [c for c in rightmost_first if one_value(c) and not measured(c)]
        + [c for c in rightmost_first if one_value(c) and measured(c)]
        + [c for c in rightmost_first if not one_value(c)]
    )
    for column in order:
        if len(format_table(rows, keep, max_width=ERROR_WIDTH).splitlines()[0]) <= PRINT_WIDTH:
            break
        keep.remove(column)
        dropped.append(column)
    return keep, dropped


def summary_text(rows: list[dict[str, Any]], *, printed: bool = False) -> str:
    """The summary as text: job counts, the settings every job shares, the table of the
    md_columns() that vary between jobs (errors cut to ERROR_WIDTH), and for summary.md (not
    `printed`, where the log names each failed job) every error whole."""
    rows, shared_overrides = without_shared_overrides(rows)
    columns, shared = table_layout(rows, md_columns())
    lines = [f"{outcome_count(rows)}.", ""]
    if shared_overrides:
        lines += [*_wrapped(f"Overrides of every job: {printable(shared_overrides)}"), ""]
    if shared:
        settings = ", ".join(f"{k}={format_value(k, v)}" for k, v in shared.items())
        lines += [*_wrapped(f"Every job: {settings}"), ""]
    if printed:
        columns, dropped = _fitting(rows, columns)
    lines.append(format_table(rows, columns, max_width=ERROR_WIDTH))
    if printed and dropped:
        lines.append(f"({len(dropped)} more columns, the errors whole: summary.md, summary.csv)")
    failed = [row for row in rows if row.get("status") != "ok"]
    if failed and not printed:  # summary.md: every error whole, under the table
        lines += ["", "Errors:", ""]
        lines += [f"- job {row['job']}: {printable(str(row.get('error')))}" for row in failed]
    busy = [str(row.get("job")) for row in rows if timing_spread(row) is not None]
    if busy:
        lines += [
            "",
            f"Warning: timed forwards of job(s) {', '.join(busy)} spread more than "
            f"{BUSY_SPREAD:g}x (max / min):",
            "the machine was busy with other work, so their times are rough.",
        ]
    return "\n".join(lines)


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    """Every column of every row (the union of metric names, in first-seen order)."""
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=columns)
    writer.writeheader()
    for row in rows:
        writer.writerow({k: csv_cell(row.get(k)) for k in columns})
    atomic_write(path, text.getvalue())


# Text a spreadsheet runs as a formula (=HYPERLINK(...) in an error or a label, DDE's
# +cmd|...): it starts with = or @ (or a tab or CR before one), or with + or - and calls
# something. An override such as +experiment=ring_attention calls nothing and stays as typed.
FORMULA = re.compile(r"^[\t\r]*([=@]|[+-].*[(|!])", re.DOTALL)


def csv_cell(value: Any) -> Any:
    """A summary.csv cell: numbers as they are, None empty, and text that a spreadsheet would
    run as a formula (FORMULA) behind a leading apostrophe (OWASP's advice for CSV injection)."""
    if value is None:
        return ""
    if isinstance(value, str) and FORMULA.match(value):
        return f"'{value}"
    return value


def write_markdown(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """summary.md: `summary_text` under a title."""
    atomic_write(path, f"# {title}\n\n{summary_text(rows)}\n")


def plot_metric(rows: list[dict[str, Any]]) -> tuple[str, str]:
    """(metric, axis label) the plot shows: TFLOP/s when any job ran on CUDA, else the forward
    time, labelled as a CPU time (no GPU is involved)."""
    if any(row.get("device") == "cuda" and row.get("fwd_tflops") for row in rows):
        return "fwd_tflops", "forward TFLOP/s (higher is better)"
    return "fwd_ms", "forward time on CPU, ms (lower is better)"


def series_name(row: dict[str, Any]) -> str:
    """What a row's plot series is: its overrides other than seq_len, short (`causal,
    head_dim=64`), or its variant when it has none."""
    parts = []
    for override in str(row.get("overrides") or "").split():
        key, _, value = override.partition("=")
        if key.split(".")[-1] == "seq_len":
            continue
        parts.append(value if key.lstrip("+") == "attention" else f"{key.split('.')[-1]}={value}")
    return ", ".join(parts) or str(row.get("variant"))


# 20 distinct colours, and markers that cycle on a different period, so no two of 20 series
# share both colour and marker.
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "h", "*")


def write_plot(rows: list[dict[str, Any]], path: Path, title: str) -> bool:
    """summary.png (plot_png); False when no job has the plot's metric."""
    png = plot_png(rows, title)
    if png is not None:
        atomic_write(path, png)
    return png is not None


def plot_png(rows: list[dict[str, Any]], title: str) -> bytes | None:
    """The sweep's plot as PNG bytes: the plot metric per series (`series_name`), as bars when
    every job has one seq_len, else as lines over seq_len; None when no job has the metric."""
    metric, label = plot_metric(rows)
    rows, _ = without_shared_overrides(rows)
    series: dict[str, list[tuple[float, float]]] = {}
    for row in rows:
        if row.get("status") != "ok" or row.get(metric) is None or row.get("seq_len") is None:
            continue
        series.setdefault(series_name(row), []).append((float(row["seq_len"]), float(row[metric])))
    if not series:
        return None
    # A Figure of its own with the Agg canvas (as attngym.viz draws): no pyplot, no global backend.
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    colours = matplotlib.colormaps["tab20"].colors
    lengths = {x for points in series.values() for x, _ in points}
    names = sorted(series)
    if len(lengths) == 1:
        fig = Figure(figsize=(8, 1.5 + 0.35 * len(names)), dpi=110, layout="constrained")
        FigureCanvasAgg(fig)
        ax = fig.subplots()
        values = [series[n][-1][1] for n in names]  # one point each: the name holds the rest
        order = sorted(range(len(names)), key=lambda i: values[i])
        ax.barh(
            [names[i] for i in order],
            [values[i] for i in order],
            color=[colours[i % len(colours)] for i in order],
        )
        for i, rank in enumerate(order):
            text = f" {format_value(metric, values[rank])}"
            ax.annotate(text, (values[rank], i), va="center", fontsize=8)
        ax.set_xlabel(label)
        ax.set_title(f"{title}\nseq_len={int(next(iter(lengths))):,}")
        ax.grid(True, axis="x", alpha=0.3)
        ax.margins(x=0.12)
    else:
        fig = Figure(figsize=(9, 5.5), dpi=110, layout="constrained")
        FigureCanvasAgg(fig)
        ax = fig.subplots()
        for i, name in enumerate(names):
            points = sorted(series[name])
            xs, ys = zip(*points, strict=True)
            ax.plot(
                xs,
                ys,
                color=colours[i % len(colours)],
                marker=MARKERS[i % len(MARKERS)],
                label=name,
            )
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(lengths), [f"{int(x):,}" for x in sorted(lengths)])
        if metric.endswith("_ms"):
            from matplotlib.ticker import LogFormatter

            ax.set_yscale("log")  # ticks in plain numbers (300), not 3×10²
            ax.yaxis.set_major_formatter(LogFormatter())
            ax.yaxis.set_minor_formatter(LogFormatter(minor_thresholds=(2, 0.5)))
        ax.set_xlabel("seq_len")
        ax.set_ylabel(label)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        fig.legend(fontsize=8, loc="outside right upper")
    png = io.BytesIO()
    fig.savefig(png, format="png")
    return png.getvalue()


def summarize(sweep_dir: str | Path) -> list[dict[str, Any]]:
    """Write summary.csv, summary.md and summary.png into `sweep_dir`; return the rows."""
    sweep_dir = Path(sweep_dir)
    rows = collect(sweep_dir)
    if not rows:
        log.warning("no job folders in %s: nothing to summarise", sweep_dir)
        return rows
    title = f"attngym sweep {sweep_dir.name}"
    write_csv(rows, sweep_dir / "summary.csv")
    write_markdown(rows, sweep_dir / "summary.md", title)
    write_plot(rows, sweep_dir / "summary.png", title)
    write_batch_plot(sweep_dir, rows, title)
    return rows


MAX_ROWS_BYTES = 16 * 2**20  # a job's batches.csv: thousands of batches fit


def write_batch_plot(sweep_dir: Path, rows: list[dict[str, Any]], title: str) -> bool:
    """batches.png of a sweep of workload runs: each job's per-batch time against the batch's
    longest document, one line per job (`series_name`: the scheme, layout, ... it ran); False
    when no job has batches.csv."""
    import csv

    from attngym import viz
    from attngym.runner import pictures
    from attngym.workload import ROWS_FILE

    named, _ = without_shared_overrides(rows)
    series: dict[str, list[tuple[float, float]]] = {}
    time_label = ""
    for row, shown in zip(rows, named, strict=True):
        try:
            raw = read_inside(sweep_dir, Path(row["job"]) / ROWS_FILE, MAX_ROWS_BYTES)
        except (FileNotFoundError, ReadRefused):
            continue
        batches = list(csv.DictReader(io.StringIO(raw.decode("utf-8", "replace"))))
        drawn = pictures.batch_series(batches, series_name(shown), contenders=False)
        series.update(drawn["series"])
        time_label = drawn["time_label"]
    if not series:
        return False
    viz.save_batch_times(series, sweep_dir / pictures.BATCH_PICTURE, title=title,
                         time_label=time_label)  # fmt: skip
    return True


def finished_jobs(sweep_dir: str | Path, since: float) -> int:
    """How many jobs of a sweep have ended, counted from their folders (so jobs that run on other
    machines count too): those ok and complete (a resumed sweep skips them), and those whose
    metrics.json was written at or after `since` (a time of the sweep folder's file system) and
    says they ended (complete, or failed or interrupted). An older metrics.json of a job that
    did not end ok is a job the sweep runs again: not yet counted."""
    count = 0
    for job_dir in job_dirs(Path(sweep_dir)):
        metrics, _ = load_metrics(job_dir)  # polled: the summary warns about a bad one, once
        if metrics is None:
            continue
        complete, ok = metrics.get("complete") is True, metrics.get("status") == "ok"
        skipped = complete and ok  # ok before, or now
        ended_now = (complete or not ok) and (job_dir / "metrics.json").stat().st_mtime >= since
        count += skipped or ended_now
    return count


def report_stopped(sweep_dir: Path, stop: Interrupted) -> NoReturn:
    """A sweep stopped by SIGINT/SIGTERM: the summary of the jobs so far, where they are and the
    command that resumes it, then exit 128 + signal."""
    try:
        summarize(sweep_dir)
    except OSError as err:
        print(f"attngym: error: {write_error(err)}", file=sys.stderr, flush=True)
    print(f"attngym: {stop}; what was measured is in {sweep_dir}", file=sys.stderr, flush=True)
    print(f"attngym: resume with: {resume_command(sweep_dir)}", file=sys.stderr, flush=True)
    raise SystemExit(stop.exit_code)


def grid_overrides(config: Any, *, typed: bool = True) -> list[str]:
    """The overrides that define a sweep: the sweeper's params (an experiment's grid) merged
    with the command line's task overrides (the command line wins), sorted by key; as the user
    typed them (attngym.runner.overrides.as_typed), or with `typed=False` as Hydra received them."""
    params = dict(config.hydra.sweeper.get("params") or {})
    merged = {str(k): f"{k}={v}" for k, v in params.items()}
    for o in task_overrides(config.hydra):
        override = as_typed(o) if typed else o
        merged[override.split("=", 1)[0]] = override
    return [merged[k] for k in sorted(merged)]


def count_jobs(config: Any) -> int | None:
    """How many jobs the sweeper will launch for `config`: an Optuna sweeper's n_trials, the
    basic sweeper's grid (None when it cannot tell)."""
    trials = config.hydra.sweeper.get("n_trials")
    if trials is not None:
        return int(trials)
    try:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        total = 1
        grid = grid_overrides(config, typed=False)
        from hydra.core.override_parser.types import Glob

        from attngym.runner.overrides import group_options

        for override in OverridesParser.create().parse_overrides(grid):
            if isinstance(override.value(), Glob):  # group options by pattern (the gallery)
                total *= len(override.value().filter(group_options(override.key_or_group)))
            elif override.is_sweep_override():
                total *= len(list(override.sweep_string_iterator()))
        return total
    except Exception:  # counting is for the progress line only
        return None


GRID_FILE = "grid.json"


def record_grid(sweep_dir: str | Path, overrides: Sequence[str]) -> None:
    """Record the sweep's grid in sweep_dir/grid.json, or check it against the one recorded.

    A folder holds one sweep: re-running the same grid there resumes it, another grid would mix
    (and overwrite) results of two sweeps, so it is refused. The grid is recorded and compared as
    typed (attngym.runner.overrides.as_typed): a grid.json written with Hydra's forms
    (`++attention.window_size=64,128`) is the same grid.

    Raises:
        ConfigError: (hydra.sweep.dir) the folder records another grid.
        SymlinkRefused: grid.json or the folder is a symlink.
    """
    path = Path(sweep_dir) / GRID_FILE
    grid = sorted(as_typed(str(o)) for o in overrides)
    try:
        data = json.loads(read_inside(sweep_dir, GRID_FILE, OVERRIDES_LIMIT))
        recorded = data["overrides"]
        if not isinstance(recorded, list) or not all(isinstance(o, str) for o in recorded):
            raise ValueError(f'"overrides" is {json.dumps(recorded)[:40]}, not a list of text')
    except FileNotFoundError:
        recorded = None
    except (ReadRefused, ValueError, TypeError, KeyError, RecursionError) as err:
        why = err.reason if isinstance(err, ReadRefused) else f"{type(err).__name__}: {err}"
        raise ConfigError(
            "hydra.sweep.dir",
            f"{path} is not a grid attngym wrote ({why}); delete it or choose another folder",
        ) from None
    if recorded is None:
        Path(sweep_dir).mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps({"overrides": grid}, indent=2) + "\n")
    elif sorted(recorded := [as_typed(str(o)) for o in recorded]) != grid:
        was = " ".join(sorted(set(recorded) - set(grid))) or "nothing"
        now = " ".join(sorted(set(grid) - set(recorded))) or "nothing"
        raise ConfigError(
            "hydra.sweep.dir",
            f"{sweep_dir} holds a sweep of another grid (it had {was}, this one has {now}); "
            "choose another hydra.sweep.dir, or run the recorded grid to resume it",
        )


def _callback_base() -> type:
    from hydra.experimental.callback import Callback

    return Callback


def _ends_the_sweep_on_error(method: Callable[..., None]) -> Callable[..., None]:
    """A SweepSummary callback whose error ends the sweep with one line and exit code 1 (2 for a
    ConfigError): Hydra turns an Exception from a callback into a warning and goes on, so a
    sweep could otherwise end 0 with failed jobs, or run with its lock or grid unchecked."""

    @functools.wraps(method)
    def guarded(self: SweepSummary, *args: Any, **kwargs: Any) -> None:
        try:
            method(self, *args, **kwargs)
        except Exception as err:
            self._release()
            if isinstance(err, ConfigError | FolderLocked):
                line = str(err)
            elif isinstance(err, OSError):  # a full disk, a symlink where a file goes
                line = write_error(err)
            else:
                line = f"the sweep's {method.__name__} failed: {failure_text(err)}"
            print(f"attngym: error: {line}", file=sys.stderr, flush=True)
            if method.__name__ == "on_multirun_end":  # its jobs ran: say how to go on
                sweep_dir = kwargs.get("config", args[0] if args else None).hydra.sweep.dir
                print(f"attngym: resume with: {resume_command(sweep_dir)}", file=sys.stderr)
            raise SystemExit(2 if isinstance(err, ConfigError) else 1) from None

    return guarded


class SweepSummary(_callback_base()):
    """Hydra callback: progress over sweep jobs, then summarize(); a sweep with failed jobs ends
    with exit code 1, and so does one whose summary cannot be made (_ends_the_sweep_on_error).

    The process that starts the sweep holds the sweep folder's lock and the progress bar, which
    counts finished job folders (`finished_jobs`), so jobs that Hydra's submitit launcher runs
    on other machines count too. submitit pickles the callbacks with each job: a copy that
    arrives there holds none of this process's state, and does nothing.
    """

    def __init__(self) -> None:
        self._bar = None
        self._redirect = contextlib.ExitStack()
        self._lock: FolderLock | None = None
        self._ended = 0  # jobs whose end this process saw (the basic launcher's)

    def __getstate__(self) -> dict[str, Any]:
        return {}  # the bar, its timer thread and the lock stay with this process

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()

    @_ends_the_sweep_on_error
    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        from attngym.progress import Progress

        if os.environ.get("RANK", "0") == "0":  # under torchrun rank 0 speaks for the sweep
            self._lock = FolderLock(config.hydra.sweep.dir).acquire()  # held until the end
            record_grid(config.hydra.sweep.dir, grid_overrides(config))
        since = self._lock.path.stat().st_mtime if self._lock is not None else time.time()
        sweep_dir = Path(config.hydra.sweep.dir)
        self._bar = Progress(
            count_jobs(config), "sweep jobs", counted=lambda: finished_jobs(sweep_dir, since)
        )
        self._bar.recount()
        self._bar.clear()  # Hydra's "#0 : ..." line comes before the first job's log redirect

    @_ends_the_sweep_on_error
    def on_job_start(self, config: Any, **kwargs: Any) -> None:
        from attngym.progress import redirect_logging

        if self._bar is not None:
            # Hydra sets up the job's log handlers before this: route them above the bar now.
            self._redirect.enter_context(redirect_logging())
            typed = (as_typed(o) for o in task_overrides(config.hydra))
            self._bar.running(" ".join(typed) or "job")

    @_ends_the_sweep_on_error
    def on_job_end(self, config: Any, job_return: Any = None, **kwargs: Any) -> None:
        self._ended += 1
        if self._bar is not None:
            self._bar.running("")  # between jobs nothing runs
            self._bar.recount()  # redirected output: a line per finished job
            self._redirect.close()
            self._bar.clear()  # the next Hydra launch line prints outside the redirect

    @_ends_the_sweep_on_error
    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        sweep_dir = Path(config.hydra.sweep.dir)
        if os.environ.get("RANK", "0") != "0" or not sweep_dir.is_dir():
            return  # under torchrun rank 0 writes the summary
        try:
            self._summarize(sweep_dir, config.get("objective"))
        finally:
            self._release()

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _summarize(self, sweep_dir: Path, objective: Any = None) -> None:
        rows = summarize(sweep_dir)
        if not rows and self._ended:
            raise RuntimeError(
                f"{self._ended} job(s) ran and no job folder is found in {sweep_dir} "
                f"(looked {JOB_DEPTH} levels down for folders holding .hydra)"
            )
        failed = [row for row in rows if row.get("status") != "ok"]
        print(f"\n{summary_text(rows, printed=True)}\n", flush=True)  # the sweep's answer
        for row in failed:
            log.error("job %s failed: %s", row["job"], error_line(str(row.get("error"))))
        log.info(
            "sweep: %d jobs, %d failed; summary in %s",
            len(rows),
            len(failed),
            sweep_dir / "summary.md",
        )
        again = resume_command(sweep_dir)
        resume = f"resume with (jobs already ok are skipped): {again}"
        if objective:  # a tuning study: its trials are new each time, the study goes on
            write_tuned(sweep_dir, objective)
            resume = "the same command without hydra.sweep.dir continues the study"
        if failed:  # the sweep's exit code tells: Hydra lets SystemExit through
            print(
                f"attngym: {len(failed)} of {len(rows)} sweep jobs failed (see summary.md)\n"
                f"attngym: {resume}",
                file=sys.stderr,
                flush=True,
            )
            raise SystemExit(1)
        log.info("the same command resumes or re-runs this sweep (ok jobs skipped): %s", again)


def write_tuned(sweep_dir: Path, objective: Any) -> None:
    """A tuning sweep's end (`objective=`, +experiment=tune): its best validated job, by the
    first objective, into your tuned table (attngym.tuning.user_table), where `block_size=tuned`
    looks first; an entry already better (an earlier sweep of the same study) stays."""
    from attngym import tuning

    metric = objective if isinstance(objective, str) else list(objective)[0]
    path = tuning.user_table()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        table = tuning.update(sweep_dir, metric, path, keep_better=True, skip_defaults=True)
    except (OSError, ValueError) as exc:  # nothing beat the defaults, a read-only cache folder
        print(f"attngym: tuning: nothing written to {path}: {exc}", flush=True)
        return
    for gpu, entries in sorted(table.items()):
        for name, entry in sorted(entries.items()):
            if str(entry.get("source", "")).startswith(sweep_dir.name):
                print(
                    f"attngym: tuned {name} on {gpu}: block_size {entry['block_size']}, "
                    f"kernel_options {entry['kernel_options']}, {metric} {entry[metric]} "
                    f"(in {path}; block_size=tuned uses it)",
                    flush=True,
                )
