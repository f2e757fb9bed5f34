"""metrics.json (always written, atomically) and the file-only trackers `local` and `none`.

metrics.json is the contract between a run and everything after it (sweep summary, report,
resume): it is written to a temporary file and moved into place with os.replace, so a reader never
sees half a file, even when a job is killed while writing (attngym.fileio.atomic_write, which
also refuses to write through a symlink). A metrics.json that attngym could not have written
(a symlink, not a JSON object, a metric of the wrong type: `load_metrics`) counts as missing:
its job is incomplete, and a resumed sweep runs it again.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from attngym import registry
from attngym.fileio import ReadRefused, atomic_write, read_inside, remove_stale_tmps
from attngym.metrics import (
    CI_SUFFIX,
    format_value,
    markdown_cell,
    metric_of,
    printable,
    shortened,
)

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.json"
# Far above any real metrics.json (a few KiB): a larger file is not read.
METRICS_LIMIT = 16 << 20


@dataclasses.dataclass(kw_only=True)
class RunRecord:
    """What a finished run hands to a tracker.

    Attributes:
        run_dir: the run's output folder.
        metrics: flat metrics (names: the table of attngym.metrics), status included.
        config: the resolved config as plain data.
        images: picture name → PNG path (heatmap, block_mask) for pictures that exist.
        name: a readable run name (the overrides that make this run different).
        group: the sweep folder (or run folder) name, to group runs of one sweep.
        job_type: the topology kind.
    """

    run_dir: Path
    metrics: dict[str, Any]
    config: dict[str, Any]
    images: dict[str, Path]
    name: str
    group: str
    job_type: str


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    return str(value)


def write_metrics(run_dir: str | Path, metrics: Mapping[str, Any]) -> Path:
    """Write `metrics` to run_dir/metrics.json atomically; remove temporaries of dead writers.

    Raises:
        SymlinkRefused: metrics.json or run_dir is a symlink.
        OSError: the write failed; the previous metrics.json (if any) is intact.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_tmps(run_dir)
    text = json.dumps(_json_safe(dict(metrics)), indent=2, sort_keys=False) + "\n"
    return atomic_write(run_dir / METRICS_FILE, text)


def read_metrics(run_dir: str | Path) -> dict[str, Any] | None:
    """The run's metrics.json, or None (with a warning naming the file and what is wrong, unless
    it is simply missing) when it cannot count: the run is then incomplete (see load_metrics)."""
    metrics, problem = load_metrics(run_dir)
    if problem is not None:
        log.warning("%s: %s; the run counts as incomplete", Path(run_dir) / METRICS_FILE, problem)
    return metrics


