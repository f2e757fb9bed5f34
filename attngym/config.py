"""Typed run settings, checked from the composed Hydra config before any tensor work.

`Settings` is what tasks receive. Every field is plain Python (no OmegaConf), so tasks and the
library can be driven from a notebook too.

Checking happens in two steps, so that configs stay pure:

- `check_config(cfg)` looks at values only (types, ranges, choices, the variant and its parameters,
  seq_len against world_size and the variant): it never probes hardware, so it gives the same answer
  on a laptop and on a GPU node, and tests can run it anywhere.
- `from_config(cfg)` runs `check_config`, then resolves the `auto` values against this machine
  (device, dtype, world_size, a `flash` block size) and checks what depends on it (device=cuda
  without CUDA, more ranks than GPUs). It still runs before any tensor is allocated.

Every bad value raises `attngym.errors.ConfigError(key, message)` with the dotted key, the value
received and what is allowed, so the CLI can print one line.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from attngym.errors import ConfigError, choice_error

log = logging.getLogger(__name__)


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
    compile_mode: str = "default"  # torch.compile mode (attngym.kernels.COMPILE_MODES)
    passes: tuple[str, ...] = ("fwd", "bwd")  # which passes to time
    baselines: tuple[str, ...] = ()  # sdpa, sdpa_dense_mask, ... (CUDA)
    validate: bool = True  # compare against the dense reference
    validate_rows: int = 256  # at most this many query rows are checked when S is large
    seed: int = 0
    profiler: str = "none"  # none | kernels | trace
    baseline_max_mask_bytes: int = 256 * 2**20  # dense SDPA masks larger than this are skipped
    logger: dict[str, Any] = dataclasses.field(default_factory=lambda: {"name": "none"})

    def describe(self) -> dict[str, Any]:
        """The metrics that describe the configuration (variant, shape, topology, dtype, blocks,
        kernel options as `kernel_options.<NAME>`, and the device: gpu, capability, torch)."""
        from attngym.device import device_info

        s = self.shape
        info = device_info(self.device)
        options = {f"kernel_options.{k}": v for k, v in sorted(self.kernel_options.items())}
        return {
            "variant": str(self.attention.get("name")),
            "topology": self.topology.kind,
            "world_size": self.topology.world_size,
            "transport": self.topology.transport,
            "layout": self.topology.layout if self.topology.kind != "single" else None,
            "device": self.device,
            "dtype": self.dtype,
            "batch": s.batch,
            "heads": s.heads,
            "kv_heads": s.kv_heads or s.heads,
            "seq_len": s.seq_len,
            "head_dim": s.head_dim,
            "block_q": self.block_size[0],
            "block_kv": self.block_size[1],
            **options,
            "gpu": info["name"],
            "capability": info["capability"],
            "torch": info["torch"],
        }


# ---------------------------------------------------------------------------------------------
# Choices. Components that register themselves (tasks, profilers, trackers) are read from
# attngym.registry, so a new one is accepted as soon as it registers. Choices the library owns
# (transports, layouts, W&B modes) are imported from it inside the checks, so each tuple is
# defined once and `import attngym.config` stays light; attngym.inputs maps DTYPES to torch.

DTYPES = ("auto", "float32", "bfloat16", "float16", "float64")
DEVICES = ("auto", "cpu", "cuda")
PASSES = ("fwd", "bwd")
# sdpa: SDPA's own dispatch; sdpa_<backend>: that backend forced; sdpa_dense_mask: the variant as a
# dense mask/bias; flex_default: compiled flex at (128, 128) with no kernel options (the contender
# a tuned block size or kernel options are measured against). These run in single-device runs;
# CP_BASELINES in context-parallel runs (torch_cp: PyTorch's own flex context parallelism). Each
# task runs the ones of its own kind, so one default list serves both.
SINGLE_BASELINES = (
    "sdpa",
    "sdpa_cudnn",
    "sdpa_flash",
    "sdpa_efficient",
    "sdpa_dense_mask",
    "flex_default",
)
CP_BASELINES = ("torch_cp",)
BASELINES = (*SINGLE_BASELINES, *CP_BASELINES)


def _flash_block_size(device: str) -> tuple[int, int]:
    from attngym.device import get_flash_block_size

    return tuple(get_flash_block_size(device))  # type: ignore[return-value]


# Named block sizes, resolved against the device when the run starts (e.g. `block_size=flash`).
# Each maps the resolved device name to (q, kv).
BLOCK_SIZE_RESOLVERS: dict[str, Callable[[str], tuple[int, int]]] = {"flash": _flash_block_size}


def plain(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """A nested dict/list copy of a mapping (the `hydra` node left out), so Settings hold no
    OmegaConf nodes; the CLI resolves interpolations before (attngym.cli.to_plain)."""

    def copy(node: Any) -> Any:
        if isinstance(node, Mapping):
            return {str(k): copy(v) for k, v in node.items()}
        if isinstance(node, Sequence) and not isinstance(node, str):
            return [copy(v) for v in node]
        return node

    data = copy(cfg)
    data.pop("hydra", None)
    return data


def _get(data: Mapping[str, Any], key: str, default: Any = ...) -> Any:
    node: Any = data
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            if default is ...:
                raise ConfigError(key, "missing; it has no default")
            return default
        node = node[part]
    return node


def _int(data: Mapping[str, Any], key: str, *, low: int = 1, default: Any = ...) -> int:
    value = _get(data, key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        need = "a positive integer" if low == 1 else f"an integer >= {low}"
        raise ConfigError(key, f"must be {need}, got {value!r}")
    return value


def _bool(data: Mapping[str, Any], key: str, default: Any = ...) -> bool:
    value = _get(data, key, default)
    if not isinstance(value, bool):
        raise ConfigError(key, f"must be true or false, got {value!r}")
    return value


def _choice(data: Mapping[str, Any], key: str, choices: Any, what: str, default: Any = ...) -> str:
    value = _get(data, key, default)
    choices = list(choices)
    if value not in choices:
        raise ConfigError(key, choice_error(what, value, choices))
    return value


def _names(kind: str) -> list[str]:
    from attngym import registry

    return registry.names(kind)


# `block_size=tuned`: block size and kernel options from attngym/tuned.json (see attngym.tuning).
TUNED = "tuned"


def _block(data: Mapping[str, Any], key: str) -> int | str:
    value = _get(data, key)
    named = sorted([*BLOCK_SIZE_RESOLVERS, TUNED])
    bad_int = isinstance(value, bool) or not isinstance(value, int) or value < 16 or value % 16
    if (value not in named) if isinstance(value, str) else bad_int:
        raise ConfigError(
            key, f"must be a positive multiple of 16 or one of {named}, got {value!r}"
        )
    return value


def _seq_divides(seq_len: int, world_size: int, layout: str) -> None:
    chunks = 2 * world_size if layout == "zigzag" else world_size
    if seq_len % chunks:
        why = f"2 x world_size = {chunks} chunks (zigzag)" if layout == "zigzag" else "world_size"
        raise ConfigError(
            "shape.seq_len",
            f"{seq_len} does not split into {why}; pick a multiple of {chunks}",
        )


def _flash(kernel_options: Mapping[str, Any] | None) -> bool:
    """attngym.kernels.is_flash, imported when first needed: `import attngym.config` pulls no
    torch."""
    from attngym.kernels import is_flash as kernels_is_flash

    return kernels_is_flash(kernel_options)


def _check_flash(kernel_options: Mapping[str, Any], dtype: str) -> None:
    """BACKEND=FLASH needs a 16-bit dtype (judged on values only; `auto` is judged later)."""
    if _flash(kernel_options) and dtype in ("float32", "float64"):
        raise ConfigError(
            "kernel_options.BACKEND",
            f"FLASH needs a 16-bit dtype (bfloat16 or float16), but dtype={dtype}",
        )


def _check_flash_topology(kernel_options: Mapping[str, Any], kind: str, passes: list) -> None:
    """Context parallelism differentiates through each chunk's lse; FLASH's backward cannot."""
    if _flash(kernel_options) and kind != "single" and "bwd" in passes:
        raise ConfigError(
            "kernel_options.BACKEND",
            f"FLASH has no gradient for the log-sum-exp, which topology={kind} merges chunks "
            "with; use passes=[fwd] or drop BACKEND",
        )


def _check_flash_device(
    kernel_options: Mapping[str, Any], device: str, block_size: tuple[int, int]
) -> None:
    """BACKEND=FLASH on the resolved device: a CUDA device, and the block size its kernel has.

    The flash kernel is built for one block size per GPU generation
    (attngym.device.get_flash_block_size); any other block mask cannot run on it.
    """
    if not _flash(kernel_options):
        return
    if device != "cuda":
        raise ConfigError(
            "kernel_options.BACKEND",
            f"FLASH is a CUDA backend, but device={device}; use device=cuda or drop BACKEND",
        )
    need = _flash_block_size(device)
    if tuple(block_size) != need:
        raise ConfigError(
            "block_size",
            f"FLASH needs block_size (q, kv) = {need} on this GPU, got {tuple(block_size)}; "
            "use block_size=flash",
        )


def check_config(cfg: Any) -> dict[str, Any]:
    """Check every value that can be judged without hardware; return the resolved plain dict.

    Args:
        cfg: the composed config (DictConfig) or an equivalent nested dict.

    Raises:
        ConfigError: the first bad value, named by its dotted key.
    """
    data = plain(cfg)
    for name in ("batch", "heads", "seq_len", "head_dim"):
        _int(data, f"shape.{name}")
    heads = data["shape"]["heads"]
    kv_heads = _get(data, "shape.kv_heads", None)
    if kv_heads is not None:
        kv_heads = _int(data, "shape.kv_heads")
        if heads % kv_heads:
            raise ConfigError(
                "shape.kv_heads",
                f"{kv_heads} does not divide shape.heads={heads}; use a divisor of {heads}",
            )
    seq_len = data["shape"]["seq_len"]
    dtype = _choice(data, "dtype", DTYPES, "dtype", "auto")
    _int(data, "seed", low=0, default=0)
    _bool(data, "validate", True)
    _int(data, "validate_rows", default=256)
    passes = _get(data, "passes", ["fwd", "bwd"])
    if not isinstance(passes, list) or not passes:
        raise ConfigError("passes", f"must be a non-empty list of {list(PASSES)}, got {passes!r}")
    for p in passes:
        if p not in PASSES:
            raise ConfigError("passes", choice_error("pass", p, PASSES))
    compile_ = _bool(data, "compile", True)
    from attngym.kernels import COMPILE_MODES

    _choice(data, "compile_mode", COMPILE_MODES, "compile mode", "default")
    kernel_options = _get(data, "kernel_options", {}) or {}
    if not isinstance(kernel_options, Mapping):
        raise ConfigError("kernel_options", f"must be a mapping, got {kernel_options!r}")
    _check_flash(kernel_options, dtype)
    if _flash(kernel_options) and not compile_:
        raise ConfigError(
            "compile",
            "BACKEND=FLASH is a torch.compile (Inductor) kernel; compile=false would run flex's "
            "eager path without it; use compile=true or drop kernel_options.BACKEND",
        )
    _int(data, "benchmark.warmup", low=0, default=2)
    _int(data, "benchmark.repeats", default=5)
    baselines = _get(data, "baselines", []) or []
    if not isinstance(baselines, list):
        raise ConfigError("baselines", f"must be a list of {list(BASELINES)}, got {baselines!r}")
    for b in baselines:
        if b not in BASELINES:
            raise ConfigError("baselines", choice_error("baseline", b, BASELINES))
    _int(data, "baseline_max_mask_bytes", low=0, default=256 * 2**20)
    _block(data, "block_size.q")
    _block(data, "block_size.kv")
    _choice(data, "device.name", DEVICES, "device")

    kind = _choice(data, "topology.kind", _names("task"), "topology kind")
    _check_flash_topology(kernel_options, kind, passes)
    world_size = _get(data, "topology.world_size", 1)
    if world_size != "auto":
        world_size = _int(data, "topology.world_size")
        if kind == "single" and world_size != 1:
            raise ConfigError(
                "topology.world_size", f"must be 1 (or auto) for topology single, got {world_size}"
            )
    from attngym.distributed.layout import LAYOUTS
    from attngym.distributed.transport import TRANSPORTS

    _choice(data, "topology.transport", TRANSPORTS, "transport", "auto")
    layout = _choice(data, "topology.layout", LAYOUTS, "layout", "contiguous")
    timeout = _get(data, "topology.timeout_s", 120.0)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
        raise ConfigError("topology.timeout_s", f"must be a positive number, got {timeout!r}")
    if isinstance(world_size, int):
        _seq_divides(seq_len, world_size, layout)

    _choice(data, "profiler.name", _names("profiler"), "profiler")
    logger = _choice(data, "logger.name", _names("tracker"), "logger")
    if logger == "wandb":
        from attngym.tracking.wandb_logger import MODES

        _choice(data, "logger.mode", MODES, "wandb mode", "offline")

    from attngym.variants.spec import build_variant

    build_variant(_get(data, "attention"), key="attention", seq_len=seq_len)
    return data


def _resolve_device(name: str) -> str:
    """`device.name` resolved by attngym.device.resolve_device (the one resolver): cpu | cuda."""
    from attngym.device import resolve_device

    try:
        return resolve_device(name).type
    except ValueError as err:
        raise ConfigError("device.name", str(err)) from None


def _resolve_world_size(kind: str, value: Any, device: str) -> int:
    """auto → 1 for single; torchrun's WORLD_SIZE when launched by it; GPU count; 2 on CPU."""
    if kind == "single":
        return 1
    env = os.environ.get("WORLD_SIZE")
    if env is not None:
        launched = int(env)
        if value != "auto" and value != launched:
            raise ConfigError(
                "topology.world_size",
                f"{value} but the launcher started {launched} ranks (WORLD_SIZE); "
                "use auto or the launcher's count",
            )
        return launched
    if device == "cuda":
        import torch

        count = torch.cuda.device_count()
        if value == "auto":
            log.info("topology.world_size=auto: %d GPUs", count)
            return count
        overlap = os.environ.get("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES") == "1"
        if value > count and not overlap:  # overlap: a protocol test of several ranks per GPU
            raise ConfigError(
                "topology.world_size",
                f"{value} ranks but this machine has {count} GPUs; use at most {count} "
                "(or torchrun for several nodes; TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 "
                "shares GPUs between ranks to test the copy-engine protocol)",
            )
        return value
    if value == "auto":
        log.info("topology.world_size=auto: 2 ranks on cpu")
        return 2
    return value


