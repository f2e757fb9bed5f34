"""Where tensors live: resolving device names, describing the hardware, reading peak memory.

Device names resolve here and nowhere else, so every component agrees on what "auto" means and an
explicit "cuda" on a machine without CUDA fails the same way everywhere (never a silent move to the
CPU). `peak_memory` gives one memory number per measured region on both kinds of device: what
CUDA's allocator peak adds on a GPU, what the process's peak resident set size adds on the CPU.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import platform
import re
import sys
from collections.abc import Iterator

import torch

log = logging.getLogger(__name__)

DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda:N")
_CUDA_INDEX = re.compile(r"cuda:(\d+)")

# The unary ops ATen hands to MKL's vector math library (aten/src/ATen/cpu/vml.h), for float32 and
# float64 tensors on the CPU.
_VML_OPS = (
    "acos", "asin", "atan", "cos", "erf", "erfc", "erfinv", "exp", "log", "log10", "log2",
    "sin", "sqrt", "tan", "tanh", "trunc",
)  # fmt: skip


@functools.cache
def settle_cpu_math() -> None:
    """Call each of MKL's vector math functions once, on one thread, before any parallel use.

    oneMKL (2024.2, as in PyTorch's wheels) picks each function's kernel on its first call; when
    that first call runs on several intra-op threads at once, one thread can compute its whole
    chunk with a low-accuracy kernel (pytorch/pytorch#188792): a float64 `exp` off by ~1e-9 in a
    process's first large call, and exact from the second on. A one-element call runs on the
    calling thread alone, so after this every process computes the same bits. Cheap (~1 ms);
    once per process; every process that computes on the CPU calls it before its first kernel.
    """
    for dtype in (torch.float32, torch.float64):
        one = torch.full((1,), 0.5, dtype=dtype)
        for op in _VML_OPS:
            getattr(torch, op)(one)


def resolve_device(name: str | torch.device) -> torch.device:
    """Turn a device name into a torch.device.

    Args:
        name: "auto" (CUDA when available, else CPU; the choice is logged), "cpu", "cuda" or
            "cuda:N", or a torch.device.

    Returns:
        The device. Explicit CUDA choices are checked against the hardware.

    Raises:
        ValueError: unknown name, or CUDA asked for where it is not available.
    """
    if isinstance(name, torch.device):
        name = str(name)
    if not isinstance(name, str):
        raise ValueError(f"device must be one of {', '.join(DEVICE_CHOICES)}; got {name!r}")
    name = name.strip().lower()
    if name == "auto":
        chosen = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        log.info("device=auto resolved to %s", chosen)
        return chosen
    if name == "cpu":
        return torch.device("cpu")
    match = _CUDA_INDEX.fullmatch(name)
    if name != "cuda" and match is None:
        raise ValueError(f"device must be one of {', '.join(DEVICE_CHOICES)}; got {name!r}")
    if not torch.cuda.is_available():
        raise ValueError(
            f"device={name!r} was requested but CUDA is not available on this machine; "
            "use device='cpu' (or device='auto' to take CUDA only when present)"
        )
    if match is not None:
        index, count = int(match.group(1)), torch.cuda.device_count()
        if index >= count:
            raise ValueError(
                f"device={name!r}: this machine has {count} CUDA device(s), "
                f"cuda:0..cuda:{count - 1}"
            )
        return torch.device("cuda", index)
    return torch.device("cuda")


def auto_dtype(device: str) -> str:
    """dtype=auto: bfloat16 on cuda, float32 on cpu."""
    return "bfloat16" if device == "cuda" else "float32"


def get_flash_block_size(device: str | torch.device = "cuda") -> tuple[int, int]:
    """Block size (q, kv) that FlexAttention's flash backend needs on this device.

    On SM100+ (Blackwell) the q block must be 256 and the kv block 128; on SM80/SM90 both are 128.
    The CPU has no flash backend and gets the default (128, 128).

    Args:
        device: "cuda", "cuda:N", "cpu", "auto" or a torch.device.

    Returns:
        (q_block, kv_block).
    """
    dev = resolve_device(device)
    if dev.type != "cuda":
        return (128, 128)
    major, _ = torch.cuda.get_device_capability(dev)
    return (256, 128) if major >= 10 else (128, 128)


def triton_backward_tiles(
    head_dim: int, dtype: str, device: str | torch.device = "cuda", *, autotune: bool = False
) -> list[tuple[int, int, int, int]] | None:
    """The (BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2) tiles Inductor tries for flex's Triton
    backward at this head_dim and dtype on this GPU (`autotune`: under a max-autotune compile
    mode, which adds its search's tiles); None where it cannot say (a CPU, or an Inductor without
    this hook). Inductor drops every tile that does not divide the block mask's block sizes
    before a user's bwd_ options apply, so a block size none of them divides has no backward
    kernel (on an H200 at head_dim 128: 64-blocks, NoValidChoicesError in the compile).
    """
    dev = resolve_device(device)
    if dev.type != "cuda":
        return None
    try:  # the hook Inductor's lowering asks (torch._inductor.choices); private, hence guarded
        from torch._inductor import config as inductor_config
        from torch._inductor.virtualized import V

        with inductor_config.patch(max_autotune=autotune):
            configs = V.choices.get_flex_attention_bwd_configs(
                head_dim, getattr(torch, dtype), "cuda"
            )
        return [(c.block_m1, c.block_n1, c.block_m2, c.block_n2) for c in configs]
    except Exception:  # any change in Inductor's internals: no rule rather than a wrong one
        log.debug("Inductor's flex backward tiles not readable", exc_info=True)
        return None


def backward_tiles_fit(
    tiles: list[tuple[int, int, int, int]], *, q: int | None = None, kv: int | None = None
) -> bool:
    """Whether one of the backward tile sets (triton_backward_tiles) divides the block sizes
    given, as Inductor filters them: q by BLOCK_M1 and BLOCK_M2, kv by BLOCK_N1 and BLOCK_N2."""
    return any(
        (q is None or (q % m1 == 0 and q % m2 == 0))
        and (kv is None or (kv % n1 == 0 and kv % n2 == 0))
        for m1, n1, m2, n2 in tiles
    )


def device_info(device: str | torch.device) -> dict:
    """What a run's metrics record about its device.

    Returns:
        A dict with `type`, `name`, `capability` ("9.0"; None on CPU), `count` (CUDA devices, or
        CPU cores), `torch` and `cuda` (None for a CPU build) versions, and `python`.
    """
    dev = resolve_device(device)
    info = {
        "type": dev.type,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        props = torch.cuda.get_device_properties(index)
        info |= {
            "name": torch.cuda.get_device_name(index),
            "capability": f"{major}.{minor}",
            "count": torch.cuda.device_count(),
            "memory_bytes": props.total_memory,
        }
    else:
        import os

        info |= {
            "name": cpu_model(),  # "AMD EPYC ...", not the architecture ("x86_64")
            "capability": None,
            "count": os.cpu_count(),
            "threads": torch.get_num_threads(),
        }
    return info


def reset_peak_memory(device: str | torch.device) -> int:
    """Start a new peak-memory window for `peak_memory_bytes`; return the bytes live now.

    The caller subtracts the returned bytes from `peak_memory_bytes` to get what the window
    itself added (`peak_memory` does both). CUDA: resets the caching allocator's peak statistics
    and returns `memory_allocated`. CPU (Linux): resets the process's peak resident set size
    (writes 5 to /proc/self/clear_refs) and returns the resident set size now, so a sweep's later
    jobs are not charged for what earlier ones left in the process. Where /proc is not there the
    peak keeps counting from process start and 0 is returned.
    """
    dev = resolve_device(device)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
        return int(torch.cuda.memory_allocated(dev))
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        log.debug("cannot reset the peak RSS here; CPU peak memory counts from process start")
        return 0
    return _proc_status_bytes("VmRSS") or 0


def peak_memory_bytes(device: str | torch.device) -> int:
    """Peak memory since the last `reset_peak_memory`, in bytes.

    CUDA: `torch.cuda.max_memory_allocated` (tensors of this process on that device). CPU: the
    peak resident set size of the whole process (VmHWM, else `resource.getrusage`), which
    includes Python, torch's own code and anything else the process holds, not only tensors.
    """
    dev = resolve_device(device)
    if dev.type == "cuda":
        return int(torch.cuda.max_memory_allocated(dev))
    hwm = _proc_status_bytes("VmHWM")
    if hwm is not None:
        return hwm
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # Linux reports KiB


@contextlib.contextmanager
def peak_memory(device: str | torch.device) -> Iterator[dict[str, int]]:
    """Measure what the block adds to the memory live when it starts.

    Yields a dict filled on exit with `bytes`: the block's own peak on that device (allocator
    bytes on CUDA; resident bytes of the process on the CPU, so it also counts what the block's
    Python and torch code touch for the first time).
    """
    live = reset_peak_memory(device)
    result: dict[str, int] = {}
    try:
        yield result
    finally:
        result["bytes"] = max(0, peak_memory_bytes(device) - live)


def _proc_status_bytes(field: str) -> int | None:
    """A `kB` field of /proc/self/status (VmRSS, VmHWM) in bytes; None where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what `platform` knows, else "cpu"."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def sync(device: str | torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU), so host timers and peaks are honest."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
