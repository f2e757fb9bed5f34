"""metrics.json (always written, atomically) and the file-only trackers `local` and `none`.

metrics.json is the contract between a run and everything after it (sweep summary, report,
resume): it is written to a temporary file and moved into place with os.replace, so a reader never
sees half a file, even when a job is killed while writing (attngym.fileio.atomic_write, which
also refuses to write through a symlink). A metrics.json that cannot be read or is not a JSON
object counts as missing: its job is incomplete.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from attngym import registry
from attngym.fileio import atomic_write, remove_stale_tmps
from attngym.metrics import format_value

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.json"


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
    """The run's metrics.json, or None (with a warning unless it is simply missing) when it is
    missing, unreadable, not JSON, or not a JSON object: the run counts as incomplete."""
    path = Path(run_dir) / METRICS_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        log.warning("%s is unreadable (%s); the run counts as incomplete", path, err)
        return None
    if not isinstance(data, dict):
        log.warning(
            "%s holds a JSON %s, not an object; the run counts as incomplete",
            path,
            type(data).__name__,
        )
        return None
    return data


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
        lines = [f"# {record.name}", "", "| metric | value |", "|---|---|"]
        lines += [
            f"| {k} | {format_value(k, v)} |" for k, v in scalar_metrics(record.metrics).items()
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
