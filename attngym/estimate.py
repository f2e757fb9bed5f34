"""How much memory and work a run needs, against what its device has, before any tensor exists.

A run that does not fit should stop in one line before it allocates, not be killed by the kernel's
out-of-memory killer a minute later with nothing written. `estimate` adds up the bytes a run
holds at its peak from the shape alone, names the config key that drives them, and says which
baselines would not fit even on their own (those are skipped with that reason, the run goes on).

The model (an upper-bound estimate, not an allocator trace; the parts are reported separately):

* resident for the whole run: q, k, v, the output and its lse, and for a backward the grads of
  q, k, v and of the output; in context parallelism each rank holds 1/world_size of them plus
  the K/V shards in flight (two, as a send and a receive buffer);
* the block mask: for every (q block, kv block) pair, the partial and full index tables in both
  directions, 4 bytes each;
* the largest transient, one at a time (the phases run one after another): the flex kernel
  (on the CPU eager flex computes the whole (S x S) score matrix per batch and head, in float32,
  twice: scores and probabilities; compiled CUDA flex works tile by tile), the float64 reference
  over `validate_rows` rows (scores, probabilities and their grads: O(rows x S)), and each
  baseline: SDPA on the CPU runs the math backend, (S x S) per batch and head like eager flex;
  `sdpa_dense_mask` adds its (S x S) mask or bias, shared by batch and heads (a mask of more
  than `max_mask_bytes` entries is not attempted, so it adds nothing);
* on the CPU, every process (one per rank) also holds Python and torch, ~`PROCESS_BYTES`.

On CUDA the figure is compared with the free memory of the device (`torch.cuda.mem_get_info`), on
the CPU with the available RAM (`MemAvailable` of /proc/meminfo), which all ranks share. Under
torchrun every rank judges on its own, before the ranks can talk, and free memory differs from
GPU to GPU: there the figure is compared with the total memory (`MemTotal` on a CPU), the same on
every rank of like machines, so the ranks agree on refusing a run or skipping a baseline (a
refusal on one rank alone would leave the others waiting in collectives).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Iterable, Mapping

import torch

from attngym.bench import attention_flops

log = logging.getLogger(__name__)

DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
# Python, torch, Hydra and matplotlib in one process. Calibrated on a CPU build with the default
# config: max RSS 1.26 GiB at S=4096 (0.54 GiB of it the S x S terms below) and ~10 GB at
# S=16384, where this model gives 1.25 GiB and 9.8 GiB.
PROCESS_BYTES = 700 * 2**20
CUDA_BACKENDS = ("sdpa_cudnn", "sdpa_flash", "sdpa_efficient")  # skipped on a CPU anyway
# Ranks a CPU core may carry. Ranks share the cores they outnumber and attend in lock-step (each
# step waits for the slowest), so P ranks on C < P cores take about P / C times as long, and
# their timings measure the sharing, not the algorithm: above the cores a warning says so. Past
# this many ranks a core a run takes many times its time on enough cores (and every rank's
# process holds PROCESS_BYTES): refused. 3 ranks on 2 cores, the usual way to test an odd world
# size on a laptop, is well inside.
RANKS_PER_CORE = 4
SHAPE_KEYS = ("shape.seq_len", "shape.batch", "shape.heads")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Estimate:
    """What a run needs against what its device has.

    Attributes:
        device: "cpu" or "cuda".
        needed_bytes: peak bytes of the run with the baselines that fit.
        available_bytes: free device memory (CUDA) or available RAM (CPU); None when unknown.
        parts: the terms of `needed_bytes` (resident, block_mask, flex, reference, process).
        skipped_baselines: {baseline: why it alone would not fit}.
        key: the config key to shrink when the run does not fit, else None.
        problem: a one-line reason the run cannot start (memory or ranks), else None.
        flops: forward FLOPs of the dense problem (an upper bound of the work; masks skip some).
    """

    device: str
    needed_bytes: int
    available_bytes: int | None
    parts: Mapping[str, int]
    skipped_baselines: Mapping[str, str]
    key: str | None
    problem: str | None
    flops: float

    @property
    def fits(self) -> bool:
        return self.problem is None


def estimate(
    *,
    batch: int,
    heads: int,
    seq_len: int,
    head_dim: int,
    dtype: str,
    device: str | torch.device,
    kv_heads: int | None = None,
    passes: Iterable[str] = ("fwd",),
    baselines: Iterable[str] = (),
    validate_rows: int = 0,
    world_size: int = 1,
    block_size: tuple[int, int] = (128, 128),
    available_bytes: int | None = None,
    cpu_cores: int | None = None,
    max_mask_bytes: int | None = None,
) -> Estimate:
    """Estimate the peak memory of a run and check it against the device.

    Args:
        batch, heads, seq_len, head_dim: the shape (B, H, S, D); kv_heads G defaults to H.
        dtype: "float32", "bfloat16", "float16" or "float64" (resolved, not "auto").
        device: "cpu", "cuda" or "cuda:N" (resolved, not "auto").
        passes: "fwd" and/or "bwd".
        baselines: baseline names (attngym.runner.config.BASELINES).
        validate_rows: query rows checked against the float64 reference (0: no validation).
        world_size: ranks of context parallelism (1: one device).
        block_size: the block mask's (q, kv) block.
        available_bytes: what the device has; default: measured (free GPU memory or MemAvailable).
        cpu_cores: CPU cores usable; default: measured (the process's affinity).
        max_mask_bytes: the config's baseline_max_mask_bytes: a larger dense mask is skipped.

    Returns:
        The Estimate; `problem` and `key` are set when the run cannot start.
    """
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}; got {dtype!r}")
    dev = torch.device(device)
    on_cpu = dev.type == "cpu"
    elem = DTYPE_BYTES[dtype]
    groups = kv_heads or heads
    passes = tuple(passes)
    backward = "bwd" in passes
    flops = attention_flops(batch, heads, seq_len, seq_len, head_dim)

    if on_cpu:
        cores = cpu_cores if cpu_cores is not None else _cpu_cores()
        if cores < world_size <= RANKS_PER_CORE * cores:
            log.warning(
                "topology.world_size=%d ranks share this CPU's %d core(s): the run takes about "
                "%.1fx as long and its timings measure the sharing",
                world_size,
                cores,
                world_size / cores,
            )
        if world_size > RANKS_PER_CORE * cores:
            return Estimate(
                device=dev.type,
                needed_bytes=0,
                available_bytes=available_bytes,
                parts={},
                skipped_baselines={},
                key="topology.world_size",
                problem=(
                    f"topology.world_size={world_size} runs one process per rank, and this CPU "
                    f"has {cores} core(s): at most {RANKS_PER_CORE} ranks a core, "
                    f"topology.world_size<={RANKS_PER_CORE * cores} (ranks attend in lock-step, "
                    f"so {world_size} ranks take about {world_size / cores:.0f}x as long)"
                ),
                flops=flops,
            )

    # Resident tensors. q, out (B, H, S, D); k, v (B, G, S, D); lse (B, H, S) float32.
    q_bytes = batch * heads * seq_len * head_dim * elem
    kv_bytes = 2 * batch * groups * seq_len * head_dim * elem
    lse_bytes = batch * heads * seq_len * 4
    resident = 2 * q_bytes + kv_bytes + lse_bytes
    if backward:
        resident += 2 * q_bytes + kv_bytes  # grad_out, dq, dk, dv
    if world_size > 1:
        shards_in_flight = 2 * kv_bytes // world_size
        resident += shards_in_flight * (world_size if on_cpu else 1)
        if not on_cpu:
            resident //= world_size  # one GPU per rank: each holds its share
    nq, nkv = math.ceil(seq_len / block_size[0]), math.ceil(seq_len / block_size[1])
    block_mask = 4 * 4 * nq * nkv

    # Transients, one phase at a time.
    chunk = seq_len // world_size if world_size > 1 else seq_len
    # Eager flex on the CPU: (chunk x S) float32 scores and probabilities per (b, h), in every
    # rank's process at once; compiled flex on CUDA adds nothing of that order.
    flex = 2 * batch * heads * chunk * seq_len * 4 * world_size if on_cpu else 0
    reference = reference_bytes(batch, heads, validate_rows, seq_len, backward=backward)
    transients = {"flex": flex, "reference": reference}
    baseline_bytes = {
        name: _baseline_bytes(name, on_cpu, batch, heads, seq_len, elem)
        for name in baselines
        if not (on_cpu and name in CUDA_BACKENDS)
        and not (
            name == "sdpa_dense_mask"
            and max_mask_bytes is not None
            and seq_len * seq_len > max_mask_bytes
        )
    }

    parts = {"resident": resident, "block_mask": block_mask, **transients}
    if on_cpu:
        parts["process"] = PROCESS_BYTES * world_size
    base = resident + block_mask + parts.get("process", 0)
    have = available_bytes if available_bytes is not None else available_memory(dev)

    skipped = {}
    for name, extra in baseline_bytes.items():
        if have is not None and base + extra > have:
            skipped[name] = (
                f"needs ~{format_bytes(base + extra)} with the run's tensors, "
                f"{format_bytes(have)} available"
            )
    kept = [b for n, b in baseline_bytes.items() if n not in skipped]
    needed = base + max([flex, reference, *kept])

    key = problem = None
    if have is not None and needed > have:
        shape = {"batch": batch, "heads": heads, "seq_len": seq_len, "head_dim": head_dim}
        rows = min(validate_rows, seq_len)
        # The run at the least each term's own key leaves of it: one validated row, one process.
        least = {"reference": reference // rows if rows else 0, "process": PROCESS_BYTES}
        key = _key_to_shrink(parts, shape, least, have, kept)
        where = "free GPU memory" if not on_cpu else "available RAM"
        problem = (
            f"{key}: this run needs ~{format_bytes(needed)} at its peak "
            f"({_largest(parts)}), {format_bytes(have)} {where}; shrink {key}"
        )
    return Estimate(
        device=dev.type,
        needed_bytes=needed,
        available_bytes=have,
        parts=parts,
        skipped_baselines=skipped,
        key=key,
        problem=problem,
        flops=flops,
    )


# A large problem of today, per dimension: the dimension of a term furthest beyond it is the one
# to shrink (head_dim=100000 is the cause, not seq_len=1024).
LARGE_SHAPE = {"batch": 8, "heads": 64, "seq_len": 131072, "head_dim": 256}
# The dimensions each term of `parts` grows with.
GROWS_WITH = {
    "resident": ("batch", "heads", "seq_len", "head_dim"),
    "flex": ("batch", "heads", "seq_len"),
    "reference": ("batch", "heads", "seq_len"),
    "block_mask": ("seq_len",),
}
# The key that shrinks a term that is no shape dimension's alone.
TERM_KEYS = {"reference": "validate_rows", "process": "topology.world_size"}


def _key_to_shrink(
    parts: Mapping[str, int],
    shape: Mapping[str, int],
    least: Mapping[str, int],
    have: int,
    baselines: Iterable[int],
) -> str:
    """The config key that can make the run fit, for the largest term of `parts` first: its own
    key (validate_rows for the reference, topology.world_size for CPU processes) when the run
    fits with that term at its `least`; else the dimension of the term furthest beyond
    LARGE_SHAPE (head_dim=100000 is the cause, not seq_len=1024), which shrinks every term."""
    transients = ("flex", "reference")
    kept = list(baselines)
    for term in sorted(parts, key=lambda name: parts[name], reverse=True):
        if term in TERM_KEYS:
            smaller = {**parts, term: least[term]}
            base = sum(v for k, v in smaller.items() if k not in transients)
            if base + max([*(smaller[k] for k in transients), *kept]) <= have:
                return TERM_KEYS[term]
        if term in GROWS_WITH:
            dims = GROWS_WITH[term]
            return "shape." + max(dims, key=lambda d: shape[d] / LARGE_SHAPE[d])
    return "shape.seq_len"


def _baseline_bytes(name: str, on_cpu: bool, batch: int, heads: int, seq: int, elem: int) -> int:
    """Transient bytes of one baseline's call beyond the run's own tensors."""
    square = batch * heads * seq * seq  # entries of the (S x S) matrices of every (b, h)
    math_backend = 2 * square * max(elem, 4) if on_cpu else 0  # scores and probabilities
    if name == "sdpa_dense_mask":
        return math_backend + seq * seq * elem  # a bias in dtype (a bool mask is smaller)
    if name == "sdpa":
        return math_backend
    return 0  # flex_default (like flex) and the CUDA backends work tile by tile


def _largest(parts: Mapping[str, int]) -> str:
    name = max(parts, key=lambda k: parts[k])
    return f"largest: {name} ~{format_bytes(parts[name])}"


def reference_bytes(batch: int, heads: int, rows: int, seq_len: int, *, backward: bool) -> int:
    """The float64 reference's transient for a group of `rows` query rows: (rows x S) scores,
    probabilities and mask per (b, h), twice with a backward (validation.validate_rows)."""
    once = 3 * batch * heads * min(rows, seq_len) * seq_len * 8
    return 2 * once if backward else once


def available_memory(device: str | torch.device, *, total: bool = False) -> int | None:
    """Free memory of a CUDA device, or MemAvailable of /proc/meminfo on a CPU (else None);
    with `total`, the device's whole memory (MemTotal), the same on every rank of like machines."""
    dev = torch.device(device)
    if dev.type == "cuda":
        free, whole = torch.cuda.mem_get_info(dev)
        return int(whole if total else free)
    field = "MemTotal:" if total else "MemAvailable:"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return None


def _cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def format_bytes(value: int | float) -> str:
    """Bytes as a person reads them: 512 B, 3.2 MiB, 10.5 GiB, 1.2 TiB."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= size:
            scaled = value / size
            return f"{scaled:,.0f} {unit}" if abs(scaled) >= 1000 else f"{scaled:.3g} {unit}"
    return f"{int(value)} B"
