"""A workload run: every batch of packed documents attended as a run of its own, then summed up.

`workload=documents` makes a stream of batches (attngym.workload, through config.workload_batches);
each batch is the config's run with that batch's documents (variants.spec.with_documents): built,
validated against float64 and timed by the topology's own task, its contenders beside it, so a
batch row holds what a one-batch run reports. The rows go to `batches.csv` in the run folder; the
run's metrics hold the workload's aggregates: for each number of metrics.WORKLOAD_AGGREGATES,
`<metric>_mean`, `_p50`, `_p95` and `_max` over the batches (and the plain `<metric>`, their
mean, so that sweep tables read a workload run as they read any), `workload_batches` and the
tokens per second of the whole workload. A batch that fails validation fails the run, naming it.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import logging
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from attngym import workload
from attngym.fileio import atomic_write
from attngym.metrics import WORKLOAD_AGGREGATES
from attngym.runner.config import Settings, Workload, workload_batches
from attngym.variants.spec import build_variant, with_documents
from attngym.workload import ROWS_FILE

log = logging.getLogger(__name__)


def run(
    settings: Settings,
    run_dir: Path | None,
    metrics: dict[str, Any],
    one_batch: Callable[[Settings, Path, dict[str, Any]], dict[str, Any]],
) -> dict[str, Any]:
    """Every batch of the settings' workload through `one_batch` (a task's run), the rows in
    batches.csv (none without a run folder: a rank other than 0), the aggregates into `metrics`
    (filled as batches finish: a stopped run keeps what it had)."""
    spec = settings.workload
    data = {"workload": dataclasses.asdict(spec), "shape": {"seq_len": settings.shape.seq_len}}
    lengths = workload_batches(data)
    described = settings.describe()
    metrics.update(described)
    metrics.update(workload=spec.name, workload_distribution=spec.distribution,
                   workload_batches=len(lengths))  # fmt: skip
    rows: list[dict[str, Any]] = []
    once = _SaidOnce()
    # A logger's filter sees only its own records: every attngym logger gets it.
    loggers = [logging.getLogger(name) for name in list(logging.Logger.manager.loggerDict)
               if name.startswith("attngym.")]  # fmt: skip
    for logger in loggers:
        logger.addFilter(once)
    try:
        _run_batches(settings, run_dir, metrics, one_batch, lengths, described, rows)
    finally:
        for logger in loggers:
            logger.removeFilter(once)
    return metrics


def _run_batches(settings, run_dir, metrics, one_batch, lengths, described, rows) -> None:
    """run's loop: a batch at a time, its row written and the aggregates updated after it."""
    for index, docs in enumerate(lengths):
        batch = batch_settings(settings, docs, index)
        row = {"batch": index, **workload.summary(docs)}
        start = time.perf_counter()
        out = one_batch(batch, run_dir, {})
        row["batch_s"] = time.perf_counter() - start
        row.update({k: v for k, v in out.items() if k not in described})
        row.update(_kept_tflops(out, settings))
        rows.append(row)
        log.info("batch %d of %d: %d documents, longest %d: %s", index + 1, len(lengths),
                 len(docs), max(docs), _brief(row))  # fmt: skip
        if run_dir is not None:
            _write_rows(run_dir, rows)
        metrics.update(aggregate(rows, settings))


class _SaidOnce(logging.Filter):
    """A message a batch logs that an earlier batch logged word for word (a contender skipped
    for the same reason) is not printed again."""

    def __init__(self) -> None:
        super().__init__()
        self._seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if text in self._seen:
            return False
        self._seen.add(text)
        return True


def batch_settings(settings: Settings, docs: tuple[int, ...], index: int) -> Settings:
    """The settings of one batch: its documents in the attention entry, its variant built, the
    profiler on the first batch only (one profile.json)."""
    entry = with_documents(settings.attention, docs)
    variant = build_variant(entry, seq_len=settings.shape.seq_len, heads=settings.shape.heads)
    profiler = settings.profiler if index == 0 else "none"
    return dataclasses.replace(settings, attention=entry, variant=variant, profiler=profiler,
                               workload=Workload())  # fmt: skip


def _kept_tflops(out: dict[str, Any], settings: Settings) -> dict[str, float]:
    """`<pass>_kept_tflops`: the FLOPs the batch's mask keeps over each pass's time, so batches
    of different documents are judged on the work they need (not on the blocks computed)."""
    from attngym.bench import tflops
    from attngym.metrics import pass_flops

    density = out.get("mask_density")
    if density is None:
        return {}
    flops = pass_flops(settings.shape, settings.shape.seq_len, 1.0 - density)
    return {f"{p}_kept_tflops": tflops(flops[p], out[f"{p}_ms"]) for p in ("fwd", "fwd_bwd")
            if out.get(f"{p}_ms")}  # fmt: skip


def aggregate(rows: list[dict[str, Any]], settings: Settings) -> dict[str, Any]:
    """The workload's metrics from its batch rows (module docstring)."""
    out: dict[str, Any] = {"workload_batches_done": len(rows)}
    for name in WORKLOAD_AGGREGATES:
        values = [r[name] for r in rows if isinstance(r.get(name), int | float)]
        if not values:
            continue
        ordered = sorted(values)
        out[name] = out[f"{name}_mean"] = statistics.fmean(values)
        out[f"{name}_p50"] = statistics.median(values)
        out[f"{name}_p95"] = ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]
        out[f"{name}_max"] = ordered[-1]
    timed = "fwd_bwd_ms" if any(r.get("fwd_bwd_ms") for r in rows) else "fwd_ms"
    total_ms = sum(r.get(timed) or 0.0 for r in rows)
    tokens = len(rows) * settings.shape.batch * settings.shape.seq_len
    out["tokens_per_s"] = tokens / (total_ms / 1e3) if total_ms else None
    failed = [(r["batch"], r["validation"]) for r in rows
              if str(r.get("validation", "")).startswith("failed")]  # fmt: skip
    if failed:
        out["validation"] = f"failed: batch {failed[0][0]}: {failed[0][1]}" + (
            f" (and {len(failed) - 1} more batches)" if len(failed) > 1 else ""
        )
    elif rows:
        out["validation"] = str(rows[-1].get("validation", "not run"))
    return out


def _brief(row: dict[str, Any]) -> str:
    shown = [f"{k} {row[k]:.3g}" for k in ("fwd_bwd_ms", "fwd_ms", "efficiency_fwd_bwd")
             if isinstance(row.get(k), int | float)]  # fmt: skip
    return ", ".join([*shown, f"validation {row.get('validation', 'not run')}"])


def _write_rows(run_dir: Path, rows: list[dict[str, Any]]) -> None:
    """batches.csv: one row a batch, every key any batch reported (a written run keeps them)."""
    columns = list(dict.fromkeys(k for r in rows for k in r))
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=columns)
    writer.writeheader()
    writer.writerows(rows)
    atomic_write(Path(run_dir) / ROWS_FILE, text.getvalue())
