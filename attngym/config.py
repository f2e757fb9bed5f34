"""Typed run settings: the composed config, a plain mapping, checked into `Settings`.

`Settings` is what tasks receive, and its dataclasses are the one source of defaults: a key the
config leaves out takes the field's default, and the YAML files state only what a user edits.
Every field is plain Python (no OmegaConf: the CLI hands over a plain dict), so tasks and the
library can be driven from a notebook too. `Settings` carries the built Variant, built once from
the `attention` entry.

Checking happens in two steps, so that configs stay pure:

- `check_config(data)` looks at values only (types, ranges, choices, the variant and its
  parameters, seq_len against world_size and the variant): it never probes hardware, so it gives
  the same answer on a laptop and on a GPU node, and tests can run it anywhere.
- `from_config(data)` runs the same checks, then resolves the `auto` values against this machine
  (device, dtype, world_size, a `flash` or `tuned` block size) and checks what depends on it
  (device=cuda without CUDA, more ranks than GPUs, FLASH's block size). It still runs before any
  tensor is allocated.

Each rule is checked in one function (`_check_*`), whichever step calls it. Every bad value raises
`attngym.errors.ConfigError(key, message)` with the dotted key, the value received and what is
allowed, so the CLI can print one line.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, get_args

from attngym.errors import ConfigError, choice_error, closest

if TYPE_CHECKING:
    from attngym.distributed.ulysses import Across
    from attngym.variants.base import Variant

log = logging.getLogger(__name__)

# Choices, each stated once as a type; the tuples the checks use come from them.
Dtype = Literal["float32", "bfloat16", "float16", "float64"]  # a resolved dtype
Device = Literal["cpu", "cuda"]  # a resolved device
Pass = Literal["fwd", "bwd"]
# sdpa: SDPA's own dispatch; sdpa_<backend>: that backend forced; sdpa_dense_mask: the variant as a
# dense mask/bias; flex_default: compiled flex at (128, 128) with no kernel options (the contender
# a tuned block size or kernel options are measured against). These run in single-device runs.
SingleBaseline = Literal[
    "sdpa", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "sdpa_dense_mask", "flex_default"
]
# torch_cp: PyTorch's own flex context parallelism; it runs in context-parallel runs. Each task
# runs the baselines of its own kind, so one default list serves both.
CPBaseline = Literal["torch_cp"]
Baseline = Literal[SingleBaseline, CPBaseline]
AUTO = "auto"  # resolved on the machine that runs: device, dtype, world_size

DTYPES = (AUTO, *get_args(Dtype))
DEVICES = (AUTO, *get_args(Device))
PASSES = get_args(Pass)
SINGLE_BASELINES = get_args(SingleBaseline)
CP_BASELINES = get_args(CPBaseline)
BASELINES = (*SINGLE_BASELINES, *CP_BASELINES)


@dataclasses.dataclass(kw_only=True)
class Shape:
    """Problem size. Tensors are (batch, heads, seq_len, head_dim); K/V have kv_heads heads."""

    batch: int = 1
    """B."""
    heads: int = 4
    """H, query heads."""
    kv_heads: int | None = None
    """G, key/value heads (GQA); None means heads, resolved here once."""
    seq_len: int = 1024
    """S, the whole sequence (all ranks together)."""
    head_dim: int = 64
    """D."""

    def __post_init__(self) -> None:
        if self.kv_heads is None:
            self.kv_heads = self.heads


@dataclasses.dataclass(kw_only=True)
class Topology:
    """How the sequence is spread over ranks."""

    kind: str = "single"
    """A registered task: single | ring | allgather | ulysses | hybrid."""
    world_size: int = 1
    """Ranks; `auto` in a config is resolved before Settings exist."""
    transport: str = AUTO
    """auto | copy_engine | nccl | gloo (attngym.distributed.transport.TRANSPORTS); resolved on
    the ranks."""
    layout: str = "contiguous"
    """contiguous | zigzag (attngym.distributed.layout.LAYOUTS)."""
    a2a_size: int | None = None
    """hybrid: ranks per all-to-all group, consecutive ranks dividing world_size and shape.heads;
    None takes one NVLink domain per group, found on the ranks (attngym.distributed.hybrid_groups).
    """
    across: Across = "ring"
    """hybrid: ring | allgather (attngym.distributed.ulysses.ACROSS), the algorithm among the
    groups (the ranks holding the same head slice)."""
    timeout_s: float = 120.0
    """A rank that waits longer than this fails the run."""


@dataclasses.dataclass(kw_only=True)
class Benchmark:
    warmup: int = 2
    """Untimed calls before timing (the first call, compilation, is timed apart)."""
    repeats: int = 10
    """Timed calls; median, min and max are reported."""


@dataclasses.dataclass(kw_only=True)
class Settings:
    """Everything a task needs to run one configuration."""

    attention: dict[str, Any] = dataclasses.field(default_factory=lambda: {"name": "causal"})
    """The config entry: {"name": ..., **params} or {"name": ..., "compose": [...]}."""
    variant: Variant | None = None
    """The Variant `attention` describes; built from it when not given."""
    shape: Shape = dataclasses.field(default_factory=Shape)
    topology: Topology = dataclasses.field(default_factory=Topology)
    benchmark: Benchmark = dataclasses.field(default_factory=Benchmark)
    device: Device = "cpu"
    dtype: Dtype = "float32"
    block_size: tuple[int, int] = (128, 128)
    """(q, kv) block-mask block size."""
    kernel_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Passed to flex_attention unchanged."""
    compile: bool = True
    """torch.compile flex_attention on CUDA (always eager on CPU)."""
    compile_mode: str = "default"
    """A torch.compile mode (attngym.kernels.COMPILE_MODES)."""
    passes: tuple[Pass, ...] = ("fwd", "bwd")
    """What to time; bwd also times fwd+bwd."""
    baselines: tuple[Baseline, ...] = (
        "sdpa",
        "sdpa_cudnn",
        "sdpa_flash",
        "sdpa_efficient",
        "sdpa_dense_mask",
        "torch_cp",
    )
    """Contenders timed on the same inputs; each is skipped, with the reason, where it does not
    apply. A single-device run runs SINGLE_BASELINES, a context-parallel run CP_BASELINES."""
    validate: bool = True
    """Compare against the float64 dense reference."""
    validate_rows: int = 256
    """At most this many query rows are checked when S is large."""
    seed: int = 0
    """Seeds the inputs and the sampled validation rows."""
    profiler: str = "none"
    """A registered profiler: none | kernels | trace."""
    baseline_max_mask_bytes: int = 256 * 2**20
    """Dense SDPA masks larger than this are skipped, not attempted."""
    skipped_baselines: dict[str, str] = dataclasses.field(default_factory=dict)
    """Baselines that alone would not fit in the device's memory, with why (attngym.estimate):
    recorded as skipped, not attempted."""
    logger: dict[str, Any] = dataclasses.field(default_factory=lambda: {"name": "none"})
    """A registered tracker's name and its parameters."""

    def __post_init__(self) -> None:
        if self.variant is None:
            from attngym.variants.spec import build_variant

            self.variant = build_variant(
                self.attention, seq_len=self.shape.seq_len, heads=self.shape.heads
            )

    # A Variant's callbacks are closures, which do not pickle: a spawned rank gets the settings
    # without it and builds it from `attention` once, in its own process.
    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "variant": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__post_init__()

    def describe(self) -> dict[str, Any]:
        """The metrics that describe the configuration (variant, shape, topology, dtype, blocks,
        kernel options as `kernel_options.<NAME>`, and the device: device_name (the GPU's name, or
        the CPU model), capability, torch)."""
        from attngym.device import device_info

        s = self.shape
        info = device_info(self.device)
        options = {f"kernel_options.{k}": v for k, v in sorted(self.kernel_options.items())}
        return {
            "variant": self.variant.name,
            "topology": self.topology.kind,
            "world_size": self.topology.world_size,
            "transport": self.topology.transport,
            "layout": self.topology.layout if self.topology.kind != "single" else None,
            "device": self.device,
            "dtype": self.dtype,
            "batch": s.batch,
            "heads": s.heads,
            "kv_heads": s.kv_heads,
            "seq_len": s.seq_len,
            "head_dim": s.head_dim,
            "block_q": self.block_size[0],
            "block_kv": self.block_size[1],
            **options,
            "device_name": info["name"],
            "capability": info["capability"],
            "torch": info["torch"],
        }


