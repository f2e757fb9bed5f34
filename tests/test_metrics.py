"""The metric table: every key a task writes has a row, rows are complete, the docs' metric pages
are rendered from it; pass metrics from timings; the table imports without torch."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from attngym.metrics import (
    HEADLINE_BASELINES,
    METRICS,
    PASSES,
    PLACEHOLDERS,
    label,
    metric_of,
    pass_metrics,
    table_columns,
    unknown_keys,
)
from attngym.runner.config import Shape


def test_pass_metrics_from_timings():
    from attngym.bench import Timing, attention_flops

    shape = Shape(batch=1, heads=2, seq_len=128, head_dim=16)
    m = pass_metrics({"fwd": Timing.from_times([1.0, 2.0, 4.0])}, shape, 128, 0.25)
    flops = attention_flops(1, 2, 128, 128, 16, sparsity=0.25)
    assert m["fwd_ms"] == 2.0 and m["fwd_ms_min"] == 1.0 and m["fwd_ms_max"] == 4.0
    assert m["fwd_tflops"] == pytest.approx(flops / 2e-3 / 1e12)
    assert m["bwd_ms"] is None and m["fwd_bwd_tflops"] is None


def test_metric_schema_imports_without_torch():
    code = "import sys, json, attngym.metrics; print(json.dumps('torch' in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) is False


# --- the metric table ------------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]
# Keys the run layer (attngym.runner.job) adds to a task's metrics in metrics.json.
RUN_LAYER_KEYS = (
    "status",
    "error",
    "overrides",
    "complete",
    "attngym_version",
    "code_sources",
    "code_fingerprint",
    "callbacks_read",
)


def _unknown(keys):
    return sorted(k for k in keys if metric_of(k) is None)


def test_every_row_is_complete_and_names_one_thing():
    names = [m.name for m in METRICS]
    assert len(names) == len(set(names)), "a metric has two rows"
    for m in METRICS:
        assert m.label and m.meaning and m.shown in ("run", "cp", ""), m
        placeholders = set(re.findall(r"<(\w+)>", m.name))
        assert placeholders <= set(PLACEHOLDERS), m.name
        # the label names the family's placeholders, and only those
        assert set(re.findall(r"{(\w+)}", m.label)) <= placeholders, m.label
        if m.is_family:
            assert m.pattern.match(m.name) is None  # `<` never matches a placeholder


@pytest.mark.parametrize(
    ("key", "row", "text"),
    [
        ("fwd_ms", "fwd_ms", "fwd (ms)"),
        ("bwd_status", "bwd_status", "bwd"),  # a name before a family (<baseline>_status)
        ("fwd_bwd_ms", "fwd_bwd_ms", "fwd+bwd (ms)"),  # not <baseline>_<pass>_ms
        ("torch_cp_fwd_bwd_ms", "torch_cp_<pass>_ms", "torch_cp fwd+bwd (ms)"),
        ("sdpa_dense_mask_fwd_bwd_ms", "<baseline>_<pass>_ms", "sdpa_dense_mask fwd+bwd (ms)"),
        (
            "flex_over_best_sdpa_fwd",
            "flex_over_<headline>_<pass>",
            "flex speed-up vs best_sdpa fwd",
        ),
        (
            "flex_over_sdpa_flash_bwd",
            "flex_over_<baseline>_<pass>",
            "flex speed-up vs sdpa_flash bwd",
        ),
        ("kernel_options.BLOCK_M", "kernel_options.<NAME>", "kernel option BLOCK_M"),
    ],
)
def test_keys_find_their_row_and_label(key, row, text):
    assert metric_of(key).name == row
    assert label(key) == text


def test_unknown_keys_have_no_row():
    assert metric_of("fwd_msec") is None and label("fwd_msec") == "fwd_msec"
    assert unknown_keys(["fwd_ms", "fwd_msec"]) == ["fwd_msec"]


def test_columns_are_the_column_rows_in_table_order_error_last():
    columns = table_columns()
    assert columns[0] == "status" and columns[-1] == "error"
    assert (
        columns.index("fwd_ms")
        < columns.index("efficiency")
        < columns.index("flex_over_best_sdpa_fwd")
    )
    assert "capability" not in columns and "overrides" not in columns  # column=False rows
    assert {f"flex_over_{b}_{p}" for b in HEADLINE_BASELINES for p in PASSES} <= set(columns)
    assert all(metric_of(c) is not None and metric_of(c).column for c in columns)


def test_every_key_the_single_task_writes_is_in_the_table(tmp_path):
    from attngym.runner.config import Benchmark, Settings
    from attngym.runner.tasks import single

    settings = Settings(
        attention={"name": "causal"},
        shape=Shape(batch=1, heads=2, kv_heads=1, seq_len=128, head_dim=16),
        benchmark=Benchmark(warmup=0, repeats=1),
        device="cpu",
        dtype="float32",
        block_size=(64, 64),
        baselines=("sdpa", "sdpa_cudnn", "sdpa_dense_mask", "flex_default"),
        validate_rows=16,
    )
    metrics = single.run(settings, tmp_path)
    assert metrics["sdpa_status"] == "ok" and "flex_over_best_sdpa_fwd" in metrics  # families ran
    assert _unknown([*metrics, *RUN_LAYER_KEYS]) == []


def test_every_key_the_cp_task_writes_is_in_the_table(tmp_path):
    """ring on 2 gloo ranks with the torch_cp baseline (the cheap settings of
    tests/distributed/test_cp_task.py); every topology's own keys from its spec."""
    from attngym import registry
    from attngym.runner.config import Benchmark, Settings, Topology

    settings = Settings(
        attention={"name": "causal"},
        device="cpu",
        shape=Shape(batch=1, heads=2, seq_len=512, head_dim=8),
        topology=Topology(kind="ring", world_size=2),
        benchmark=Benchmark(warmup=0, repeats=1),
        baselines=("torch_cp",),
        validate_rows=32,
    )
    metrics = registry.get("task", "ring")(settings, tmp_path)
    assert metrics["validation"] == "ok" and metrics["torch_cp_status"] == "ok"
    assert _unknown(metrics) == []
    for kind in registry.names("topology"):
        spec = registry.get("topology", kind)
        if not spec.chooses:  # auto's run reports its pick's options, not its own
            assert _unknown(spec.option_values({})) == []


