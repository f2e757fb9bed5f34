"""Fault injection: what the suite shares.

Every test here is marked `faults` (pytestmark in each module) and asserts three things: nothing
the run had finished is lost, the documented exit code or exception, and no process left behind
(tests/faults/procs.py checks processes by /proc, without psutil).
"""

from __future__ import annotations

import os

import pytest

from .procs import children, wait_gone


@pytest.fixture
def no_new_children():
    """Fails the test when it leaves a child process of this test process running."""
    before = children(os.getpid())
    yield
    assert wait_gone(children(os.getpid()) - before) == []
