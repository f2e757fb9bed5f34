"""Process checks by /proc (no psutil): is a pid gone, which children are alive, which processes
carry a test's tag in their environment."""

from __future__ import annotations

import os
import time


def state(pid: int) -> str | None:
    """The /proc state letter of `pid` (R, S, T, Z, ...), or None when it does not exist."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def gone(pid: int) -> bool:
    """True when `pid` no longer runs (absent, or a zombie waiting for its reaper)."""
    return state(pid) in (None, "Z", "X")


def wait_gone(pids, within_s: float = 5.0) -> list[int]:
    """The pids still running after `within_s` (a killed child is reaped asynchronously)."""
    deadline = time.monotonic() + within_s
    alive = [p for p in pids if not gone(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [p for p in alive if not gone(p)]
    return alive


def children(pid: int) -> set[int]:
    """Live child processes of `pid`, multiprocessing's resource tracker left out."""
    kids = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline") as f:
                helper = "resource_tracker" in f.read()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] not in ("Z", "X") and not helper:
            kids.add(int(entry))
    return kids


def tagged(tag: str) -> list[int]:
    """Live processes whose environment holds ATTNGYM_FAULT_TAG=<tag>: a subprocess started with
    that variable and every descendant it left (they inherit the environment, wherever they are
    reparented)."""
    needle = f"ATTNGYM_FAULT_TAG={tag}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and entry != str(os.getpid()):
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle in f.read().split(b"\0") and not gone(int(entry)):
                        found.append(int(entry))
            except OSError:
                continue
    return found