def load_metrics(run_dir: str | Path) -> tuple[dict[str, Any] | None, str | None]:
    """(metrics, None) for a metrics.json that attngym could have written; (None, None) when
    there is none; (None, what is wrong) otherwise: not a regular file inside the run folder
    (a symlink, a FIFO), larger than METRICS_LIMIT, not standard JSON (Infinity is not: attngym
    writes non-finite numbers as "nan"/"inf"), nested too deep, not an object, or a value of the
    wrong type (a metric with a unit that is not a number, a status that is not text)."""
    try:
        raw = read_inside(run_dir, METRICS_FILE, METRICS_LIMIT)
    except FileNotFoundError:
        return None, None
    except ReadRefused as err:
        return None, f"unreadable ({err.reason})"
    try:
        data = json.loads(raw, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as err:
        why = "nested too deep" if isinstance(err, RecursionError) else err
        return None, f"unreadable ({why})"
    if not isinstance(data, dict):
        return None, f"holds a JSON {type(data).__name__}, not an object"
    wrong = _wrong_value(data)
    return (None, wrong) if wrong else (data, None)


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not standard JSON")


# Values of metrics with a unit that are not numbers: what _json_safe writes for non-finite ones.
NONFINITE = ("nan", "inf", "-inf")


def _wrong_value(data: Mapping[str, Any]) -> str | None:
    """What in a metrics.json no reader can use, naming the key; None when nothing is."""
    checks = {
        "status": (lambda v: isinstance(v, str), "text"),
        "error": (lambda v: v is None or isinstance(v, str), "text or null"),
        "complete": (lambda v: isinstance(v, bool), "true or false"),
        "overrides": (
            lambda v: isinstance(v, list) and all(isinstance(o, str) for o in v),
            "a list of text",
        ),
    }
    for key, value in data.items():
        check, allowed = checks.get(key, (None, ""))
        if check is None and key.endswith(CI_SUFFIX):  # a ratio's interval
            check, allowed = _is_interval, "[lo, hi] (two numbers) or null"
        if check is None and (row := metric_of(key)) is not None and row.unit:
            check, allowed = _is_number, f"a number ({row.unit})"
        if check is not None and not check(value):
            return f"{key} is {shortened(json.dumps(value), 40)}, not {allowed}"
    return None


def _is_number(value: Any) -> bool:
    number = isinstance(value, int | float) and not isinstance(value, bool)
    return value is None or number or value in NONFINITE


def _is_interval(value: Any) -> bool:
    pair = isinstance(value, list) and len(value) == 2
    return value is None or (pair and all(v is not None and _is_number(v) for v in value))


def record_failure(
    run_dir: Path, overrides: Sequence[str], reason: str, status: str = "failed"
) -> None:
    """A job a launcher could not run, or that ended without a result: its metrics.json says it
    failed and why (keeping what it measured, unless it ended ok and complete), with
    .hydra/overrides.yaml so that the sweep summary lists a job that never ran. A write that
    fails is logged: the summary still counts the job as not done."""
    import yaml

    from attngym.fileio import write_error
    from attngym.runner.overrides import as_typed

    metrics = read_metrics(run_dir) or {}
    if metrics.get("status") == "ok" and metrics.get("complete") is True:
        return
    metrics.update(
        status=status, error=reason, overrides=[as_typed(o) for o in overrides], complete=False
    )
    hydra_dir = Path(run_dir) / ".hydra"
    try:
        write_metrics(run_dir, metrics)
        if not os.path.lexists(hydra_dir / "overrides.yaml"):
            hydra_dir.mkdir(parents=True, exist_ok=True)
            atomic_write(hydra_dir / "overrides.yaml", yaml.safe_dump(list(overrides)))
    except OSError as err:
        log.error("%s: %s", run_dir, write_error(err))


def scalar_metrics(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """The metrics whose values are numbers, strings, booleans or None (what trackers log)."""
    return {
        k: v for k, v in metrics.items() if isinstance(v, str | int | float | bool) or v is None
    }


class NoneTracker:
    """Logs nothing (metrics.json is written by the caller in any case)."""

    def log_run(self, record: RunRecord) -> None:
        """Do nothing."""


class LocalTracker:
    """Adds results.md, a two-column table of the run's metrics, next to metrics.json."""

    def log_run(self, record: RunRecord) -> None:
        """Write run_dir/results.md, values as the sweep summary shows them (MiB, 3 figures)."""
        lines = [f"# {printable(record.name)}", "", "| metric | value |", "|---|---|"]
        lines += [
            f"| {k} | {markdown_cell(format_value(k, v))} |"
            for k, v in scalar_metrics(record.metrics).items()
        ]
        lines += [""] + [f"![{n}]({p.name})" for n, p in record.images.items()]
        atomic_write(Path(record.run_dir) / "results.md", "\n".join(lines) + "\n")


@registry.register("tracker", "none")
def none_tracker() -> NoneTracker:
    """Nothing besides metrics.json."""
    return NoneTracker()


@registry.register("tracker", "local")
def local_tracker() -> LocalTracker:
    """metrics.json plus results.md."""
    return LocalTracker()
