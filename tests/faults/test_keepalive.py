"""rank0_work: peers wait for rank 0's long work without a long timeout, and notice a rank 0
that stops within timeout_s."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from attngym.distributed.keepalive import rank0_work
from attngym.distributed.launch import launch
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
