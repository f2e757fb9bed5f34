"""A run under faults, through the command line: a folder another run holds, a failing rank,
signals, a full disk, an interruption between metrics.json and the pictures.

Faults inside the task are injected by FAULTY, which replaces attngym.cli._run_task (the one call
from the run layer into a task) before the command line runs; everything else is the real run.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from attngym.tracking.lock import FolderLock

from .test_folders import TINY

pytestmark = pytest.mark.faults

# `python -c FAULTY FAULT ARGS...`: the command line with the task replaced by FAULT.
FAULTY = textwrap.dedent(
    """
    import os, signal, sys, time
    from attngym import cli
    from attngym.errors import RankFailure

    fault, args = sys.argv[1], sys.argv[2:]
    real = cli._run_task

    def faulty(settings, run_dir, metrics=None):
        if fault == "rank_failure":
            raise RankFailure("rank 1 exited with code 3")
        return real(settings, run_dir)

    cli._run_task = faulty
    cli.entry(args)
    """
)


def _error_lines(stderr):
    return [ln for ln in stderr.splitlines() if ln.startswith("attngym: error:")]


def test_a_run_into_a_folder_another_run_holds_stops_with_one_line(tmp_path, attngym_cli):
    run = tmp_path / "run"
    with FolderLock(run):
        proc = attngym_cli([*TINY, f"hydra.run.dir={run}"], tmp_path)
    assert proc.returncode == 1, proc.stderr
    (line,) = _error_lines(proc.stderr)
    assert f"{run} is in use by pid" in line and "Traceback" not in proc.stderr
    assert not (run / "metrics.json").exists()


def test_a_sweep_into_a_folder_another_sweep_holds_stops_with_one_line(tmp_path, attngym_cli):
    folder = tmp_path / "sweep"
    with FolderLock(folder):
        proc = attngym_cli(["-m", *TINY, f"hydra.sweep.dir={folder}"], tmp_path)
    assert proc.returncode == 1, proc.stderr
    (line,) = _error_lines(proc.stderr)
    assert f"{folder} is in use by pid" in line and "Traceback" not in proc.stderr
    assert not (folder / "0").exists()


def test_a_rank_failure_is_one_line_and_exit_code_1(tmp_path, attngym_cli):
    run = tmp_path / "run"
    proc = attngym_cli(
        ["rank_failure", *TINY, f"hydra.run.dir={run}"], tmp_path, command=("-c", FAULTY)
    )
    assert proc.returncode == 1, proc.stderr
    (line,) = _error_lines(proc.stderr)
    assert line == "attngym: error: rank 1 exited with code 3"
    assert "Traceback" not in proc.stderr + proc.stdout
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["status"] == "failed" and metrics["error"].startswith("RankFailure: rank 1")
