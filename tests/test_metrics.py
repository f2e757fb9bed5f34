"""The metric schema: pass metrics from timings; the schema imports without torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from attngym.config import Shape
from attngym.metrics import pass_metrics


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
