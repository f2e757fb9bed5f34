"""`topology=auto` and simulated runs are never silent, keep what they had when interrupted, and
on a CPU say plainly that their device is not the fabric's."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time

import pytest

from attngym import progress

AUTO = [
    "topology=auto",
    "topology.simulate=true",
    "topology.world_size=2",
    "attention=document",
    "shape.heads=2",
    "shape.head_dim=16",
    "logger=none",
    "benchmark.repeats=1",
    "benchmark.warmup=0",
]


def test_auto_says_each_candidate_the_best_so_far_and_the_time_left(tmp_path, attngym_cli):
    run = tmp_path / "run"
    done = attngym_cli([*AUTO, "shape.seq_len=512", f"hydra.run.dir={run}"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads((run / "metrics.json").read_text())
    said = done.stdout + done.stderr  # Hydra's console log goes to stdout
    lines = re.findall(r"topology=auto candidates: (\d+)/(\d+) done(.*)", said)
    steps = [int(i) for i, _, _ in lines]
    # output redirected: a line for each candidate simulated, i of N
    assert sorted(set(steps)) == list(range(1, metrics["auto_simulated"] + 1)), said
    assert steps.count(metrics["auto_simulated"]) == 1  # the last line once
    assert int(lines[-1][1]) == metrics["auto_planned"] == metrics["auto_simulated"]
    assert all("best so far" in rest for i, _, rest in lines if int(i) > 0)
    assert any("ETA" in rest for _, _, rest in lines)
    best = metrics["auto_best_so_far"]
    assert best.startswith(metrics["auto_pick"].rsplit("/", 1)[0])
    assert metrics["auto_candidates"] >= metrics["auto_simulated"] - len(
        json.loads((run / "auto.json").read_text())["left_out"]
    )


def test_an_interrupted_choice_records_the_candidates_it_had(tmp_path):
    run = tmp_path / "run"
    args = [*AUTO, "shape.seq_len=2048", f"hydra.run.dir={run}"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "attngym", *args],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        for line in proc.stdout:  # the first candidate done, then Ctrl-C
            if re.search(r"topology=auto candidates: [1-9]\d*/\d+ done", line):
                break
            assert time.monotonic() < deadline, "no candidate finished"
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, rest[-2000:]
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["status"] == "interrupted"
    assert 1 <= metrics["auto_simulated"] < metrics["auto_planned"]
    assert metrics["auto_candidates"] >= 1 and " ms predicted" in metrics["auto_best_so_far"]


def test_on_a_cpu_a_simulated_or_auto_run_says_its_device_is_not_the_fabrics(tmp_path, attngym_cli):
    run = tmp_path / "run"
    done = attngym_cli([*AUTO, "shape.seq_len=512", f"hydra.run.dir={run}"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    said = re.findall(r"WARNING\] (.*device cpu is not the fabric's.*)", done.stdout)
    (line,) = said  # once, before the choice's minutes
    assert "to predict GPUs run this on one (device=cuda)" in line
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["bottleneck"] is None and metrics["predicted_efficiency"] is None
    assert metrics["prediction_refused"].startswith("device cpu is not the fabric's")
    assert "-bound" not in metrics["auto_why"] and "no GPU's prediction" in metrics["auto_why"]
    table = json.loads((run / "auto.json").read_text())["candidates"]
    assert {c["bottleneck"] for c in table} == {None}
    table_printed = done.stdout.split("attngym: ok")[-1]
    assert not re.search(r"^  bottleneck ", table_printed, re.M)  # none claimed in the table


def test_a_simulated_run_reports_the_items_it_has_timed(tmp_path, monkeypatch, caplog):
    from attngym import registry
    from attngym.runner.config import Benchmark, Settings, Shape, Topology

    monkeypatch.setattr(progress, "on_terminal", lambda: False)
    monkeypatch.setattr(progress, "INTERVAL_S", 0.01)  # a line every 10 ms, not every 10 s
    caplog.set_level("INFO", logger="attngym.progress")
    settings = Settings(
        attention={"name": "causal"},
        device="cpu",
        shape=Shape(batch=1, heads=2, seq_len=512, head_dim=8),
        topology=Topology(kind="ring", world_size=4, layout="zigzag", simulate=True),
        benchmark=Benchmark(warmup=0, repeats=1),
        baselines=(),
        validate=False,
        passes=("fwd",),
    )
    metrics = registry.get("task", "ring")(settings, tmp_path)
    counts = re.findall(r"simulated ring over 4 ranks: items timed: (\d+)/\? done", caplog.text)
    assert counts and max(map(int, counts)) == metrics["sim_timed"]


def test_a_progress_of_slow_steps_says_each_step_and_grows(monkeypatch, caplog):
    monkeypatch.setattr(progress, "on_terminal", lambda: False)
    caplog.set_level("INFO", logger="attngym.progress")
    with progress.Progress(2, "candidates", interval=0, line_per_step=True) as bar:
        bar.running("ring/zigzag")
        bar.update()
        bar.note("best so far ring/zigzag 1.000 ms")
        bar.grow(1)
        bar.update()
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("candidates: 1/2 done, running ring/zigzag, 0:00:00 elapsed")
    assert lines[1].startswith("candidates: 2/3 done, running ring/zigzag, best so far ring/")
    assert "ETA" in lines[1]


@pytest.mark.parametrize("steps", [0, 2])
def test_a_progress_that_grows_on_a_terminal_redraws_its_total(monkeypatch, steps):
    monkeypatch.setattr(progress, "on_terminal", lambda: True)
    with progress.Progress(3, "candidates") as bar:
        bar.grow(steps)
        assert bar.total == 3 + steps and bar._bar.total == 3 + steps
