"""The metric schema: the names every task reports and the tables and trackers read.

A single-device run and a context-parallel run of one config must land in the same columns of a
sweep summary, so the names are defined here once and both the tasks (which fill them) and
attngym.tracking (which tabulates them) import them, with `format_value`, how a value reads in
every table (results.md, summary.md, report.html). `import attngym.metrics` pulls in no torch:
the sweep summary reads metric names in processes that never attend.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

# Metric names every task reports (values may be None where a quantity does not apply).
METRIC_NAMES = (
    "status",
    "error",
    "variant",
    "topology",
    "world_size",
    "transport",
    "device",
    "device_name",
    "dtype",
    "batch",
    "heads",
    "kv_heads",
    "seq_len",
    "head_dim",
    "block_q",
    "block_kv",
    "sparsity",
    "fwd_ms",
    "fwd_ms_min",
    "fwd_ms_max",
    "bwd_ms",
    "fwd_bwd_ms",
    "fwd_tflops",
    "bwd_tflops",
    "fwd_bwd_tflops",
    "compile_s",
    "peak_mem_bytes",
    "err_out_max_abs",
    "err_out_rel",
    "err_lse_max_abs",
    "err_dq_rel",
    "err_dk_rel",
    "err_dv_rel",
    "validated_rows",
    "validation",
    "bwd_status",
)

# The flex_over_<baseline>_<pass> ratios worth a column in results tables (every other ratio is
# in metrics.json): flex against the fastest SDPA, a dense-mask SDPA and flex untuned.
HEADLINE_BASELINES = ("best_sdpa", "sdpa_dense_mask", "flex_default")
HEADLINE_RATIOS = tuple(
    f"flex_over_{b}_{p}" for b in HEADLINE_BASELINES for p in ("fwd", "bwd", "fwd_bwd")
)


# What a context-parallel run adds to a results table: how it scaled, where the time went, and
# how it compares with PyTorch's own flex context parallelism (torch_cp) in time and memory.
CP_COLUMNS = (
    "layout",
    "load_imbalance",
    "efficiency",
    "efficiency_fwd_bwd",
    "single_fwd_ms",
    "single_fwd_bwd_ms",
    "step_compute_ms",
    "step_transfer_ms",
    "torch_cp_fwd_ms",
    "torch_cp_fwd_bwd_ms",
    "attngym_over_torch_cp_fwd",
    "attngym_over_torch_cp_fwd_bwd",
    "torch_cp_peak_mem_bytes",
    "torch_cp_status",
)


def table_columns() -> tuple[str, ...]:
    """Columns of a results table (summary.md, report.html): every METRIC_NAMES entry, the
    context-parallel columns, then the headline ratios, the error last. Tables show those present
    in at least one row."""
    return (*(n for n in METRIC_NAMES if n != "error"), *CP_COLUMNS, *HEADLINE_RATIOS, "error")


def baseline_metric(baseline: str, pass_name: str, what: str) -> str:
    """`<baseline>_<pass>_<what>`, e.g. sdpa_fwd_ms, sdpa_dense_mask_fwd_tflops."""
    return f"{baseline}_{pass_name}_{what}"


def speedup_metric(baseline: str, pass_name: str) -> str:
    """`flex_over_<baseline>_<pass>`: baseline time / flex time (> 1: flex is faster)."""
    return f"flex_over_{baseline}_{pass_name}"


# The timed passes and the attention passes each is made of.
PASS_PARTS = {"fwd": ("fwd",), "bwd": ("bwd",), "fwd_bwd": ("fwd", "bwd")}


def pass_flops(shape: Any, seq_len: int, sparsity: float) -> dict[str, float]:
    """Useful FLOPs of each pass ("fwd", "bwd", "fwd_bwd") for the whole problem.

    Args:
        shape: the run's shape, anything with batch, heads and head_dim (attngym.config.Shape).
        seq_len: S for both q and kv.
        sparsity: fraction of blocks the block mask skips (their FLOPs are not counted).
    """
    from attngym import bench

    return {
        p: bench.attention_flops(
            shape.batch,
            shape.heads,
            seq_len,
            seq_len,
            shape.head_dim,
            sparsity=sparsity,
            passes=parts,
        )
        for p, parts in PASS_PARTS.items()
    }


def pass_metrics(
    timings: Mapping[str, Any], shape: Any, seq_len: int, sparsity: float
) -> dict[str, Any]:
    """fwd_ms, fwd_ms_min, fwd_ms_max, bwd_ms, fwd_bwd_ms and <pass>_tflops from timings.

    Args:
        timings: {"fwd": Timing, "bwd": Timing, "fwd_bwd": Timing} (attngym.bench.time_fn
            results); a missing pass gives None metrics.
        shape, seq_len, sparsity: as in pass_flops.
    """
    from attngym import bench

    flops = pass_flops(shape, seq_len, sparsity)
    metrics: dict[str, Any] = {}
    for p in PASS_PARTS:
        timing = timings.get(p)
        metrics[f"{p}_ms"] = timing.median_ms if timing else None
        metrics[f"{p}_tflops"] = bench.tflops(flops[p], timing.median_ms) if timing else None
    fwd = timings.get("fwd")
    metrics["fwd_ms_min"] = fwd.min_ms if fwd else None
    metrics["fwd_ms_max"] = fwd.max_ms if fwd else None
    return metrics


def format_value(column: str, value: Any) -> str:
    """A metric as a person reads it: bytes in MiB/GiB, times to 3 significant figures, TFLOP/s
    to one decimal (from 0.1 up), other floats to 3 significant figures; None is empty.
    summary.csv keeps the raw numbers."""
    if value is None:
        return ""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if column.endswith("_bytes") or column == "bytes_moved":
        from attngym.estimate import format_bytes

        return format_bytes(value)
    if column.endswith("_tflops") and abs(value) >= 0.1:
        return f"{value:.1f}"  # below 0.1 (a CPU), 3 significant figures say more than 0.0
    if isinstance(value, float):
        if value == 0.0 or not math.isfinite(value):
            return f"{value:g}"
        digits = max(0, 2 - math.floor(math.log10(abs(value))))  # 3 significant, no exponent
        return f"{value:.{digits}f}" if abs(value) >= 1e-3 else f"{value:.2e}"
    return str(value)
