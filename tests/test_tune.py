"""The tuner end to end on CPU ranks of eager flex: Hydra's real Optuna sweeper over a user's own
mask, a study in SQLite that a second command resumes, trials of what can run here only (block
sizes on a CPU: no FLASH, no Triton kernel options), the winner in the user's tuned table, and
`block_size=tuned` taking it."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from attngym import tuning

pytest.importorskip("hydra_plugins.hydra_optuna_sweeper", reason="pip install 'attngym[tune]'")

SMOKE = [
    *("device=cpu", "shape.batch=1", "shape.heads=2", "shape.seq_len=256", "shape.head_dim=16"),
    *("objective=fwd_ms", "validate_rows=8", "benchmark.warmup=0", "benchmark.repeats=2"),
]
MASK = ["attention=custom", "attention.mask_mod=stripes.stripes"]


def _attngym(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    path = os.pathsep.join(p for p in (str(tmp), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp / "cache"), "PYTHONPATH": path,
           "ATTNGYM_PROGRESS": "0"}  # fmt: skip
    return subprocess.run(
        [sys.executable, "-m", "attngym", *args], cwd=tmp, env=env, capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip


def _rows(sweep: Path) -> list[dict[str, str]]:
    with (sweep / "summary.csv").open(newline="") as f:
        return list(csv.DictReader(f))


def test_a_study_over_your_own_mask_resumes_and_block_size_tuned_takes_its_winner(tmp_path):
    (tmp_path / "stripes.py").write_text(
        textwrap.dedent("""
            def stripes(b, h, q_idx, kv_idx):
                return (q_idx >= kv_idx) & ((q_idx - kv_idx) % 7 != 3)
        """)
    )
    rows, every = [], []
    for n, trials in enumerate((4, 3)):
        sweep = tmp_path / f"sweep{n}"
        done = _attngym(tmp_path, "+experiment=tune", *SMOKE, *MASK,
                        f"hydra.sweeper.n_trials={trials}", f"hydra.sweep.dir={sweep}")  # fmt: skip
        these = _rows(sweep)
        assert len(these) == trials, done.stderr[-2000:]
        # A CPU runs eager flex: every trial can run, none asks for FLASH or Triton's options.
        assert [r["status"] for r in these] == ["ok"] * trials, done.stderr[-2000:]
        assert done.returncode == 0, done.stderr[-2000:]
        rows += [r for r in these if r["status"] == "ok"]
        every += these

    import optuna

    storage = f"sqlite:///{tmp_path / 'cache' / 'attngym' / 'tune.db'}"
    (summary,) = optuna.get_all_study_summaries(storage)
    assert summary.n_trials == 7  # the second command went on with the same study
    assert summary.study_name.startswith("custom-stripes.stripes-b1h2s256d16-cpu-float32")

    # What a CPU trial draws (attngym.runner.tune_search.search_space): the block sizes, nothing
    # else.
    for row in every:
        drawn = sorted(o.split("=")[0] for o in row["overrides"].split() if "block_size" in o
                       or "kernel_options" in o)  # fmt: skip
        assert drawn == ["block_size.kv", "block_size.q"], row["overrides"]

    # Every trial timed FlexAttention's defaults beside itself; only a trial that beat them can
    # win (timings of a 256-token CPU call are noise: either outcome is the rule at work).
    # (a trial that draws the defaults themselves is its own: the baseline says so and is skipped)
    for r in rows:
        defaults = r["block_q"] == r["block_kv"] == "128"
        assert bool(r["flex_default_fwd_ms"]) != defaults, r
        assert defaults == r["flex_default_status"].startswith("skipped: flex already runs"), r
    # The table holds a configuration that beat the defaults in its own sweep, by its median.
    table_path = tmp_path / "cache" / "attngym" / "tuned.json"
    table = json.loads(table_path.read_text()) if table_path.exists() else {}
    entry = table.get("cpu", {}).get(f"{rows[0]['variant']}/d16")
    if entry is not None:
        assert entry["block_size"] != list(tuning.DEFAULT_BLOCK_SIZE)  # the defaults never win
        runs = [r for r in rows if [int(r["block_q"]), int(r["block_kv"])] == entry["block_size"]]
        assert entry["fwd_ms"] < max(float(r["flex_default_fwd_ms"]) for r in runs)
    else:  # and the command said why, in one line
        assert "nothing beat" in done.stdout or "beat FlexAttention's defaults" in done.stdout

    run = tmp_path / "run"
    done = _attngym(tmp_path, *SMOKE, *MASK, "block_size=tuned", "logger=none",
                    f"hydra.run.dir={run}")  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    metrics = json.loads((run / "metrics.json").read_text())
    expected = entry["block_size"] if entry else list(tuning.DEFAULT_BLOCK_SIZE)
    assert [metrics["block_q"], metrics["block_kv"]] == expected
    for name, value in (entry or {}).get("kernel_options", {}).items():
        assert metrics[f"kernel_options.{name}"] == value


def test_objective_names_a_numeric_metric(tmp_path):
    done = _attngym(tmp_path, "objective=variant", "device=cpu")
    assert done.returncode == 2
    assert done.stderr.strip().endswith(
        "attngym: error: objective: 'variant' is no numeric metric; e.g. fwd_bwd_ms, fwd_ms, "
        "first_call_s"
    )
