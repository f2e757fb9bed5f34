"""Trackers: metrics.json written atomically, results.md, and a W&B offline run with its images."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from attngym import registry
from attngym.errors import ConfigError
from attngym.runner.tracking import RunRecord, read_metrics, write_metrics


def test_write_metrics_atomic_and_json_safe(tmp_path):
    path = write_metrics(tmp_path, {"status": "ok", "fwd_ms": 1.5, "lse": float("-inf")})
    assert path == tmp_path / "metrics.json"
    assert json.loads(path.read_text()) == {"status": "ok", "fwd_ms": 1.5, "lse": "-inf"}
    write_metrics(tmp_path, {"status": "failed", "error": "boom"})
    assert read_metrics(tmp_path) == {"status": "failed", "error": "boom"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json"]
    assert read_metrics(tmp_path / "missing") is None


def test_trackers_registered_and_local_writes_results(tmp_path):
    assert registry.names("tracker") == ["local", "none", "wandb"]
    record = RunRecord(
        run_dir=tmp_path,
        metrics={"status": "ok", "fwd_ms": 2.25, "peak_mem_bytes": 3 * 2**20, "variant": "causal"},
        config={},
        images={},
        name="attention=causal",
        group="g",
        job_type="single",
    )
    registry.build("tracker", "local").log_run(record)
    text = (tmp_path / "results.md").read_text()
    assert "| fwd_ms | 2.25 |" in text and "# attention=causal" in text
    assert "| peak_mem_bytes | 3 MiB |" in text  # as the sweep summary shows it
    registry.build("tracker", "none").log_run(record)


def test_wandb_mode_checked():
    with pytest.raises(ConfigError) as info:
        registry.build("tracker", "wandb", mode="sometimes")
    assert info.value.key == "logger.mode"
    assert registry.build("tracker", "wandb", mode="disabled").mode == "disabled"


def test_wandb_offline_run_holds_images(tmp_path, attngym_cli):
    run_dir = tmp_path / "run"
    env = {"WANDB_CONFIG_DIR": str(tmp_path / "cfg"), "WANDB_CACHE_DIR": str(tmp_path / "cache")}
    args = [
        "device=cpu",
        "shape.seq_len=64",
        "shape.heads=2",
        "shape.head_dim=16",
        "benchmark.warmup=0",
        "benchmark.repeats=1",
        "baselines=[]",
        "block_size=64",
        "attention=sliding_window",
        "attention.window_size=16",
        "logger=wandb",
        f"hydra.run.dir={run_dir}",
    ]
    proc = attngym_cli(args, tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((run_dir / "wandb").iterdir())
    images = sorted(p.name for p in runs[0].glob("files/media/images/*.png"))
    assert any(n.startswith("heatmap") for n in images), images
    assert any(n.startswith("block_mask") for n in images), images
    records = list(runs[0].glob("run-*.wandb"))  # config, summary and history, for wandb sync
    assert len(records) == 1 and records[0].stat().st_size > 1000
    # The run's name is the overrides as typed, not as Hydra received them (++, '64').
    data = records[0].read_bytes()
    assert b"attention.window_size=16,attention=sliding_window,baselines=[]" in data
    assert b"++attention" not in data and b"block_size='64'" not in data
    # W&B started before the pictures (tracker.begin) and took the complete run after them.
    assert b"phase_pictures_s" in data and b"wall_s" in data
    # The log points at the run's folder and how its summary reads offline, not at files/
    said = re.search(r"wandb \(offline\): (\S+); its summary: (.*) \(import", proc.stdout)
    assert said and said.group(1) == str(runs[0]), proc.stdout[-2000:]
    if importlib.util.find_spec("wandb.cli.leet") is not None:  # wandb 0.31
        assert said.group(2) == f"wandb leet inspect --summary {runs[0]}"
        shown = subprocess.run(
            [str(Path(sys.executable).parent / "wandb"), *said.group(2).split()[1:]],
            capture_output=True, text=True, timeout=120, env={**os.environ, **env},
        )  # fmt: skip
        assert re.search(r"^\s*fwd_ms\s+\d", shown.stdout, re.M), shown.stdout[-2000:]
    else:
        assert said.group(2).startswith("metrics.json in the run folder")


class _StuckRun:
    """A W&B run whose finish blocks, as it does online without network."""

    dir = "run-folder"

    def __init__(self):
        self.release = threading.Event()
        self.finished = []

    def finish(self, exit_code=0):
        self.finished.append(exit_code)
        self.release.wait(10)


def test_wandb_finish_is_bounded_online(caplog):
    from attngym.runner.tracking.wandb_logger import WandbTracker

    run = _StuckRun()
    tracker = WandbTracker(mode="online", finish_timeout_s=0.2)
    start = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="attngym.runner.tracking.wandb_logger"):
        tracker._finish(run, exit_code=1)
    assert time.perf_counter() - start < 2 and run.finished == [1]
    assert "did not return within" in caplog.text and "wandb sync" in caplog.text
    run.release.set()
    quick = _StuckRun()
    quick.release.set()  # a finish that returns: no warning, same call
    caplog.clear()
    tracker._finish(quick, exit_code=0)
    assert quick.finished == [0] and "did not return" not in caplog.text