def _default(cls: type, name: str) -> Any:
    """The default of field `name` of dataclass `cls`: a key the config leaves out takes it."""
    field = cls.__dataclass_fields__[name]  # type: ignore[attr-defined]
    return field.default_factory() if field.default is dataclasses.MISSING else field.default


# ---------------------------------------------------------------------------------------------
# Components that register themselves (tasks, profilers, trackers) are read from attngym.registry,
# so a new one is accepted as soon as it registers. Choices the library owns (transports,
# layouts, W&B modes, compile modes) are imported from it inside the checks, so each tuple is
# defined once and `import attngym.config` stays light.


def _flash_block_size(device: str) -> tuple[int, int]:
    from attngym.device import get_flash_block_size

    return tuple(get_flash_block_size(device))  # type: ignore[return-value]


# Named block sizes, resolved against the device when the run starts (e.g. `block_size=flash`).
# Each maps the resolved device name to (q, kv).
BLOCK_SIZE_RESOLVERS: dict[str, Callable[[str], tuple[int, int]]] = {"flash": _flash_block_size}
# `block_size=tuned`: block size and kernel options from attngym/tuned.json (see attngym.tuning).
TUNED = "tuned"


def plain(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """A nested dict/list copy of a mapping, the `hydra` node left out, so the checks can fill
    in defaults without touching the caller's mapping."""

    def copy(node: Any) -> Any:
        if isinstance(node, Mapping):
            return {str(k): copy(v) for k, v in node.items()}
        if isinstance(node, Sequence) and not isinstance(node, str):
            return [copy(v) for v in node]
        return node

    return {str(k): copy(v) for k, v in cfg.items() if k != "hydra"}


_REQUIRED = object()


def _get(data: dict[str, Any], key: str, default: Any = _REQUIRED) -> Any:
    """The value at dotted `key`; a missing one takes `default`, written into `data`."""
    node = data
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None and default is not _REQUIRED:
            child = node[part] = {}
        if not isinstance(child, dict):
            if child is None:
                raise ConfigError(key, "missing; it has no default")
            raise ConfigError(".".join(parts[: i + 1]), f"must be a mapping, got {child!r}")
        node = child
    if parts[-1] not in node:
        if default is _REQUIRED:
            raise ConfigError(key, "missing; it has no default")
        node[parts[-1]] = default
    return node[parts[-1]]


def _int(data: dict[str, Any], key: str, *, low: int = 1, default: Any = _REQUIRED) -> int:
    value = _get(data, key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        need = "a positive integer" if low == 1 else f"an integer >= {low}"
        raise ConfigError(key, f"must be {need}, got {value!r}")
    return value


def _bool(data: dict[str, Any], key: str, default: Any = _REQUIRED) -> bool:
    value = _get(data, key, default)
    if not isinstance(value, bool):
        raise ConfigError(key, f"must be true or false, got {value!r}")
    return value


def _choice(
    data: dict[str, Any], key: str, choices: Any, what: str, default: Any = _REQUIRED
) -> str:
    value = _get(data, key, default)
    choices = list(choices)
    if value not in choices:
        raise ConfigError(key, choice_error(what, value, choices))
    return value


def _choices(
    data: dict[str, Any], key: str, choices: Sequence[str], what: str, default: Sequence[str]
) -> list[str]:
    """A list (of a top-level key) whose every item is one of `choices`; null is empty."""
    values = _get(data, key, list(default))
    if values is None:
        values = data[key] = []
    if not isinstance(values, list):
        raise ConfigError(key, f"must be a list of {list(choices)}, got {values!r}")
    for value in values:
        if value not in choices:
            raise ConfigError(key, choice_error(what, value, choices))
    return values


def _names(kind: str) -> list[str]:
    from attngym import registry

    return registry.names(kind)


def _flash(kernel_options: Mapping[str, Any] | None) -> bool:
    """attngym.kernels.is_flash, imported when first needed: `import attngym.config` pulls no
    torch."""
    from attngym.kernels import is_flash

    return is_flash(kernel_options)


# ---------------------------------------------------------------------------------------------
# One function per rule.


def _check_block(data: dict[str, Any], key: str, default: int) -> int | str:
    """A block size: a positive multiple of 16, or a name resolved when the run starts."""
    value = _get(data, key, default)
    named = sorted([*BLOCK_SIZE_RESOLVERS, TUNED])
    bad_int = isinstance(value, bool) or not isinstance(value, int) or value < 16 or value % 16
    if (value not in named) if isinstance(value, str) else bad_int:
        raise ConfigError(
            key, f"must be a positive multiple of 16 or one of {named}, got {value!r}"
        )
    return value


def _check_kv_heads(heads: int, kv_heads: int | None) -> None:
    """GQA: every key/value head serves the same number of query heads."""
    if kv_heads is not None and heads % kv_heads:
        raise ConfigError(
            "shape.kv_heads",
            f"{kv_heads} does not divide shape.heads={heads}; use a divisor of {heads}",
        )


def _check_seq_len(seq_len: int, world_size: int, layout: str) -> None:
    """The sequence splits evenly into the layout's pieces (attngym.distributed.layout).

    This is also all hybrid attention needs: with W ranks in groups of a, each group's shards
    make its shard in the same layout for W/a ranks (attngym.distributed.hybrid_attention).
    """
    from attngym.distributed.layout import check_seq_len

    try:
        check_seq_len(seq_len, world_size, layout)
    except ValueError as err:
        raise ConfigError("shape.seq_len", str(err)) from None


def _check_a2a_size(kind: str, a2a_size: int | None, world_size: int | str, heads: int) -> None:
    """hybrid: the all-to-all groups split the ranks and the query heads evenly (K/V heads are
    repeated as Ulysses does). None is judged on the ranks, where the NVLink domains are known."""
    if kind != "hybrid" or a2a_size is None:
        return
    if world_size != AUTO and world_size % a2a_size:
        raise ConfigError(
            "topology.a2a_size",
            f"{a2a_size} does not divide topology.world_size={world_size}; use a divisor of "
            f"{world_size} (or null: one NVLink domain per group)",
        )
    if heads % a2a_size:
        raise ConfigError(
            "topology.a2a_size",
            f"{a2a_size} does not divide shape.heads={heads}; each group splits the heads over "
            "its ranks, use a common divisor of the heads and the world size",
        )


def _check_world_size(kind: str, world_size: int | str) -> None:
    """One rank for a single-device run."""
    if kind == "single" and world_size not in (1, AUTO):
        raise ConfigError(
            "topology.world_size", f"must be 1 (or auto) for topology single, got {world_size}"
        )


def _check_flash(kernel_options: Mapping[str, Any], dtype: str) -> None:
    """BACKEND=FLASH needs a 16-bit dtype (judged on values only; `auto` is judged later)."""
    if _flash(kernel_options) and dtype in ("float32", "float64"):
        raise ConfigError(
            "kernel_options.BACKEND",
            f"FLASH needs a 16-bit dtype (bfloat16 or float16), but dtype={dtype}",
        )


def _check_flash_compile(kernel_options: Mapping[str, Any], compile_: bool) -> None:
    """BACKEND=FLASH is an Inductor kernel: it exists only compiled."""
    if _flash(kernel_options) and not compile_:
        raise ConfigError(
            "compile",
            "BACKEND=FLASH is a torch.compile (Inductor) kernel; compile=false would run flex's "
            "eager path without it; use compile=true or drop kernel_options.BACKEND",
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


# How the composed config's keys map to Settings' fields. Sections are dataclasses (their fields
# are the keys); a few fields are written as a mapping in YAML (a group's option file); open
# mappings take any key and are checked by their own rule (the variant's parameters by
# attngym.variants.spec, flex's kernel options by flex, a tracker's by its factory's signature).
_SECTIONS = {"shape": Shape, "topology": Topology, "benchmark": Benchmark}
_AS_MAPPING = {"device": ("name",), "block_size": ("q", "kv"), "profiler": ("name",)}
OPEN_MAPPINGS = ("attention", "kernel_options", "logger")
_NOT_CONFIG = ("variant", "skipped_baselines")  # built or estimated, never written


def known_keys() -> list[str]:
    """Every dotted key a config may set (an open mapping as its own name)."""
    keys = []
    for field in dataclasses.fields(Settings):
        name = field.name
        if name in _SECTIONS:
            keys += [f"{name}.{f.name}" for f in dataclasses.fields(_SECTIONS[name])]
        elif name in _AS_MAPPING:
            keys += [f"{name}.{sub}" for sub in _AS_MAPPING[name]]
        elif name not in _NOT_CONFIG:
            keys.append(name)
    return keys


def check_key(key: str) -> None:
    """`key` (dotted) maps to a Settings field, or lies in an open mapping; else a ConfigError
    with the key it most likely means (`seq_len` → `shape.seq_len`, `shape.seqlen` →
    `shape.seq_len`)."""
    if key.split(".")[0] in OPEN_MAPPINGS:
        return
    known = known_keys()
    if key in known or any(k.startswith(f"{key}.") for k in known):
        return
    leaves = {k.rsplit(".", 1)[-1]: k for k in known}
    leaf = key.rsplit(".", 1)[-1]
    hint = leaves.get(leaf) or closest(key, known) or leaves.get(closest(leaf, leaves) or "")
    suffix = f"; did you mean {hint}?" if hint else ""
    raise ConfigError(key, f"unknown key{suffix} (attngym --cfg job lists the keys)")


def _check_keys(data: Mapping[str, Any], prefix: str = "") -> None:
    """Every key of the composed config maps to a Settings field (the one check of the rule)."""
    for name, value in data.items():
        key = f"{prefix}{name}"
        check_key(key)
        if isinstance(value, Mapping) and key.split(".")[0] not in OPEN_MAPPINGS:
            _check_keys(value, f"{key}.")


def _check_transport(kind: str, transport: str, device: str) -> None:
    """The transport can move this device's tensors (copy_engine and nccl need CUDA), judged
    before the ranks start; which NVLink domain the ranks share is judged on the ranks."""
    if kind == "single":
        return
    from attngym.distributed.transport import check_transport

    check_transport(transport, device, key="topology.transport")


def _check_fits(
    data: dict[str, Any], device: str, dtype: str, world_size: int, block_size: tuple[int, int]
) -> dict[str, str]:
    """The run fits the device's memory (and, on a CPU, its cores: one process per rank), judged
    from the shape by attngym.estimate before any tensor exists; the baselines that alone would
    not fit, with why (they are skipped, the run goes on)."""
    from attngym.estimate import available_memory, estimate, format_bytes

    shape = data["shape"]
    have = None  # measured by estimate: free memory
    if "LOCAL_RANK" in os.environ:  # under torchrun: this rank's own GPU, judged as every rank is
        if device == "cuda":
            device = f"cuda:{os.environ['LOCAL_RANK']}"
        have = available_memory(device, total=True)
    result = estimate(
        batch=shape["batch"],
        heads=shape["heads"],
        kv_heads=shape.get("kv_heads"),
        seq_len=shape["seq_len"],
        head_dim=shape["head_dim"],
        dtype=dtype,
        device=device,
        passes=data["passes"],
        baselines=data["baselines"],
        validate_rows=data["validate_rows"] if data["validate"] else 0,
        world_size=world_size,
        block_size=block_size,
        max_mask_bytes=data["baseline_max_mask_bytes"],
        available_bytes=have,
    )
    if not result.fits:
        raise ConfigError(result.key, result.problem.removeprefix(f"{result.key}: "))
    log.info(
        "memory estimate: ~%s of %s %s",
        format_bytes(result.needed_bytes),
        "?" if result.available_bytes is None else format_bytes(result.available_bytes),
        "available" if have is None else "in all (under torchrun every rank judges by the total)",
    )
    return dict(result.skipped_baselines)


def _check_values(data: dict[str, Any]) -> Variant:
    """Every check that needs no hardware, on `data` (defaults written in); the built Variant."""
    _check_keys(data)
    seq_len = _check_shape(data)
    dtype = _choice(data, "dtype", DTYPES, "dtype", AUTO)
    passes = _check_run(data, dtype)
    _check_topology(data, seq_len, passes)
    _choice(data, "profiler.name", _names("profiler"), "profiler", _default(Settings, "profiler"))
    default_logger = _default(Settings, "logger")["name"]
    logger = _choice(data, "logger.name", _names("tracker"), "logger", default_logger)
    if logger == "wandb":
        from attngym.tracking.wandb_logger import MODES

        _choice(data, "logger.mode", MODES, "wandb mode", "offline")

    from attngym.variants.spec import build_variant

    heads = _int(data, "shape.heads", default=_default(Shape, "heads"))
    return build_variant(_get(data, "attention"), key="attention", seq_len=seq_len, heads=heads)


def _check_shape(data: dict[str, Any]) -> int:
    """shape.*: positive sizes, kv_heads dividing heads; the sequence length."""
    shape = {
        name: _int(data, f"shape.{name}", default=_default(Shape, name))
        for name in ("batch", "heads", "seq_len", "head_dim")
    }
    if _get(data, "shape.kv_heads", _default(Shape, "kv_heads")) is not None:
        _check_kv_heads(shape["heads"], _int(data, "shape.kv_heads"))
    return shape["seq_len"]


def _check_run(data: dict[str, Any], dtype: str) -> list[str]:
    """What the run does and how it is timed: passes, compile, kernel options, benchmark,
    baselines, validation, block size. Returns the passes."""
    _int(data, "seed", low=0, default=_default(Settings, "seed"))
    _bool(data, "validate", _default(Settings, "validate"))
    _int(data, "validate_rows", default=_default(Settings, "validate_rows"))
    passes = _choices(data, "passes", PASSES, "pass", _default(Settings, "passes"))
    if not passes:
        raise ConfigError("passes", f"must be a non-empty list of {list(PASSES)}, got {passes!r}")
    compile_ = _bool(data, "compile", _default(Settings, "compile"))
    from attngym.kernels import COMPILE_MODES

    _choice(data, "compile_mode", COMPILE_MODES, "compile mode", _default(Settings, "compile_mode"))
    kernel_options = _get(data, "kernel_options", None)
    if kernel_options is None:
        kernel_options = data["kernel_options"] = _default(Settings, "kernel_options")
    if not isinstance(kernel_options, Mapping):
        raise ConfigError("kernel_options", f"must be a mapping, got {kernel_options!r}")
    _check_flash(kernel_options, dtype)
    _check_flash_compile(kernel_options, compile_)
    _int(data, "benchmark.warmup", low=0, default=_default(Benchmark, "warmup"))
    _int(data, "benchmark.repeats", default=_default(Benchmark, "repeats"))
    _choices(data, "baselines", BASELINES, "baseline", _default(Settings, "baselines"))
    max_bytes = _default(Settings, "baseline_max_mask_bytes")
    _int(data, "baseline_max_mask_bytes", low=0, default=max_bytes)
    default_q, default_kv = _default(Settings, "block_size")
    _check_block(data, "block_size.q", default_q)
    _check_block(data, "block_size.kv", default_kv)
    _choice(data, "device.name", DEVICES, "device", AUTO)
    return passes


def _check_topology(data: dict[str, Any], seq_len: int, passes: list[str]) -> None:
    """topology.*: a registered kind, its ranks, transport, layout, hybrid groups and timeout,
    and seq_len and a2a_size against the ranks when they are known."""
    kind = _choice(
        data, "topology.kind", _names("task"), "topology kind", _default(Topology, "kind")
    )
    _check_flash_topology(data["kernel_options"], kind, passes)
    world_size = _get(data, "topology.world_size", _default(Topology, "world_size"))
    if world_size != AUTO:
        world_size = _int(data, "topology.world_size")
    _check_world_size(kind, world_size)
    from attngym.distributed.layout import LAYOUTS
    from attngym.distributed.transport import TRANSPORTS

    _choice(data, "topology.transport", TRANSPORTS, "transport", _default(Topology, "transport"))
    layout = _choice(data, "topology.layout", LAYOUTS, "layout", _default(Topology, "layout"))
    from attngym.distributed.ulysses import ACROSS

    _choice(data, "topology.across", ACROSS, "across", _default(Topology, "across"))
    if _get(data, "topology.a2a_size", _default(Topology, "a2a_size")) is not None:
        a2a_size = _int(data, "topology.a2a_size")
        _check_a2a_size(kind, a2a_size, world_size, data["shape"]["heads"])
    timeout = _get(data, "topology.timeout_s", _default(Topology, "timeout_s"))
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not 0 < timeout < math.inf
    ):
        raise ConfigError(
            "topology.timeout_s", f"must be a positive, finite number of seconds, got {timeout!r}"
        )
    data["topology"]["timeout_s"] = float(timeout)
    if world_size != AUTO:
        _check_seq_len(seq_len, world_size, layout)


def check_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Check every value that can be judged without hardware; return the plain dict, defaults
    filled in.

    Args:
        cfg: the composed config as a nested mapping (attngym.cli.to_plain of Hydra's config).

    Raises:
        ConfigError: the first bad value, named by its dotted key.
    """
    data = plain(cfg)
    _check_values(data)
    return data


def _resolve_device(name: str) -> str:
    """`device.name` resolved by attngym.device.resolve_device (the one resolver): cpu | cuda."""
    from attngym.device import resolve_device

    try:
        return resolve_device(name).type
    except ValueError as err:
        raise ConfigError("device.name", str(err)) from None


def _resolve_world_size(kind: str, value: Any, device: str) -> int:
    """auto → 1 for single; torchrun's WORLD_SIZE when launched by it; GPU count; 2 on CPU.

    Without a launcher, more ranks than GPUs fail here (the one check of the rule) unless
    TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 lets ranks share GPUs.
    """
    if kind == "single":
        return 1
    env = os.environ.get("WORLD_SIZE")
    if env is not None:
        launched = int(env)
        if value != AUTO and value != launched:
            raise ConfigError(
                "topology.world_size",
                f"{value} but the launcher started {launched} ranks (WORLD_SIZE); "
                "use auto or the launcher's count",
            )
        return launched
    if device == "cuda":
        import torch

        count = torch.cuda.device_count()
        if value == AUTO:
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
    if value == AUTO:
        log.info("topology.world_size=auto: 2 ranks on cpu")
        return 2
    return value


def _resolve_blocks(
    data: dict[str, Any], device: str, dtype: str, kernel_options: dict[str, Any]
) -> tuple[tuple[int, int], dict[str, Any]]:
    """The block size on this device (a `flash` or `tuned` name resolved) and the kernel
    options (`tuned` adds the table's, yours win)."""
    names = (data["block_size"]["q"], data["block_size"]["kv"])
    if TUNED in names:
        from attngym import tuning
        from attngym.device import device_info

        blocks, kernel_options = tuning.resolve(
            str(data["attention"].get("name")),
            data["shape"]["head_dim"],
            device_info(device)["capability"],
            kernel_options,
            dtype=dtype,
            topology=data["topology"]["kind"],
        )
        return (blocks[0], blocks[1]), kernel_options
    blocks = []
    for side, value in zip(("q", "kv"), names, strict=True):
        if isinstance(value, str):
            value = BLOCK_SIZE_RESOLVERS[value](device)[0 if side == "q" else 1]
            log.info("block_size.%s=%s: %d on %s", side, data["block_size"][side], value, device)
        blocks.append(int(value))
    return (blocks[0], blocks[1]), kernel_options


def _fields(cls: type, values: Mapping[str, Any]) -> Any:
    """`cls` from the checked values of its fields (other keys are not its business)."""
    return cls(**{f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values})


def from_config(cfg: Mapping[str, Any]) -> Settings:
    """Check the config, resolve `auto` values on this machine, return the run's Settings.

    Args:
        cfg: the composed config as a nested mapping (attngym.cli.to_plain of Hydra's config).

    Raises:
        ConfigError: a bad value (see check_config) or one this machine cannot run.
    """
    data = plain(cfg)
    variant = _check_values(data)
    device = _resolve_device(data["device"]["name"])
    dtype = data["dtype"]
    if dtype == AUTO:
        dtype = "bfloat16" if device == "cuda" else "float32"
    _check_flash(data["kernel_options"], dtype)
    topo = data["topology"]
    world_size = _resolve_world_size(topo["kind"], topo["world_size"], device)
    if world_size < 1:
        raise ConfigError("topology.world_size", f"resolved to {world_size}; need at least 1")
    if topo["world_size"] == AUTO:
        _check_seq_len(data["shape"]["seq_len"], world_size, topo["layout"])
        _check_a2a_size(topo["kind"], topo["a2a_size"], world_size, data["shape"]["heads"])
    _check_transport(topo["kind"], topo["transport"], device)
    block_size, kernel_options = _resolve_blocks(data, device, dtype, dict(data["kernel_options"]))
    _check_flash(kernel_options, dtype)
    _check_flash_device(kernel_options, device, block_size)
    skipped = _check_fits(data, device, dtype, world_size, block_size)
    return Settings(
        attention=data["attention"],
        variant=variant,
        shape=_fields(Shape, data["shape"]),
        topology=_fields(Topology, {**topo, "world_size": world_size}),
        benchmark=_fields(Benchmark, data["benchmark"]),
        device=device,
        dtype=dtype,
        block_size=block_size,
        kernel_options=kernel_options,
        compile=data["compile"],
        compile_mode=data["compile_mode"],
        passes=tuple(data["passes"]),
        baselines=tuple(data["baselines"]),
        validate=data["validate"],
        validate_rows=data["validate_rows"],
        seed=data["seed"],
        profiler=data["profiler"]["name"],
        baseline_max_mask_bytes=data["baseline_max_mask_bytes"],
        skipped_baselines=skipped,
        logger=dict(data["logger"]),
    )
