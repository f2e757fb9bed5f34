"""Joules from NVML's total energy counter (`nvmlDeviceGetTotalEnergyConsumption`, millijoules
since the driver loaded; Volta and newer): what a timed pass costs in energy.

The counter moves in steps of milliseconds, so a pass of a millisecond is not read around one
call: `joules_per_call` runs the call enough times to span `min_s` seconds (at least `repeats`)
between two reads, synchronised, and divides. Where there is no counter (a CPU run, no NVML, a
GPU without the counter) `meter` returns None and the reason, and nothing is recorded as measured.
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
    min_s: float = 0.5,
) -> Energy:
    """The energy of one `fn()`, from enough calls to span `min_s` at `call_ms` each, at least
    `repeats`, between two synchronised reads."""
    calls = max(repeats, math.ceil(min_s * 1e3 / max(call_ms, 1e-3)))
    sync(device)
    start_mj, start_s = meter.millijoules(), time.perf_counter()
    for _ in range(calls):
        fn()
    sync(device)
    spent_j = (meter.millijoules() - start_mj) / 1e3
    return Energy(spent_j / calls, spent_j / (time.perf_counter() - start_s))
