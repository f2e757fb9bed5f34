"""Joules from NVML's total energy counter (`nvmlDeviceGetTotalEnergyConsumption`, millijoules
since the driver loaded; Volta and newer): what a timed pass costs in energy.

The counter moves in steps (every 100 ms on an H200, experiments/limits/energy_tick.py), so a
read can be up to a step stale and a window of a few steps between two arbitrary reads is off by
tens of percent. `joules_per_call` therefore runs the call back to back for about `min_s` while
a thread polls the counter, takes the average power between the first and the last moment the
counter moved in the loop, and multiplies it by the loop's time per call. 0.4 s spans three
or four steps: the 200-300 ms between the first and the last is known to the poll's
millisecond, within 0.5 % (two seconds had cost a default run 4 of its 13 s, 0.6 s 1.2 of its
10). Where there is no counter (a CPU run, no NVML, a GPU without it) `meter` returns None and
the reason, and nothing is recorded as measured.
"""

from __future__ import annotations

import dataclasses
import math
import threading
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
    min_s: float = 0.4,
) -> Energy | None:
    """The energy of one `fn()`: `fn` runs back to back as many times as span `min_s` at
    `call_ms` each (at least `repeats`: a count every rank agrees on, the calls may be
    collectives) while a thread polls the counter; the average power between the counter's
    first and last steps in the loop, times the loop's time per call, is the answer. None when
    the counter moved fewer than twice in the loop, or failed to read."""
    calls = max(repeats, math.ceil(min_s * 1e3 / max(call_ms, 1e-3)))
    sync(device)
    with _Poller(meter) as poller:
        start_s = time.perf_counter()
        for _ in range(calls):
            fn()
        sync(device)
        end_s = time.perf_counter()
    steps = [(mj, at) for mj, at in poller.steps if start_s < at <= end_s]
    if len(steps) < 2:
        return None
    (first_mj, first_s), (last_mj, last_s) = steps[0], steps[-1]
    watts = (last_mj - first_mj) / 1e3 / (last_s - first_s)
    return Energy(watts * (end_s - start_s) / calls, watts)


class _Poller(threading.Thread):
    """Reads the counter every millisecond, apart from the calls (an NVML read takes
    milliseconds: read between calls, it would leave the device idle), and keeps every step:
    (the counter's new value, when it was seen)."""

    def __init__(self, meter: Meter):
        super().__init__(daemon=True)
        self._meter, self._done = meter, threading.Event()
        self.steps: list[tuple[int, float]] = []

    def run(self) -> None:
        try:
            seen = self._meter.millijoules()
            while not self._done.wait(1e-3):
                now = self._meter.millijoules()
                if now != seen:
                    self.steps.append((now, time.perf_counter()))
                    seen = now
        except Exception:  # noqa: BLE001 - a counter that fails mid-loop measured nothing
            self.steps.clear()

    def __enter__(self) -> _Poller:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self.join()
