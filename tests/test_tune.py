"""The tuner end to end on CPU ranks of eager flex: Hydra's real Optuna sweeper over a user's own
mask, a study in SQLite that a second command resumes, failed trials (FLASH cannot run float32
on a CPU) never winning, the winner in the user's tuned table, and `block_size=tuned` taking it."""

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
        failed = [r for r in these if r["status"] != "ok"]
        # The only trials that fail ask for FLASH, which needs a 16-bit dtype; the exit code says.
        assert all("FLASH needs a 16-bit dtype" in r["error"] for r in failed)
        assert done.returncode == (1 if failed else 0), done.stderr[-2000:]
        rows += [r for r in these if r["status"] == "ok"]
        every += these

    import optuna

    storage = f"sqlite:///{tmp_path / 'cache' / 'attngym' / 'tune.db'}"
    (summary,) = optuna.get_all_study_summaries(storage)
    assert summary.n_trials == 7  # the second command went on with the same study
    assert summary.study_name.startswith("custom-stripes.stripes-b1h2s256d16-cpu-float32")

    # The block sizes follow the backend (attngym.tuning.block_sizes): FLASH trials never sample
    # a block size FLASH cannot run.
    backends = {"kernel_options.BACKEND=FLASH" in row["overrides"] for row in every}
    assert backends == {True, False}  # the sampler's seed draws both in these 7 trials
    for row in every:
        flash = "kernel_options.BACKEND=FLASH" in row["overrides"]
        assert ("block_size=flash" in row["overrides"]) == flash, row["overrides"]
        assert ("block_size.q=" in row["overrides"]) == (not flash), row["overrides"]

    # Every trial timed FlexAttention's defaults beside itself; only a trial that beat them can
    # win (timings of a 256-token CPU call are noise: either outcome is the rule at work).
    assert all(r["flex_default_fwd_ms"] for r in rows)
    beat = [r for r in rows if float(r["fwd_ms"]) < float(r["flex_default_fwd_ms"])]
    table_path = tmp_path / "cache" / "attngym" / "tuned.json"
    table = json.loads(table_path.read_text()) if table_path.exists() else {}
    entry = table.get("cpu", {}).get(f"{rows[0]['variant']}/d16")
    if beat:
        best = min(beat, key=lambda r: float(r["fwd_ms"]))
        assert entry["fwd_ms"] == pytest.approx(float(best["fwd_ms"]), rel=1e-3)
        assert entry["block_size"] == [int(best["block_q"]), int(best["block_kv"])]
    else:
        assert entry is None

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
