"""A run under faults, through the command line: a folder another run holds, a failing rank,
signals, a full disk, an interruption between metrics.json and the pictures.

Faults inside the task are injected by FAULTY, which replaces attngym.runner.job._run_task (the one
call from the run layer into a task) before the command line runs; everything else is the real run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from attngym.runner.tracking import sweep
from attngym.runner.tracking.lock import FolderLock

from .test_folders import TINY

pytestmark = pytest.mark.faults

# `python -c FAULTY FAULT ARGS...`: the command line with the task replaced by FAULT.
FAULTY = textwrap.dedent(
    """
    import os, signal, sys, time
    from attngym.runner import cli, job, pictures
    from attngym.errors import RankFailure

    fault, args = sys.argv[1], sys.argv[2:]
    real = job._run_task

    def faulty(settings, run_dir, metrics):
        if fault == "rank_failure":
            raise RankFailure("rank 1 exited with code 3")
        real(settings, run_dir, metrics)
        if fault.startswith("signal:"):  # signal:NAME:SEQ_LEN, after the task measured
            _, name, seq_len = fault.split(":")
            if settings.shape.seq_len == int(seq_len):
                os.kill(os.getpid(), getattr(signal, name))
                time.sleep(30)  # the handler interrupts this
        return metrics

    def killed_before_pictures(settings, run_dir, *ran, **kept):
        if settings.shape.seq_len == 128:
            os.kill(os.getpid(), signal.SIGKILL)
        return draw(settings, run_dir, *ran, **kept)

    def enospc_on_png(fd):  # a full disk for the pictures only, where tmpfs cannot be mounted
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".png." + str(os.getpid()) + ".tmp"):
            raise OSError(28, "No space left on device")
        return fsync(fd)

    fsync = os.fsync
    if fault == "enospc_on_png":
        os.fsync = enospc_on_png
    draw = pictures.draw_pictures
    job._run_task = faulty
    if fault == "killed_before_pictures":
        pictures.draw_pictures = killed_before_pictures
    cli.entry(args)
    """
)


def _error_lines(stderr):
    return [ln for ln in stderr.splitlines() if ln.startswith("attngym: error:")]


@pytest.mark.parametrize(
    "args, folder_key, untouched",
    [([], "hydra.run.dir", "metrics.json"), (["-m"], "hydra.sweep.dir", "0")],
    ids=["run", "sweep"],
)
def test_a_folder_another_run_holds_stops_a_run_or_sweep_with_one_line(
    tmp_path, attngym_cli, args, folder_key, untouched
):
    folder = tmp_path / "held"
    with FolderLock(folder):
        proc = attngym_cli([*args, *TINY, f"{folder_key}={folder}"], tmp_path)
    assert proc.returncode == 1, proc.stderr
    (line,) = _error_lines(proc.stderr)
    assert f"{folder} is in use by pid" in line and "Traceback" not in proc.stderr
    assert not (folder / untouched).exists()


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


def test_a_job_killed_between_metrics_json_and_its_pictures_runs_again_on_resume(
    tmp_path, attngym_cli
):
    folder = tmp_path / "sweep"
    args = ["-m", *TINY, "shape.seq_len=64,128", f"hydra.sweep.dir={folder}"]
    killed = attngym_cli(["killed_before_pictures", *args], tmp_path, command=("-c", FAULTY))
    assert killed.returncode == -9
    first = json.loads((folder / "1" / "metrics.json").read_text())
    assert first["status"] == "ok" and first["complete"] is False  # measured, not finished
    assert not (folder / "1" / "heatmap.png").exists()
    resumed = attngym_cli(args, tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    log = resumed.stdout + resumed.stderr
    assert re.search(r"job 0 \(.*shape.seq_len=64.*\): already ok", log)
    assert re.search(r"job 1 \(.*shape.seq_len=128.*\): running it again: it stopped after", log)
    assert "taking over the stale lock" in log  # the killed sweep's lock
    assert json.loads((folder / "1" / "metrics.json").read_text())["complete"] is True
    assert (folder / "1" / "heatmap.png").stat().st_size > 0


def test_resume_reruns_a_job_with_a_bad_status_flag_or_picture(tmp_path):
    from attngym import user_code
    from attngym.runner import job
    from attngym.runner.tracking import write_metrics

    overrides = ["shape.seq_len=64"]
    ok = {"status": "ok", "complete": True, "overrides": overrides, **user_code.record([])}
    write_metrics(tmp_path, ok)
    assert job.why_rerun(tmp_path, overrides) == "its heatmap.png is missing, empty or not a file"
    (tmp_path / "heatmap.png").write_bytes(b"png")
    (tmp_path / "block_mask.png").write_bytes(b"")
    assert (
        job.why_rerun(tmp_path, overrides) == "its block_mask.png is missing, empty or not a file"
    )
    (tmp_path / "block_mask.png").write_bytes(b"png")
    assert job.why_rerun(tmp_path, overrides) is None
    assert (
        job.why_rerun(tmp_path, ["shape.seq_len=128"]) == "its metrics.json is of other overrides"
    )
    write_metrics(tmp_path, {**ok, "complete": False})
    assert "stopped after metrics.json" in job.why_rerun(tmp_path, overrides)
    write_metrics(tmp_path, {**ok, "status": "interrupted", "error": "SIGTERM"})
    assert job.why_rerun(tmp_path, overrides) == "it ended interrupted: SIGTERM"
    (tmp_path / "metrics.json").unlink()
    assert job.why_rerun(tmp_path, overrides) == ""


def test_sigint_keeps_what_was_measured_one_line_exit_130(tmp_path, attngym_cli):
    run = tmp_path / "run"
    args = ["signal:SIGINT:64", *TINY, f"hydra.run.dir={run}"]
    proc = attngym_cli(args, tmp_path, command=("-c", FAULTY))
    assert proc.returncode == 130, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("attngym:")]
    assert line == f"attngym: interrupted by SIGINT; what was measured is in {run}"
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["status"] == "interrupted" and metrics["error"] == "interrupted by SIGINT"
    assert metrics["validation"] == "ok" and metrics["fwd_ms"] > 0  # measured before the signal
    assert not (run / "heatmap.png").exists()


def test_sigterm_in_a_sweep_writes_the_summary_so_far_exit_143(tmp_path, attngym_cli):
    folder = tmp_path / "sweep"
    args = ["signal:SIGTERM:128", "-m", *TINY, "shape.seq_len=64,128,256"]
    proc = attngym_cli([*args, f"hydra.sweep.dir={folder}"], tmp_path, command=("-c", FAULTY))
    assert proc.returncode == 143, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert f"attngym: interrupted by SIGTERM; what was measured is in {folder}" in proc.stderr
    resume = next(x for x in proc.stderr.splitlines() if x.startswith("attngym: resume with: "))
    assert resume.endswith(f"hydra.sweep.dir={folder}") and "shape.seq_len=64,128,256" in resume
    rows = {row["job"]: row for row in sweep.collect(folder)}
    assert rows["0"]["status"] == "ok" and rows["1"]["status"] == "interrupted"
    assert rows["1"]["fwd_ms"] > 0 and "2" not in rows  # the sweep stopped at the signal
    summary = (folder / "summary.md").read_text()
    assert "2 jobs, 0 failed, 1 interrupted." in summary


def test_a_full_disk_keeps_the_metrics_prints_the_table_one_line_exit_1(
    tmp_path, attngym_cli, small_disk
):
    if small_disk is None:
        run = tmp_path / "run"
        args, command = ["enospc_on_png", *TINY, f"hydra.run.dir={run}"], ("-c", FAULTY)
    else:
        run = small_disk / "run"
        args, command = [*TINY, f"hydra.run.dir={run}"], ("-m", "attngym")
    proc = attngym_cli(args, tmp_path, command=command)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    (line,) = _error_lines(proc.stderr)
    assert line == f"attngym: error: could not write {run}/heatmap.png: No space left on device"
    assert "attngym: failed" in proc.stdout and "fwd (ms)" in proc.stdout  # the table, measured
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["status"] == "failed" and metrics["error"] == line.removeprefix(
        "attngym: error: "
    )
    assert metrics["fwd_ms"] > 0 and not (run / "heatmap.png").exists()


def test_a_symlink_where_a_picture_goes_fails_the_run_and_its_target_is_untouched(
    tmp_path, attngym_cli
):
    run = tmp_path / "run"
    run.mkdir()
    outside = tmp_path / "outside.png"
    outside.write_text("precious")
    (run / "block_mask.png").symlink_to(outside)
    proc = attngym_cli([*TINY, f"hydra.run.dir={run}"], tmp_path)
    assert proc.returncode == 1, proc.stderr
    (line,) = _error_lines(proc.stderr)
    assert line.startswith(f"attngym: error: could not write {run}/block_mask.png: {run}/block")
    assert "is a symlink" in line and outside.read_text() == "precious"
    assert json.loads((run / "metrics.json").read_text())["status"] == "failed"


def test_two_runs_started_in_the_same_second_get_folders_of_their_own(tmp_path):
    """Default folders carry the time to the microsecond and the process id; each run locks its
    own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "HYDRA_"))}
    runs = [
        subprocess.Popen(
            [sys.executable, "-m", "attngym", *TINY],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [run.communicate(timeout=300) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outputs
    folders = sorted((tmp_path / "outputs").glob("*/*"))
    # Started together, most often in the same second (not asserted: a loaded machine may start
    # Python a second apart); either way two folders, each with its own complete run.
    assert len(folders) == 2
    for folder in folders:
        assert json.loads((folder / "metrics.json").read_text())["complete"] is True
