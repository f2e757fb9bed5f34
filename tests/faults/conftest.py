"""Fault injection: what the suite shares.

Every test here is marked `faults` (pytestmark in each module) and asserts three things: nothing
the run had finished is lost, the documented exit code or exception, and no process left behind
(tests/faults/procs.py checks processes by /proc, without psutil).
"""

from __future__ import annotations

import os
import subprocess

import pytest

from .procs import children, wait_gone


@pytest.fixture
def no_new_children():
    """Fails the test when it leaves a child process of this test process running."""
    before = children(os.getpid())
    yield
    assert wait_gone(children(os.getpid()) - before) == []


@pytest.fixture
def small_disk(tmp_path):
    """A 64 KiB tmpfs: room for a run's config, log and metrics.json, not for its pictures (tens
    of KiB each). None where mounting is not allowed (not root)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)]
    if subprocess.run(mount, capture_output=True).returncode != 0:
        yield None
        return
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)