def from_config(cfg: Any) -> Settings:
    """Check the config, resolve `auto` values on this machine, return the run's Settings.

    Args:
        cfg: the composed config (DictConfig) or an equivalent nested dict.

    Raises:
        ConfigError: a bad value (see check_config) or one this machine cannot run.
    """
    data = check_config(cfg)
    device = _resolve_device(data["device"]["name"])
    dtype = data.get("dtype", "auto")
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    kernel_options = dict(data.get("kernel_options") or {})
    _check_flash(kernel_options, dtype)
    topo = data["topology"]
    world_size = _resolve_world_size(topo["kind"], topo.get("world_size", 1), device)
    if world_size < 1:
        raise ConfigError("topology.world_size", f"resolved to {world_size}; need at least 1")
    layout = topo.get("layout", "contiguous")
    _seq_divides(data["shape"]["seq_len"], world_size, layout)
    blocks = []
    if TUNED in (data["block_size"]["q"], data["block_size"]["kv"]):
        from attngym import tuning
        from attngym.device import device_info

        blocks, kernel_options = tuning.resolve(
            str(data["attention"].get("name")),
            data["shape"]["head_dim"],
            device_info(device)["capability"],
            kernel_options,
        )
        _check_flash(kernel_options, dtype)
    for side in ("q", "kv") if not blocks else ():
        value = data["block_size"][side]
        if isinstance(value, str):
            value = BLOCK_SIZE_RESOLVERS[value](device)[0 if side == "q" else 1]
            log.info("block_size.%s=%s: %d on %s", side, data["block_size"][side], value, device)
        blocks.append(int(value))
    _check_flash_device(kernel_options, device, (blocks[0], blocks[1]))
    shape = data["shape"]
    bench = data.get("benchmark", {})
    return Settings(
        attention=data["attention"],
        shape=Shape(
            batch=shape["batch"],
            heads=shape["heads"],
            kv_heads=shape.get("kv_heads"),
            seq_len=shape["seq_len"],
            head_dim=shape["head_dim"],
        ),
        topology=Topology(
            kind=topo["kind"],
            world_size=world_size,
            transport=topo.get("transport", "auto"),
            layout=layout,
            timeout_s=float(topo.get("timeout_s", 120.0)),
        ),
        benchmark=Benchmark(warmup=bench.get("warmup", 2), repeats=bench.get("repeats", 5)),
        device=device,
        dtype=dtype,
        block_size=(blocks[0], blocks[1]),
        kernel_options=kernel_options,
        compile=data.get("compile", True),
        compile_mode=data.get("compile_mode", "default"),
        passes=tuple(data.get("passes", ("fwd", "bwd"))),
        baselines=tuple(data.get("baselines") or ()),
        validate=data.get("validate", True),
        validate_rows=data.get("validate_rows", 256),
        seed=data.get("seed", 0),
        profiler=data["profiler"]["name"],
        baseline_max_mask_bytes=data.get("baseline_max_mask_bytes", 256 * 2**20),
        logger=dict(data.get("logger") or {"name": "none"}),
    )
