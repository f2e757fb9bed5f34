"""The device's peak dense bf16/fp16 TFLOP/s, the denominator of every `*_peak_fraction`.

Two sources, and a run says which (`peak_source`):

    table   the vendor's datasheet figure for a known GPU (KNOWN, with its source): dense tensor
            core bf16/fp16 TFLOP/s, i.e. the datasheet's "with sparsity" figure halved;
    probe   for a GPU not in the table: a bf16 8192 x 8192 x 8192 matmul timed once per device
            name and torch version, cached in <cache folder>/peak.json. A probe is what a matmul
            reaches, below the datasheet (695 of 989 TFLOP/s on an H200), so a fraction of it
            reads higher than a fraction of the datasheet peak.

Only bf16 and fp16 runs on CUDA have a peak here; other runs record why not (`peak`'s reason).
"""

from __future__ import annotations

import dataclasses
import json
import logging

import torch

log = logging.getLogger(__name__)

PEAK_DTYPES = ("bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class Known:
    """A datasheet entry: `marks` all in the CUDA device name picks it (first match wins)."""

    marks: tuple[str, ...]
    tflops: float
    source: str


# Dense bf16/fp16 tensor-core TFLOP/s; more specific names first (H100 NVL before H100).
KNOWN: tuple[Known, ...] = (
    Known(("H200", "NVL"), 835.5, "NVIDIA H200 NVL datasheet: 1,671 TFLOPS BF16 with sparsity"),
    Known(("H200",), 989.5, "NVIDIA H200 SXM datasheet: 1,979 TFLOPS BF16 with sparsity"),
    Known(("H100", "NVL"), 835.5, "NVIDIA H100 NVL datasheet: 1,671 TFLOPS BF16 with sparsity"),
    Known(("H100", "PCIe"), 756.5, "NVIDIA H100 PCIe datasheet: 1,513 TFLOPS BF16 with sparsity"),
    Known(("H100",), 989.5, "NVIDIA H100 SXM datasheet: 1,979 TFLOPS BF16 with sparsity"),
    Known(("A100",), 312.0, "NVIDIA A100 datasheet: 312 TFLOPS BF16 dense (624 with sparsity)"),
    Known(("L40S",), 366.5, "NVIDIA L40S datasheet: 733 TFLOPS BF16 with sparsity"),
    Known(("L4",), 121.0, "NVIDIA L4 datasheet: 242 TFLOPS BF16 with sparsity"),
    Known(("B200",), 2250.0, "NVIDIA HGX B200 datasheet: 4.5 PFLOPS FP16/BF16 with sparsity"),
)


@dataclasses.dataclass(frozen=True)
class Peak:
    """A device's peak: TFLOP/s and where it comes from; or None and why there is none."""

    tflops: float | None
    source: str


def peak(device: torch.device | str, dtype: str, *, probe: bool = True) -> Peak:
    """The peak dense TFLOP/s of `device` for `dtype` runs: the table's, else a cached probe's
    (`probe=False`: no probe, the reason instead); None with the reason where there is none."""
    device = torch.device(device)
    if device.type != "cuda":
        return Peak(None, f"no peak for {device.type} devices")
    if dtype not in PEAK_DTYPES:
        return Peak(None, f"the peak is for bf16/fp16 runs, this one is {dtype}")
    name = torch.cuda.get_device_name(device)
    for entry in KNOWN:
        if all(mark in name for mark in entry.marks):
            return Peak(entry.tflops, f"table: {entry.source}")
    if not probe:
        return Peak(None, f"{name!r} is not in the peak table")
    return _probed(device, name)


def _probed(device: torch.device, name: str) -> Peak:
    """The matmul probe's TFLOP/s for this device name and torch version, measured on first use."""
    from attngym import compile_cache

    path = compile_cache.root() / "peak.json"
    key = f"{name} | torch {torch.__version__}"
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    if key not in cached:
        cached[key] = matmul_tflops(device)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(cached, indent=1))
        except OSError as exc:  # a read-only home: the number still serves this run
            log.warning("peak probe not cached in %s: %s", path, exc)
    return Peak(cached[key], f"probe: a bf16 8192^3 matmul on {name} (cached in {path})")


def matmul_tflops(device: torch.device, n: int = 8192) -> float:
    """TFLOP/s of a bf16 n x n x n matmul on `device` (median of 20, after warm-up)."""
    from attngym import bench

    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    timing = bench.time_fn(lambda: a @ b, warmup=5, repeats=20, device=device)
    return bench.tflops(2.0 * n**3, timing.median_ms)
