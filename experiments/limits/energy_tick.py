"""How often NVML's total energy counter moves, under load: the window attngym.energy needs.

Runs bf16 matmuls on GPU 0 for 3 s while the host polls the counter; prints the intervals between
the counter's changes (ms) and the power each step implies. Usage: python energy_tick.py
"""

import itertools
import statistics
import time

import pynvml
import torch

pynvml.nvmlInit()
handle = pynvml.nvmlDeviceGetHandleByIndex(0)
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
changes = []
last = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
start = time.perf_counter()
while time.perf_counter() - start < 3.0:
    for _ in range(4):
        a @ a
    now = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
    if now != last:
        changes.append((time.perf_counter(), now - last))
        last = now
torch.cuda.synchronize()
steps = [(t1 - t0) * 1e3 for (t0, _), (t1, _) in itertools.pairwise(changes)]
watts = [mj / step for (_, mj), step in zip(changes[1:], steps, strict=True)]
print(
    f"{len(changes)} changes in 3 s; interval ms median {statistics.median(steps):.1f} "
    f"min {min(steps):.1f} max {max(steps):.1f}; implied W median {statistics.median(watts):.0f} "
    f"min {min(watts):.0f} max {max(watts):.0f}"
)