def test_described_kernel_options_are_in_the_table():
    from attngym.runner.config import Settings

    described = Settings(attention={"name": "causal"}, kernel_options={"BLOCK_M": 64}).describe()
    assert "kernel_options.BLOCK_M" in described and _unknown(described) == []


def _render_metrics():
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import render_metrics
    finally:
        sys.path.remove(str(REPO / "scripts"))
    return render_metrics


def test_the_docs_pages_are_rendered_from_the_table():
    render_metrics = _render_metrics()
    assert render_metrics.stale() == [], "run: python scripts/render_metrics.py"
    pages = "".join(page.read_text() for page in render_metrics.rendered())
    for m in METRICS:  # each row once, on one page
        assert pages.count(f"| `{m.name}` |") == 1, m.name


def test_a_row_changed_in_the_table_makes_its_page_stale(monkeypatch):
    import attngym.metrics

    render_metrics = _render_metrics()
    changed = tuple(
        dataclasses.replace(m, meaning="a meaning no page has") if m.name == "fwd_ms" else m
        for m in METRICS
    )
    monkeypatch.setattr(attngym.metrics, "METRICS", changed)
    assert render_metrics.stale() == ["docs/metrics.md"]


def test_an_error_line_is_the_first_line_of_a_compilers_pages():
    from attngym.metrics import error_line

    inductor = "LoweringException: NoValidChoicesError: No choices\n  target: flex\n" + "x" * 5000
    assert error_line(inductor) == "LoweringException: NoValidChoicesError: No choices"
    assert error_line("\n  boom\tat\x1b[31m red") == "boom at\\x1b[31m red"
    assert len(error_line("y" * 1000)) == 300 and error_line("y" * 1000).endswith("...")
