"""Profilers a run can wrap its timed work in: kernel names, or a chrome trace.

Each profiler is a context manager that yields a dict and fills it on exit, so a task writes the
same few lines whichever profiler the config chose:

    with registry.build("profiler", cfg.profiler, run_dir=run_dir, rank=rank) as prof:
        work()
    metrics["profile"] = prof  # e.g. {"kernel_names": [...], "trace_path": "..."}

Registered under kind "profiler" (each factory takes `run_dir: pathlib.Path` and `rank: int = 0`):

    none     yields {} and profiles nothing.
    kernels  {"found", "kernel_names", "kernels_path"}: the CUDA kernels launched, also written to
             `<run_dir>/kernels_rank<rank>.txt` (empty on a CPU-only run).
    trace    {"trace_path", "kernel_names"}: a chrome trace `<run_dir>/trace_rank<rank>.json`,
             viewable in chrome://tracing or https://ui.perfetto.dev.

Both real profilers use torch.profiler, which works on the CPU too; CUDA activity is recorded only
when CUDA is available. Kernel names are read in one place, `kernel_names`.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import torch

from attngym import registry
from attngym.fileio import atomic_write


def _activities() -> list:
    from torch.profiler import ProfilerActivity

    acts = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(ProfilerActivity.CUDA)
    return acts


@contextlib.contextmanager
def _profile(**kwargs: Any) -> Iterator[Any]:
    """torch.profiler.profile(**kwargs) over the block, its start and stop without USDT lines."""
    from torch.profiler import profile

    prof = profile(**kwargs)
    with _without_usdt_lines():
        prof.start()
    try:
        yield prof
    finally:
        with _without_usdt_lines():
            prof.stop()


@contextlib.contextmanager
def _without_usdt_lines() -> Iterator[None]:
    """Drop the `USDT: ... profiler_start` / `profiler_stop` lines that Kineto (the profiler's
    C++ backend) writes to file descriptor 2 when a profile starts and stops: hooks for tracing
    tools, not messages for a person. KINETO_LOG_LEVEL cannot drop them alone (its levels put them
    above errors) and is read only when torch is imported, so stderr is captured around the
    start and the stop only, and every other line is passed on."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no file descriptor 2 to capture
        yield
        return
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            lines = tmp.read().splitlines(keepends=True)
            kept = b"".join(line for line in lines if not line.startswith(b"USDT:"))
            if kept:
                os.write(2, kept)


def kernel_names(prof: Any) -> list[str]:
    """Names of the CUDA kernels a finished torch.profiler.profile recorded, unique, sorted.

    Args:
        prof: a `torch.profiler.profile` after its context has exited.

    Returns:
        Kernel names; empty when nothing ran on a GPU (for example on the CPU).
    """
    from torch.autograd import DeviceType

    return sorted({e.name for e in prof.events() if e.device_type == DeviceType.CUDA})


# What a kernel name says about the path flex took: the first family with a kernel wins.
KERNEL_FAMILIES = (
    ("flash_attncute", "flash"),  # flash-attn-4's CuTe kernels (BACKEND=FLASH)
    ("flex_decoding", "triton decode"),
    ("triton_tem", "triton"),  # Inductor's templates: flex's Triton kernels
)


def kernel_family(names: list[str]) -> str:
    """Which path ran, from the CUDA kernel names of one call: "<family> (<its kernel>)", or
    "eager (...)" when no fused attention kernel ran (the scores were materialised)."""
    for mark, family in KERNEL_FAMILIES:
        hits = [n for n in names if mark in n]
        if hits:
            return f"{family} ({hits[0]})"
    if not names:
        return "no CUDA kernel"
    return f"eager ({len(names)} kernels, no fused attention kernel, e.g. {names[0]})"


@contextlib.contextmanager
def cuda_kernel_profiler(kernel_pattern: str = "flash_attncute") -> Iterator[dict[str, Any]]:
    """Profile the CUDA kernels launched inside the block and look for `kernel_pattern`.

    Usage:
        with cuda_kernel_profiler("flash_attncute") as result:
            flex_attention(...)
        result["found"]         # True if a kernel name contains the pattern
        result["kernel_names"]  # every CUDA kernel name

    On a machine without CUDA it still runs (found False, no kernel names).

    Args:
        kernel_pattern: substring to look for in kernel names.

    Yields:
        A dict filled on exit with `found` (bool) and `kernel_names` (list[str]).
    """
    if not isinstance(kernel_pattern, str):
        raise ValueError(f"kernel_pattern must be a string, got {kernel_pattern!r}")
    result: dict[str, Any] = {"found": False, "kernel_names": []}
    with _profile(activities=_activities()) as prof:
        yield result
    names = kernel_names(prof)
    result["kernel_names"] = names
    result["found"] = any(kernel_pattern in n for n in names)


@contextlib.contextmanager
def chrome_trace(path: str | pathlib.Path, *, enabled: bool = True) -> Iterator[dict[str, Any]]:
    """Profile the block (CPU, plus CUDA when available) and write a chrome trace to `path`.

    Args:
        path: the JSON file to write; its folder is created.
        enabled: False profiles nothing and yields an empty dict (so callers need no branch).

    Yields:
        A dict filled on exit with `trace_path` (str) and `kernel_names` (list[str]).
    """
    result: dict[str, Any] = {}
    if not enabled:
        yield result
        return
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _profile(activities=_activities(), record_shapes=True) as prof:
        yield result
    prof.export_chrome_trace(str(path))
    result["trace_path"] = str(path)
    result["kernel_names"] = kernel_names(prof)


@registry.register("profiler", "none")
def no_profiler(run_dir: pathlib.Path, rank: int = 0) -> contextlib.AbstractContextManager:
    """Profile nothing: the context yields an empty dict."""
    return contextlib.nullcontext({})


@registry.register("profiler", "kernels")
def kernels_profiler(
    run_dir: pathlib.Path, rank: int = 0, kernel_pattern: str = "flash_attncute"
) -> contextlib.AbstractContextManager:
    """Kernel names of the run, in the result and in `<run_dir>/kernels_rank<rank>.txt`."""

    @contextlib.contextmanager
    def run() -> Iterator[dict[str, Any]]:
        with cuda_kernel_profiler(kernel_pattern) as result:
            yield result
        out = pathlib.Path(run_dir) / f"kernels_rank{rank}.txt"
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(out, "".join(f"{n}\n" for n in result["kernel_names"]))
        result["kernels_path"] = str(out)

    return run()


@registry.register("profiler", "trace")
def trace_profiler(run_dir: pathlib.Path, rank: int = 0) -> contextlib.AbstractContextManager:
    """A chrome trace of the run in `<run_dir>/trace_rank<rank>.json`."""
    return chrome_trace(pathlib.Path(run_dir) / f"trace_rank{rank}.json")
