"""Typed run settings, checked from the composed Hydra config before any tensor work.

`Settings` is what tasks receive. Every field is plain Python (no OmegaConf), so tasks and the
library can be driven from a notebook too. `from_config(cfg)` (added by the framework) turns a
DictConfig into Settings and raises ConfigError naming the dotted key of the first bad value.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(kw_only=True)
class Shape:
    """Problem size. Tensors are (batch, heads, seq_len, head_dim); K/V have kv_heads heads."""

    batch: int = 1  # B
    heads: int = 4  # H, query heads
    kv_heads: int | None = None  # G, key/value heads (GQA); None = heads
    seq_len: int = 512  # S, whole sequence (all ranks together)
    head_dim: int = 64  # D


@dataclasses.dataclass(kw_only=True)
class Topology:
    """How the sequence is spread over ranks."""

    kind: str = "single"  # single | ring | allgather
    world_size: int = 1  # ranks (resolved: never "auto" here)
    transport: str = "auto"  # auto | copy_engine | nccl | gloo (resolved at build time)
    layout: str = "contiguous"  # contiguous | zigzag
    timeout_s: float = 120.0  # a rank that waits longer than this fails the run


@dataclasses.dataclass(kw_only=True)
class Benchmark:
    warmup: int = 2  # untimed calls before timing (compile excluded separately)
    repeats: int = 5  # timed calls; median/min/max reported


@dataclasses.dataclass(kw_only=True)
class Settings:
    """Everything a task needs to run one configuration."""

    attention: dict[str, Any]  # {"name": ..., **params} or {"name": ..., "compose": [...]}
    shape: Shape = dataclasses.field(default_factory=Shape)
    topology: Topology = dataclasses.field(default_factory=Topology)
    benchmark: Benchmark = dataclasses.field(default_factory=Benchmark)
    device: str = "cpu"  # resolved: cpu | cuda
    dtype: str = "float32"  # resolved: float32 | bfloat16 | float16 | float64
    block_size: tuple[int, int] = (128, 128)  # (q, kv) block-mask block size
    kernel_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    compile: bool = True  # compile flex_attention on CUDA
    passes: tuple[str, ...] = ("fwd", "bwd")  # which passes to time
    baselines: tuple[str, ...] = ()  # sdpa, sdpa_dense_mask, ... (CUDA)
    validate: bool = True  # compare against the dense reference
    validate_rows: int = 256  # at most this many query rows are checked when S is large
    seed: int = 0
    profiler: str = "none"  # none | kernels | trace
