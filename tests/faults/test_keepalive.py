"""rank0_work: peers wait for rank 0's long work without a long timeout, and notice a rank 0
that stops within timeout_s."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from attngym.distributed.ranks.keepalive import rank0_work
from attngym.distributed.ranks.launch import launch
from attngym.errors import RankFailure

pytestmark = pytest.mark.faults

KEEPALIVE_S = 1.5


def _long_work_worker(rank, world_size, folder, stop_rank0):
    start = time.monotonic()
    try:
        with rank0_work(KEEPALIVE_S):
            if rank == 0:
                if stop_rank0:
                    Path(folder, "stopped_at").write_text(str(time.time()))
                    os.kill(os.getpid(), signal.SIGSTOP)
                time.sleep(4 * KEEPALIVE_S)  # far longer than any one wait may take
    except RankFailure as err:
        Path(folder, f"failure{rank}").write_text(f"{time.time()}\n{err}")
        raise
    return time.monotonic() - start


def test_peers_wait_for_rank0_work_longer_than_the_timeout(tmp_path):
    assert launch(_long_work_worker, 2, args=(str(tmp_path), False), timeout_s=60) >= 4 * 1.5


def test_peers_notice_a_stopped_rank0_within_the_timeout(tmp_path, no_new_children):
    # launch's own bound (60 s) is far away: the peers' keep-alive must fail first.
    with pytest.raises(RankFailure, match=r"rank 1 raised"):
        launch(_long_work_worker, 2, args=(str(tmp_path), True), timeout_s=60)
    stopped_at = float((tmp_path / "stopped_at").read_text())
    failed_at, message = (tmp_path / "failure1").read_text().split("\n", 1)
    assert "rank 0 gave no sign of life for 1.5 s" in message
    # timeout_s after rank 0's last broadcast (timeout_s / 4 before it stopped at worst), plus
    # 3 s for a loaded 2-core box.
    assert float(failed_at) - stopped_at < KEEPALIVE_S + 3


SLOW_ONE_DEVICE_S = 6.0


def _slow_one_device_rank(rank, world_size, settings, stop_rank0):
    """The CP task's rank body with rank 0's one-device comparison slower than timeout_s, or
    rank 0 stopped (SIGSTOP) there."""
    import attngym.runner.tasks.context_parallel as cp

    real = cp.one_device

    def slow(job):
        if job.rank == 0:
            if stop_rank0:
                os.kill(os.getpid(), signal.SIGSTOP)
            time.sleep(SLOW_ONE_DEVICE_S)
        return real(job)

    cp.one_device = slow
    return cp._rank_run(rank, world_size, settings, "ring")


def _cp_settings(timeout_s):
    from attngym.runner.config import Benchmark, Settings, Shape, Topology

    return Settings(
        attention={"name": "causal"},
        device="cpu",
        shape=Shape(batch=1, heads=2, seq_len=256, head_dim=8),
        topology=Topology(kind="ring", world_size=2, timeout_s=timeout_s),
        benchmark=Benchmark(warmup=0, repeats=1),
        baselines=(),
    )


def test_the_cp_task_waits_for_rank0_longer_than_topology_timeout_s(tmp_path):
    settings = _cp_settings(timeout_s=2.0)  # every wait of the peers is bounded by this
    start = time.monotonic()
    metrics = launch(
        _slow_one_device_rank, 2, args=(settings, False), timeout_s=60, run_dir=tmp_path
    )
    assert time.monotonic() - start > SLOW_ONE_DEVICE_S  # rank 0 worked 3x timeout_s
    assert metrics["validation"] == "ok" and metrics["single_fwd_ms"] > 0


def test_the_cp_task_notices_rank0_stopped_in_its_long_work(tmp_path, no_new_children):
    # launch's own bound (60 s) is far away: rank 1's keep-alive wait fails first.
    start = time.monotonic()
    with pytest.raises(
        RankFailure, match=r"(?s)rank 1 raised.*rank 0 gave no sign of life for 2 s"
    ):
        launch(_slow_one_device_rank, 2, args=(_cp_settings(2.0), True), timeout_s=60)
    assert time.monotonic() - start < 45
