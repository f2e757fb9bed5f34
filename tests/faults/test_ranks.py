"""Killed and stopped ranks: the run fails fast, names the rank, and leaves no process behind."""

from __future__ import annotations

import ctypes
import datetime
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from attngym.distributed.ranks.launch import launch
from attngym.errors import RankFailure

from .procs import gone, wait_gone

pytestmark = pytest.mark.faults

# Longer than any test here runs: the peers wait as rank 0's peers wait in
# attngym.runner.tasks.context_parallel (a gloo group whose timeout is far beyond
# topology.timeout_s), so only launch can end the wait.
LONG_WAIT_S = 3600


def _faulty_worker(rank, world_size, folder, victim, how):
    """`victim` starts a grandchild, records pids and time, then stops, wedges or kills itself; the
    other ranks wait for it at a barrier they would not leave for an hour."""
    import torch.distributed as dist

    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=LONG_WAIT_S))
    dist.barrier(group=group)
    if rank == victim:
        child = subprocess.Popen(["sleep", "300"])
        Path(folder, "pids").write_text(f"{os.getpid()} {child.pid}")
        Path(folder, "fault_at").write_text(str(time.time()))
        if how == "wedge":  # native code that keeps the GIL: the interpreter cannot run at all
            ctypes.PyDLL("libc.so.6").sleep(300)
        os.kill(os.getpid(), signal.SIGSTOP if how == "stop" else signal.SIGKILL)
    Path(folder, f"rank{rank}").write_text(str(os.getpid()))
    dist.barrier(group=group)
    return "unreachable"


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("stop", r"rank 1 is stopped \(SIGSTOP\) for \d+ s, more than topology.timeout_s=4;"),
        ("wedge", r"rank 1 made no progress for \d+ s, more than topology.timeout_s=4;"),
        ("kill", "rank 1 was killed by SIGKILL"),
    ],
)
def test_stopped_hung_or_killed_rank_fails_within_timeout_and_leaves_nothing(
    tmp_path, no_new_children, how, message
):
    timeout_s = 4.0
    with pytest.raises(RankFailure, match=message):
        launch(_faulty_worker, 3, args=(str(tmp_path), 1, how), timeout_s=timeout_s)
    failed_at = time.time()
    # The stall is noticed within timeout_s of the last heartbeat (HEARTBEAT_S before the stop at
    # worst), then the ranks are stopped within GRACE_S twice: 5 s of slack on a loaded 2-core box.
    assert failed_at - float((tmp_path / "fault_at").read_text()) < timeout_s + 5
    rank_pid, grandchild = map(int, (tmp_path / "pids").read_text().split())
    peers = [int((tmp_path / f"rank{r}").read_text()) for r in (0, 2)]
    assert all(gone(p) for p in [rank_pid, *peers])
    assert wait_gone([grandchild]) == []  # the victim's own child went with its process group


def _reporting_worker(rank, world_size):
    """Rank 0 reports twice, then rank 1 dies: what rank 0 reported last must survive."""
    import torch.distributed as dist

    from attngym.distributed.ranks.launch import report

    report({"fwd_ms": 1.0})
    report({"fwd_ms": 2.0, "validation": "ok"})
    dist.barrier()
    if rank == 1:
        os._exit(3)
    time.sleep(LONG_WAIT_S)


def test_a_failed_launch_keeps_rank0s_last_report():
    progress = {"run": "kept"}
    with pytest.raises(RankFailure, match="rank 1 exited with code 3"):
        launch(_reporting_worker, 2, timeout_s=30, progress=progress)
    assert progress == {"run": "kept", "fwd_ms": 2.0, "validation": "ok"}
