"""Joules from NVML's total energy counter (`nvmlDeviceGetTotalEnergyConsumption`, millijoules
since the driver loaded; Volta and newer): what a timed pass costs in energy.

The counter moves in steps (every 100 ms on an H200, experiments/limits/energy_tick.py), so a
read can be up to a step stale and a window of a few steps between two arbitrary reads is off by
tens of percent. `joules_per_call` therefore runs the call in a loop of about `min_s`, takes the
average power between the first and the last moment the counter moved in it (the device busy
throughout), and multiplies it by the loop's time per call. Where there is no counter (a CPU
run, no NVML, a GPU without it) `meter` returns None and the reason, and nothing is recorded as
measured.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import torch

from attngym.device import sync


@dataclasses.dataclass(frozen=True)
class Energy:
    """One pass's energy: joules per call and the average watts over the calls."""

    joules: float
    watts: float


class Meter:
    """NVML's energy counter of one CUDA device."""

    def __init__(self, handle: Any, nvml: Any):
        self._handle, self._nvml = handle, nvml

    def millijoules(self) -> int:
        return int(self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle))


def meter(device: torch.device | str) -> tuple[Meter | None, str]:
    """(the device's Meter, "nvml total energy counter"), or (None, why it has none)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None, f"no energy counter on {device.type} devices"
    try:
        import pynvml

        pynvml.nvmlInit()
        index = device.index if device.index is not None else torch.cuda.current_device()
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        handle = pynvml.nvmlDeviceGetHandleByUUID(
            uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
        )
        found = Meter(handle, pynvml)
        found.millijoules()  # NotSupported on GPUs without the counter
    except Exception as exc:  # noqa: BLE001 - any NVML failure means: not measured, and why
        return None, f"NVML's energy counter is not readable ({exc})"
    return found, "nvml total energy counter"


def joules_per_call(
    meter: Meter,
    fn: Callable[[], Any],
    device: torch.device,
    *,
    call_ms: float,
    repeats: int,
    min_s: float = 2.0,
) -> Energy | None:
    """The energy of one `fn()`: `fn` runs as many times as span `min_s` at `call_ms` each (at
    least `repeats`: a count every rank agrees on, the calls may be collectives), the counter is
    read after each call, and the average power between its first and last steps in the loop
    times the loop's time per call is the answer. None when the counter moved fewer than twice."""
    calls = max(repeats, math.ceil(min_s * 1e3 / max(call_ms, 1e-3)))
    sync(device)
    start_s, seen = time.perf_counter(), meter.millijoules()
    steps: list[tuple[int, float]] = []  # (the counter's new value, when the host saw it)
    for _ in range(calls):
        fn()
        now = meter.millijoules()
        if now != seen:
            steps.append((now, time.perf_counter()))
            seen = now
    sync(device)
    per_call_s = (time.perf_counter() - start_s) / calls
    if len(steps) < 2:
        return None
    (first_mj, first_s), (last_mj, last_s) = steps[0], steps[-1]
    watts = (last_mj - first_mj) / 1e3 / (last_s - first_s)
    return Energy(watts * per_call_s, watts)
