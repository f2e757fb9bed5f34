"""SLURM's clock and states, read right by attngym's launcher on a real cluster.

A job near its time limit is stopped by SLURM at the limit, not by submitit's early signal
(which a fixed delay of 120 s sent as a 1-minute job started, and whose handler raised inside the
user's mask import: the row blamed the mask); a job whose node's slurmd dies after the job
finished stays COMPLETING for good, and the sweep still ends with the job's own result.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from .conftest import mask_module
from .test_slurm import SMALL, _running_job, rows

pytestmark = pytest.mark.slurm


def test_a_job_runs_to_its_time_limit_and_its_row_says_slurms_timeout(slurm, user_shell):
    mask_module(user_shell.cwd, "slowmask", "import time\ntime.sleep(600)")
    sweep = user_shell.cwd / "multirun" / "limit"
    started = time.monotonic()
    proc = user_shell(
        "attngym -m hydra/launcher=submitit_slurm hydra.launcher.timeout_min=1 attention=custom "
        f"attention.mask_mod=slowmask.mask {SMALL} shape.seq_len=256 hydra.sweep.dir={sweep}"
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert time.monotonic() - started > 55  # the whole minute, not killed by the early signal
    (row,) = rows(sweep)
    assert row["status"] == "failed", row
    assert " TIMEOUT: reached its time limit (hydra.launcher.timeout_min)" in row["error"], row
    assert "UncompletedJobError" not in row["error"] and "mask_mod" not in row["error"]
    (script,) = sweep.glob(".submitit/*/*_submission.sh")
    assert "--signal=USR2@6" in script.read_text()  # a tenth of the minute


def test_a_signal_delay_as_long_as_the_limit_is_used_as_zero_with_a_warning(slurm, user_shell):
    sweep = user_shell.cwd / "multirun" / "delay"
    proc = user_shell(
        "attngym -m hydra/launcher=submitit_slurm hydra.launcher.timeout_min=2 "
        f"hydra.launcher.signal_delay_s=120 {SMALL} shape.seq_len=256 hydra.sweep.dir={sweep}"
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "hydra.launcher.signal_delay_s=120 is not shorter than timeout_min=2" in out
    (script,) = sweep.glob(".submitit/*/*_submission.sh")
    assert "--signal=USR2@0" in script.read_text()


def test_a_job_left_completing_by_a_dead_slurmd_ends_with_its_result(slurm, user_shell):
    # The test kills the node's slurmd while the job waits at this import.
    mask_module(user_shell.cwd, "slow15", "import time\ntime.sleep(15)")
    sweep = user_shell.cwd / "multirun" / "completing"
    sweeping = user_shell.start(
        "attngym -m hydra/launcher=submitit_slurm attention=custom attention.mask_mod="
        f"slow15.mask {SMALL} shape.seq_len=256 hydra.sweep.dir={sweep}"
    )
    job = _running_job(slurm, sweep, 0)
    _step_started(sweep, job)  # past the step's launch, which a dead slurmd would abort
    node = slurm.run("squeue", "--noheader", "--jobs", job, "--format=%N").stdout.strip()
    slurm.kill_slurmd(node)
    try:
        out, _ = sweeping.communicate(timeout=180)
        state = dict(slurm.jobs()).get(job)
    except subprocess.TimeoutExpired:
        os.killpg(sweeping.pid, signal.SIGTERM)
        out, _ = sweeping.communicate(timeout=60)
        pytest.fail(f"the sweep still waits on {slurm.jobs()}: {out[-2000:]}")
    finally:
        slurm.restart_slurmd(node)  # the other tests' cluster whole again
    assert state == "COMPLETING", state  # what the dead slurmd left: the premise
    assert sweeping.returncode == 0, out[-3000:]
    assert json.loads((sweep / "0" / "metrics.json").read_text())["status"] == "ok"


def _step_started(sweep, job: str, timeout_s: float = 120) -> None:
    """Wait until the job's step runs submitit's code (its log says it started): SLURM says
    RUNNING while the step may still be launching on the node."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        logs = sweep.glob(f".submitit/{job}/*_log.*")
        if any("Starting with" in path.read_text(errors="replace") for path in logs):
            return
        time.sleep(0.5)
    raise AssertionError(f"job {job} never started its step: {list(sweep.glob('.submitit/*/*'))}")
