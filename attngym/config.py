"""Typed run settings: the composed config, a plain mapping, checked into `Settings`.

Each setting is stated once, as a typed dataclass field below: its default, its allowed values
(a `Literal` type; `setting(choices=...)` where another module owns the list, as the registry
owns the task, transport, profiler and tracker names) and any check its type does not say
(`setting(check=..., low=...)`). One walker (`_check_section`) checks a section from its fields
and names the dotted key in every message; the rules between fields are named functions, listed
once in `VALUE_RULES` and `RESOLVED_RULES`; `Settings` is read back from the checked data field by
field (`_build`). The YAML files state only what a user edits, and tests/test_config.py holds
their values to the typed defaults. Fields are plain Python (no OmegaConf: the CLI hands over a
plain dict), so tasks and the library can be driven from a notebook too.

`auto` is a value of its own where it is one (device, dtype, topology.world_size), and a
`Settings` object holds it resolved: `from_config` resolves it together with the config's checks,
and Settings made directly resolve what they leave `auto` the same way when made.

What a context-parallel topology takes (its layouts, its own options under topology.options,
typed by its spec's dataclass and checked by the walker, its rules) is asked of its spec,
attngym.distributed's table read through attngym.registry ("topology"; `custom` bound to
topology.scheme first); no kind is matched by name here. A task kind without a spec runs on one
device.

Checking happens in two steps, so that configs stay pure:

- `check_config(data)` looks at values only (types, ranges, choices, the variant and its
  parameters, the tracker's parameters, the topology's rules): it never probes hardware, so it
  gives the same answer on a laptop and on a GPU node, and tests can run it anywhere.
- `from_config(data)` runs the same checks, then resolves the `auto` values against this machine
  (device, dtype, world_size, a `flash` or `tuned` block size) and checks what depends on them
  (device=cuda without CUDA, more ranks than GPUs, FLASH's block size, the memory the run needs).
  It still runs before any tensor is allocated. The transport is judged against the device by
  the context-parallel task, before it launches its ranks.

Every bad value raises `attngym.errors.ConfigError(key, message)` with the dotted key, the value
received and what is allowed, so the CLI can print one line.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import types
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Union, get_args, get_origin, get_type_hints

from attngym.errors import ConfigError, choice_error, closest

if TYPE_CHECKING:
    from attngym.variants.base import Variant

log = logging.getLogger(__name__)

# Choices, each stated once as a type; the tuples the checks use come from them.
Auto = Literal["auto"]  # resolved on the machine that runs: device, dtype, world_size
AUTO: Auto = "auto"
Dtype = Literal["float32", "bfloat16", "float16", "float64"]  # a resolved dtype
Device = Literal["cpu", "cuda"]  # a resolved device
Pass = Literal["fwd", "bwd"]
# sdpa: SDPA's own dispatch; sdpa_<backend>: that backend forced; sdpa_dense_mask: the variant as a
# dense mask/bias; varlen, flash_varlen: FlashAttention's varlen kernels (PyTorch's varlen_attn,
# flash-attn's flash_attn_varlen_func) for documents and windows (attngym.varlen); flex_default:
# compiled flex at (128, 128) with no kernel options (the contender a tuned block size or kernel
# options are measured against). These run in single-device runs.
SingleBaseline = Literal[
    "sdpa", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "sdpa_dense_mask", "varlen",
    "flash_varlen", "flex_default",
]  # fmt: skip
# torch_cp: PyTorch's own flex context parallelism; it runs in context-parallel runs. Each task
# runs the baselines of its own kind, so one default list serves both.
CPBaseline = Literal["torch_cp"]
Baseline = Literal[SingleBaseline, CPBaseline]
# topology.fabric: the links a simulated run's transfers are priced on
# (attngym.distributed.transfer_model.FABRIC_NAMES, held equal by tests/test_config.py).
Fabric = Literal["h200_nvlink", "hgx_h200", "nvl72", "nvlink5", "infiniband", "custom"]
# topology.simulate: the most ranks one simulation takes.
MAX_SIMULATED_RANKS = 512

DTYPES = (AUTO, *get_args(Dtype))
DEVICES = (AUTO, *get_args(Device))
PASSES = get_args(Pass)
SINGLE_BASELINES = get_args(SingleBaseline)
CP_BASELINES = get_args(CPBaseline)
BASELINES = (*SINGLE_BASELINES, *CP_BASELINES)

# `block_size=tuned`: block size and kernel options from attngym/tuned.json (see attngym.tuning).
TUNED = "tuned"
DEFAULT_TRACKER = "wandb"  # conf/config.yaml's logger; its parameters' defaults are its factory's


# ---------------------------------------------------------------------------------------------
# How a field says what its type does not.


@dataclasses.dataclass(frozen=True)
class _Rule:
    """A field's check beyond its type, read by the walker (`_check_value`)."""

    check: Callable[[str, Any], Any] | None = None
    """(dotted key, value) -> the checked value; replaces the check the type implies."""
    choices: Callable[[], Sequence[str]] | None = None
    """A str field's choices, asked when checked (another module owns them)."""
    what: str | None = None
    """How a bad choice is named: `unknown <what> 'x'`; default: the field's name."""
    low: int = 1
    """An int's least value."""
    non_empty: bool = False
    """A list needs at least one item."""
    keys: tuple[str, ...] = ()
    """Written in a config as a mapping of these keys (a config group's option file): one key
    holds the value, several the items of a tuple."""
    written: bool = True
    """False: built or estimated by the run, never written in a config."""


_META = "attngym"
_NO_RULE = _Rule()


def setting(
    default: Any = dataclasses.MISSING, *, factory: Any = dataclasses.MISSING, **rule: Any
) -> Any:
    """A dataclass field and its `_Rule`: `seed: int = setting(0, low=0)`. Without a default or
    a factory the key is required."""
    return dataclasses.field(
        default=default, default_factory=factory, metadata={_META: _Rule(**rule)}
    )


def _rule(field: dataclasses.Field) -> _Rule:
    return field.metadata.get(_META, _NO_RULE)


def _registered(kind: str, *extra: str) -> Callable[[], list[str]]:
    """The names registered for `kind` (and `extra`), asked when checked: a component that
    registers itself is accepted as soon as it exists."""

    def names() -> list[str]:
        from attngym import registry

        return [*extra, *registry.names(kind)]

    return names


def _compile_threads(key: str, value: Any) -> int | None:
    ok = value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)
    if not ok:
        raise ConfigError(key, f"must be a positive integer or null, got {value!r}")
    return value


def _objective(key: str, value: Any) -> tuple[str, ...]:
    """The metrics a tuning job hands the Optuna sweeper: known numeric metric names."""
    from attngym.metrics import metric_of

    names = () if value is None else (value,) if isinstance(value, str) else value
    if not isinstance(names, list | tuple) or not all(isinstance(n, str) for n in names):
        raise ConfigError(key, f"must be a metric name, a list of them or null, got {value!r}")
    for name in names:
        row = metric_of(name)
        if row is None or row.unit in ("", "tokens"):
            raise ConfigError(
                key, f"{name!r} is no numeric metric; e.g. fwd_bwd_ms, fwd_ms, first_call_s"
            )
    return tuple(names)


def _compile_modes() -> Sequence[str]:
    """attngym.kernels' tuple, imported when first needed (`import attngym.config` pulls no
    torch)."""
    from attngym.kernels import COMPILE_MODES

    return COMPILE_MODES


def _seconds(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ConfigError(key, f"must be a positive, finite number of seconds, got {value!r}")
    return float(value)


def _budget(key: str, value: Any) -> float | None:
    """benchmark.budget_ms: null, 0 (no budget) or a finite number of milliseconds."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
        raise ConfigError(key, f"must be a number of milliseconds >= 0 or null, got {value!r}")
    return float(value)


def _number_or_none(key: str, value: Any) -> float | None:
    """null, or a finite number >= 0 (a custom fabric's bandwidth or latency)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
        raise ConfigError(key, f"must be a number >= 0 or null, got {value!r}")
    return float(value)


def _block(key: str, value: Any) -> int | str:
    """A block size: a positive multiple of 16, or a name resolved when the run starts."""
    named = sorted([*BLOCK_SIZE_RESOLVERS, TUNED])
    bad_int = isinstance(value, bool) or not isinstance(value, int) or value < 16 or value % 16
    if (value not in named) if isinstance(value, str) else bad_int:
        raise ConfigError(
            key, f"must be a positive multiple of 16 or one of {named}, got {value!r}"
        )
    return value


def _tracker(key: str, value: Any) -> dict[str, Any]:
    """A registered tracker and its parameters, checked by its factory (attngym.registry.build):
    a tracker's constructor checks and keeps its parameters, its work starts in `log_run`. A
    parameter left out takes the factory's default, so the defaults are stated there once."""
    from attngym import registry

    if value is None:
        value = {}
    if not isinstance(value, Mapping):
        raise ConfigError(key, f"must be a mapping, got {value!r}")
    params = dict(value)
    name = params.pop("name", DEFAULT_TRACKER)
    names = registry.names("tracker")
    if name not in names:
        raise ConfigError(f"{key}.name", choice_error("logger", name, names))
    try:
        registry.build("tracker", name, **params)
    except registry.ParamError as err:
        raise ConfigError(f"{key}.{err.param}", err.detail) from None
    return {"name": name, **params}


# ---------------------------------------------------------------------------------------------
# The settings.


@dataclasses.dataclass(kw_only=True)
class Shape:
    """Problem size. Tensors are (batch, heads, seq_len, head_dim); K/V have kv_heads heads."""

    batch: int = 1
    """B."""
    heads: int = 4
    """H, query heads."""
    kv_heads: int | None = None
    """G, key/value heads (GQA), dividing heads; None means heads, resolved here once."""
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

    kind: str = setting("single", choices=_registered("task"), what="topology kind")
    """A registered task: single (one device) or a context-parallel topology (ring, allgather,
    ulysses, hybrid: attngym.distributed's table)."""
    world_size: Auto | int = AUTO
    """Ranks: 1 on one device; auto = torchrun's WORLD_SIZE, else the GPU count (2 on CPU)."""
    transport: str = setting(AUTO, choices=_registered("transport", AUTO))
    """auto or a registered transport (copy_engine, nccl, gloo); resolved on the ranks."""
    layout: str = "contiguous"
    """How the sequence is cut into shards: one of the layouts the topology's spec takes
    (contiguous, zigzag, balanced for ring, allgather and custom; contiguous, zigzag for ulysses
    and hybrid), or your own balancer's import path (module.function) where the spec takes one.
    Unused on one device."""
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The topology's own options (topology.options.<key>), typed and checked by its spec's
    options dataclass (hybrid: a2a_size, across); a topology ignores other topologies' keys,
    so one sweep may set them for all."""
    scheme: str | None = None
    """topology=custom: your scheme's import path (module.function, or a module-level
    TopologySpec), attngym.distributed.custom; ignored by the built-in topologies."""
    scheme_args: dict[str, Any] = dataclasses.field(default_factory=dict)
    """topology=custom: when given, topology.scheme names a factory called with these keyword
    arguments that returns the scheme."""
    timeout_s: float = setting(120.0, check=_seconds)
    """A rank that waits longer than this fails the run."""
    simulate: bool = False
    """Simulated ranks: every rank's compute run one after another on this one device, the call
    over world_size ranks (2 to MAX_SIMULATED_RANKS, whatever the GPUs present) predicted from
    those times and the fabric's transfers (attngym.tasks.cp_simulate)."""
    fabric: Fabric = "h200_nvlink"
    """simulate: the links transfers are priced on. h200_nvlink: measured on two H200s for
    topology.transport (auto: copy_engine), every rank in one NVLink domain; hgx_h200: nodes of
    8 such GPUs joined by InfiniBand; nvl72: racks of 72 on NVLink 5 joined by InfiniBand;
    nvlink5, infiniband: one level; custom: fabric_gbps and fabric_latency_us
    (attngym.distributed.transfer_model states each assumption)."""
    fabric_gbps: float | None = setting(None, check=_number_or_none)
    """fabric=custom: GB/s (1e9 bytes/s) one rank receives."""
    fabric_latency_us: float | None = setting(None, check=_number_or_none)
    """fabric=custom: microseconds each transfer costs beside its bytes."""
    compare_one_device: bool = True
    """simulate: time the whole problem on this device too (single_<pass>_ms) for
    predicted_efficiency; false skips it (a long sequence's one-device run can outlast the
    simulation, and it does not depend on world_size)."""
    cuda_graph: bool = False
    """Capture each rank's call as CUDA graphs (forward and backward, PyTorch's
    make_graphed_callables) and time their replays, the one-device call alike: the host issues a
    call in one launch, so short shards on many ranks are not bound by it. On CUDA, over
    copy_engine or nccl; simulate: each rank's items captured and replayed the same way."""


Distribution = Literal["fixed", "uniform", "lognormal", "zipf", "file"]  # attngym.workload's


def _positive_number(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ConfigError(key, f"must be a finite positive number, got {value!r}")
    return float(value)


@dataclasses.dataclass(kw_only=True)
class Workload:
    """What the run attends: the config's one batch (none), or a stream of batches of packed
    documents whose lengths follow a distribution (documents; attngym.workload), each batch's
    variant the config's with that batch's documents (attngym.variants.spec.with_documents)."""

    name: Literal["none", "documents"] = "none"
    """none: one batch, the config's own mask; documents: `batches` batches of packed documents."""
    distribution: Distribution = "lognormal"
    """How document lengths are drawn: fixed (length), uniform (min_len..max_len), lognormal
    (median, sigma), zipf (min_len x Pareto(exponent)), file (workload.file)."""
    batches: int = 16
    """How many batches the workload holds."""
    seed: int = setting(0, low=0)
    """Seeds the draw of lengths."""
    length: int = 2048
    """fixed: every document's length."""
    min_len: int = 64
    """uniform, lognormal, zipf: the shortest document."""
    max_len: int | None = None
    """uniform, lognormal, zipf: the longest document; null: shape.seq_len."""
    median: int = 2048
    """lognormal: the median document length."""
    sigma: float = setting(1.0, check=_positive_number)
    """lognormal: the spread of log lengths (1.0: a tenth of documents past 3.6x the median)."""
    exponent: float = setting(1.5, check=_positive_number)
    """zipf: the power law's exponent (smaller: a longer tail)."""
    file: str | None = None
    """file: one document length a line, or one JSON list of lengths a line (given batches)."""


@dataclasses.dataclass(kw_only=True)
class Benchmark:
    warmup: int = setting(2, low=0)
    """Untimed calls before timing (the first call, compilation, is timed apart)."""
    repeats: int = 5
    """Timed calls; median, min and max are reported. With a budget, the least number of them
    (5: the fewest a ratio's interval is drawn from, bench.MIN_CI_REPEATS)."""
    budget_ms: float | None = setting(100.0, check=_budget)
    """As triton's do_bench: each timed callable makes as many timed calls as fill this many
    milliseconds at the pace of its last warm-up call (at least `repeats`, at most
    bench.MAX_REPEATS); 0 or null: exactly `repeats` calls."""


@dataclasses.dataclass(kw_only=True)
class Settings:
    """Everything a task needs to run one configuration, `auto` resolved."""

    attention: dict[str, Any] = setting()
    """The config entry: {"name": ..., **params} or {"name": ..., "compose": [...]}; required
    (the defaults list of conf/config.yaml names causal)."""
    variant: Variant | None = setting(None, written=False)
    """The Variant `attention` describes; built from it when not given."""
    shape: Shape = dataclasses.field(default_factory=Shape)
    topology: Topology = dataclasses.field(default_factory=Topology)
    benchmark: Benchmark = dataclasses.field(default_factory=Benchmark)
    workload: Workload = dataclasses.field(default_factory=Workload)
    device: Auto | Device = setting(AUTO, keys=("name",), what="device")
    """cpu | cuda; auto = cuda when torch sees a GPU, else cpu (attngym.device.resolve_device)."""
    dtype: Auto | Dtype = AUTO
    """auto = bfloat16 on cuda, float32 on cpu."""
    block_size: tuple[int, int] = setting((128, 128), keys=("q", "kv"), check=_block)
    """(q, kv) block-mask block size; a config may name one (flash, tuned), resolved on the
    device."""
    kernel_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Passed to flex_attention unchanged; null in a config is none."""
    compile: bool = True
    """torch.compile flex_attention on CUDA (always eager on CPU)."""
    compile_mode: str = setting("default", choices=_compile_modes)
    """A torch.compile mode (attngym.kernels.COMPILE_MODES)."""
    compile_cache: str | None = "auto"
    """Where compiled kernels are kept for later runs and processes (attngym.compile_cache):
    auto = $XDG_CACHE_HOME/attngym/compile (~/.cache/...), or a folder; null leaves PyTorch's
    own place (TORCHINDUCTOR_CACHE_DIR, else a folder in /tmp)."""
    compile_threads: int | None = setting(1, check=_compile_threads)
    """Inductor's compile workers: 1 compiles in the run's process (flex needs a few kernels,
    and a pool of workers costs seconds to start and stop); null: Inductor's own choice."""
    objective: tuple[str, ...] = setting((), check=_objective)
    """The tuner's (`+experiment=tune`): the metric(s) each sweep job returns to the Optuna
    sweeper, None for a job that failed or did not validate; empty for other runs."""
    profile_run: bool = False
    """Profile the run's own Python (cProfile, config to last file): run_profile.txt and
    run_profile.prof in the run folder."""
    passes: tuple[Pass, ...] = setting(("fwd", "bwd"), what="pass", non_empty=True)
    """What to time; bwd also times fwd+bwd."""
    baselines: tuple[Baseline, ...] = setting(
        (
            "sdpa",
            "sdpa_cudnn",
            "sdpa_flash",
            "sdpa_efficient",
            "sdpa_dense_mask",
            "varlen",
            "flash_varlen",
            "torch_cp",
        ),
        what="baseline",
    )
    """Contenders timed on the same inputs; each is skipped, with the reason, where it does not
    apply. A single-device run runs SINGLE_BASELINES, a context-parallel run CP_BASELINES."""
    validate: bool = True
    """Compare against the float64 dense reference."""
    validate_rows: int = 256
    """Query rows sampled when S is large (and the reference's rows at a time); every rank's
    first and last query blocks and the edges of its pieces are checked besides."""
    seed: int = setting(0, low=0)
    """Seeds the inputs and the sampled validation rows."""
    profiler: str = setting("none", keys=("name",), choices=_registered("profiler"))
    """A registered profiler: none | kernels | trace."""
    baseline_max_mask_bytes: int = setting(256 * 2**20, low=0)
    """Dense SDPA masks larger than this are skipped, not attempted."""
    skipped_baselines: dict[str, str] = setting(factory=dict, written=False)
    """Baselines that alone would not fit in the device's memory, with why (attngym.estimate):
    recorded as skipped, not attempted."""
    logger: dict[str, Any] = setting(factory=lambda: {"name": DEFAULT_TRACKER}, check=_tracker)
    """A registered tracker's name and its parameters (the tracker's factory's keywords)."""

    def __post_init__(self) -> None:
        self._resolve_auto()
        if self.variant is None:
            from attngym.variants.spec import build_variant

            self.variant = build_variant(
                self.attention, seq_len=self.shape.seq_len, heads=self.shape.heads
            )

    def _resolve_auto(self) -> None:
        """An `auto` left in a field, resolved on this machine as from_config resolves it."""
        if self.device == AUTO:
            self.device = _resolve_device(AUTO)
        if self.dtype == AUTO:
            from attngym.device import auto_dtype

            self.dtype = auto_dtype(self.device)
        topo = self.topology
        if topo.world_size == AUTO:
            topo.world_size = _resolve_world_size(topo.kind, AUTO, self.device)

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
        spread = _spread(self.topology.kind)
        return {
            "variant": self.variant.name,
            "topology": self.topology.kind,
            "world_size": self.topology.world_size,
            "transport": self.topology.transport,
            "layout": self.topology.layout if spread else None,
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


def _flash_block_size(device: str) -> tuple[int, int]:
    from attngym.device import get_flash_block_size

    return tuple(get_flash_block_size(device))  # type: ignore[return-value]


# Named block sizes, resolved against the device when the run starts (e.g. `block_size=flash`).
# Each maps the resolved device name to (q, kv).
BLOCK_SIZE_RESOLVERS: dict[str, Callable[[str], tuple[int, int]]] = {"flash": _flash_block_size}


# ---------------------------------------------------------------------------------------------
# Reading the fields.


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """The evaluated field types of `cls` (Variant, imported only for type checkers, as Any)."""
    return get_type_hints(cls, localns={"Variant": Any})


def _is_section(hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def _written(cls: type) -> list[dataclasses.Field]:
    """The fields of `cls` a config may write."""
    return [f for f in dataclasses.fields(cls) if _rule(f).written]


def _default(field: dataclasses.Field, key: str) -> Any:
    """The field's default as a config writes it (a fresh copy; a tuple as a list): a key the
    config leaves out takes it."""
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    if field.default is dataclasses.MISSING:
        raise ConfigError(key, "missing; it has no default")
    return list(field.default) if isinstance(field.default, tuple) else field.default


def _mapping_at(node: dict[str, Any], name: str, key: str) -> dict[str, Any]:
    """node[name] as a mapping; a missing or null one is made empty (its keys take defaults)."""
    child = node.get(name)
    if child is None:
        child = node[name] = {}
    if not isinstance(child, dict):
        raise ConfigError(key, f"must be a mapping, got {child!r}")
    return child


def _literals(args: Sequence[Any]) -> tuple[Any, ...]:
    """The choices of the Literal types among `args` (a union's members)."""
    return tuple(c for a in args if get_origin(a) is Literal for c in get_args(a))


def _check_value(key: str, value: Any, hint: Any, rule: _Rule, name: str) -> Any:
    """`value` checked against the field's type and rule: the value as checked (a float for
    a float, {} for a null mapping, [] for a null list), or a ConfigError naming `key`."""
    if rule.check is not None:
        return rule.check(key, value)
    what = rule.what or name.replace("_", " ")
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        choices = _literals(args)
        if value in choices and not isinstance(value, bool):
            return value
        rest = [a for a in args if a is not type(None) and get_origin(a) is not Literal]
        if not rest:
            raise ConfigError(key, choice_error(what, value, choices))
        (other,) = rest
        return _check_value(key, value, other, rule, name)
    if origin is Literal:
        if value not in args or isinstance(value, bool):
            raise ConfigError(key, choice_error(what, value, args))
        return value
    if origin is tuple:  # tuple[X, ...]: a list in the config; null is none
        values = [] if value is None else value
        choices = list(_literals(args[:1]))
        if not isinstance(values, list):
            raise ConfigError(key, f"must be a list of {choices}, got {value!r}")
        if rule.non_empty and not values:
            raise ConfigError(key, f"must be a non-empty list of {choices}, got {values!r}")
        return [_check_value(key, v, args[0], rule, name) for v in values]
    if origin is dict:  # an open mapping: its keys are its owner's (checked by a rule)
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            raise ConfigError(key, f"must be a mapping, got {value!r}")
        return dict(value)
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, f"must be true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int) or value < rule.low:
            need = "a positive integer" if rule.low == 1 else f"an integer >= {rule.low}"
            raise ConfigError(key, f"must be {need}, got {value!r}")
        return value
    if hint is str:
        if rule.choices is not None:
            choices = list(rule.choices())
            if value not in choices:
                raise ConfigError(key, choice_error(what, value, choices))
        elif not isinstance(value, str):
            raise ConfigError(key, f"must be a string, got {value!r}")
        return value
    raise TypeError(f"{key}: no check for a field of type {hint!r}")  # a new type needs one


def _check_section(cls: type, node: dict[str, Any], prefix: str = "") -> None:
    """Check `node` against the fields of `cls`, in place: a key it leaves out takes the
    field's default, every value its checked form; a bad value is a ConfigError naming the
    dotted key (`prefix` + the field)."""
    hints = _hints(cls)
    for field in _written(cls):
        key, hint, rule = prefix + field.name, hints[field.name], _rule(field)
        if _is_section(hint):
            _check_section(hint, _mapping_at(node, field.name, key), f"{key}.")
        elif rule.keys:
            child = _mapping_at(node, field.name, key)
            several = len(rule.keys) > 1
            defaults = _default(field, key) if several else (_default(field, key),)
            items = get_args(hint) if several else (hint,)
            for sub, default, item in zip(rule.keys, defaults, items, strict=True):
                value = child.get(sub, default)
                child[sub] = _check_value(f"{key}.{sub}", value, item, rule, field.name)
        else:
            if field.name not in node:
                node[field.name] = _default(field, key)
            node[field.name] = _check_value(key, node[field.name], hint, rule, field.name)


def _build(cls: type, node: Mapping[str, Any], **given: Any) -> Any:
    """`cls` from a checked section, field by field (`given` for the fields no config writes)."""
    hints = _hints(cls)
    values = {}
    for field in _written(cls):
        value, hint, keys = node[field.name], hints[field.name], _rule(field).keys
        if _is_section(hint):
            value = _build(hint, value)
        elif keys:
            value = value[keys[0]] if len(keys) == 1 else tuple(value[k] for k in keys)
        elif get_origin(hint) is tuple:
            value = tuple(value)
        elif get_origin(hint) is dict:
            value = dict(value)
        values[field.name] = value
    return cls(**values, **given)


def _keys_of(cls: type, prefix: str = "") -> list[str]:
    keys = []
    for field in _written(cls):
        key, hint, rule = prefix + field.name, _hints(cls)[field.name], _rule(field)
        if _is_section(hint):
            keys += _keys_of(hint, f"{key}.")
        elif rule.keys:
            keys += [f"{key}.{sub}" for sub in rule.keys]
        else:
            keys.append(key)
    return keys


def _open_mappings(cls: type, prefix: str = "") -> tuple[str, ...]:
    """The dotted keys of the open mappings (dict fields) of `cls` and its sections."""
    found: list[str] = []
    for field in _written(cls):
        hint, key = _hints(cls)[field.name], prefix + field.name
        if _is_section(hint):
            found += _open_mappings(hint, f"{key}.")
        elif get_origin(hint) is dict:
            found.append(key)
    return tuple(found)


# Mappings that take any key, each checked by its owner: the variant's parameters by
# attngym.variants.spec, flex's kernel options by flex, a tracker's by its factory, a topology's
# options by its spec, a scheme factory's arguments by its signature.
OPEN_MAPPINGS = _open_mappings(Settings)


def _in_open_mapping(key: str) -> bool:
    return any(key == m or key.startswith(f"{m}.") for m in OPEN_MAPPINGS)


def known_keys() -> list[str]:
    """Every dotted key a config may set (an open mapping as its own name)."""
    return _keys_of(Settings)


def check_key(key: str) -> None:
    """`key` (dotted) maps to a Settings field, or lies in an open mapping; else a ConfigError
    with the key it most likely means (`seq_len` → `shape.seq_len`, `shape.seqlen` →
    `shape.seq_len`)."""
    if _in_open_mapping(key):
        return
    known = known_keys()
    if key in known or any(k.startswith(f"{key}.") for k in known):
        return
    known += [f"topology.options.{name}" for name in _option_names()]  # what a key may mean
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
        if isinstance(value, Mapping) and not _in_open_mapping(key):
            _check_keys(value, f"{key}.")


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


# ---------------------------------------------------------------------------------------------
# Topologies, asked of their specs.


def _topology_specs() -> dict[str, Any]:
    """Every context-parallel topology's spec by kind (attngym.distributed's table), unbound."""
    from attngym import registry

    return {kind: registry.get("topology", kind) for kind in registry.names("topology")}


def _topology_spec(topo: Mapping[str, Any]) -> Any | None:
    """The spec a topology section runs (a `custom` one bound to its topology.scheme), or None
    for a kind that runs on one device."""
    spec = _topology_specs().get(topo["kind"])
    return None if spec is None else spec.bind(topo["scheme"], topo["scheme_args"])


def _spread(kind: str) -> bool:
    """Whether topology `kind` spreads the sequence over ranks (has a spec)."""
    return kind in _topology_specs()


# ---------------------------------------------------------------------------------------------
# Rules between fields, one function each, on the checked data. A value still `auto` is judged
# once resolved (RESOLVED_RULES).


def _flash(kernel_options: Mapping[str, Any] | None) -> bool:
    """attngym.kernels.is_flash, imported when first needed: `import attngym.config` pulls no
    torch."""
    from attngym.kernels import is_flash

    return is_flash(kernel_options)


def _kv_heads_divide_heads(data: dict[str, Any]) -> None:
    """GQA: every key/value head serves the same number of query heads."""
    heads, kv_heads = data["shape"]["heads"], data["shape"]["kv_heads"]
    if kv_heads is not None and heads % kv_heads:
        raise ConfigError(
            "shape.kv_heads",
            f"{kv_heads} does not divide shape.heads={heads}; use a divisor of {heads}",
        )


def _topology_rules(data: dict[str, Any]) -> None:
    """The topology's own rules (its spec's check: layouts, its options, heads, seq_len against
    the ranks once they are known; a `custom` one bound to its scheme first); one rank, and any
    topology's layout, on one device."""
    topo, shape = data["topology"], data["shape"]
    _check_option_keys(topo["options"])
    kind, world_size, layout = topo["kind"], topo["world_size"], topo["layout"]
    spec = _topology_spec(topo)
    if spec is not None:
        if spec.options is not None:
            _check_section(spec.options, topo["options"], "topology.options.")
        spec.check(topo, shape)
        return
    if world_size not in (1, AUTO):
        raise ConfigError(
            "topology.world_size", f"must be 1 (or auto) for topology {kind}, got {world_size}"
        )
    default = next(f.default for f in dataclasses.fields(Topology) if f.name == "layout")
    if layout != default and not any(s.takes_layout(layout) for s in _topology_specs().values()):
        # unused here; a sweep may set it for every topology alike
        layouts = sorted({name for s in _topology_specs().values() for name in s.layouts})
        raise ConfigError("topology.layout", choice_error("layout", layout, layouts))


def _option_names() -> list[str]:
    """Every topology's option names (their specs' options dataclasses)."""
    specs = _topology_specs().values()
    return sorted({f.name for s in specs if s.options for f in dataclasses.fields(s.options)})


def _check_option_keys(options: Mapping[str, Any]) -> None:
    """Every key of topology.options is some topology's option (a sweep may set one topology's
    options for all); else the one it most likely means."""
    known = _option_names()
    for key in options:
        if key not in known:
            raise ConfigError(
                f"topology.options.{key}", choice_error("topology option", key, known)
            )


def _simulation(data: dict[str, Any]) -> None:
    """topology.simulate: a context-parallel topology, an explicit number of ranks, a fabric
    with its numbers (custom) or a measured transport (h200_nvlink); what the scheme itself
    needs to be simulated is its spec's check."""
    topo = data["topology"]
    custom = topo["fabric"] == "custom"
    for key in ("fabric_gbps", "fabric_latency_us"):
        if not custom and topo[key] is not None:
            raise ConfigError(
                f"topology.{key}", f"is read only with topology.fabric=custom, got {topo[key]!r}"
            )
    if not topo["simulate"]:
        return
    if not _spread(topo["kind"]):
        raise ConfigError(
            "topology.simulate",
            f"simulates the ranks of a context-parallel topology, not topology={topo['kind']}",
        )
    size = topo["world_size"]
    if size == AUTO or not 2 <= size <= MAX_SIMULATED_RANKS:
        raise ConfigError(
            "topology.world_size",
            f"topology.simulate=true takes the ranks to simulate, 2 to {MAX_SIMULATED_RANKS}, "
            f"got {size!r}",
        )
    if custom and (not topo["fabric_gbps"] or topo["fabric_latency_us"] is None):
        raise ConfigError(
            "topology.fabric_gbps",
            "topology.fabric=custom needs topology.fabric_gbps > 0 and "
            f"topology.fabric_latency_us, got {topo['fabric_gbps']!r} and "
            f"{topo['fabric_latency_us']!r}",
        )
    measured = ("h200_nvlink", "hgx_h200")
    if topo["fabric"] in measured and topo["transport"] not in (AUTO, "copy_engine", "nccl"):
        raise ConfigError(
            "topology.transport",
            f"fabric={topo['fabric']} is measured for copy_engine and nccl (auto: copy_engine "
            f"inside one NVLink domain, nccl across), got {topo['transport']!r}",
        )


def _cuda_graph(data: dict[str, Any]) -> None:
    """topology.cuda_graph: a context-parallel call on CUDA, its transfers on the device (gloo
    moves tensors through the host, which a CUDA graph cannot capture)."""
    topo, device = data["topology"], str(data["device"]["name"])
    if not topo["cuda_graph"]:
        return
    if not _spread(topo["kind"]):
        raise ConfigError(
            "topology.cuda_graph",
            f"captures a context-parallel call, not topology={topo['kind']}; use "
            "topology.cuda_graph=false",
        )
    if not device.startswith("cuda"):
        raise ConfigError(
            "topology.cuda_graph",
            f"captures CUDA work, but device={device}; use device=cuda or "
            "topology.cuda_graph=false",
        )
    if topo["transport"] == "gloo" and not topo["simulate"]:
        raise ConfigError(
            "topology.transport",
            "gloo moves tensors through the host, which a CUDA graph cannot capture; with "
            "topology.cuda_graph=true use copy_engine, nccl or auto",
        )


def _flash_needs_16_bit(data: dict[str, Any]) -> None:
    """BACKEND=FLASH needs a 16-bit dtype."""
    dtype = data["dtype"]
    if _flash(data["kernel_options"]) and dtype in ("float32", "float64"):
        raise ConfigError(
            "kernel_options.BACKEND",
            f"FLASH needs a 16-bit dtype (bfloat16 or float16), but dtype={dtype}",
        )


def _flash_needs_compile(data: dict[str, Any]) -> None:
    """BACKEND=FLASH is an Inductor kernel: it exists only compiled."""
    if _flash(data["kernel_options"]) and not data["compile"]:
        raise ConfigError(
            "compile",
            "BACKEND=FLASH is a torch.compile (Inductor) kernel; compile=false would run flex's "
            "eager path without it; use compile=true or drop kernel_options.BACKEND",
        )


def _flash_on_this_device(data: dict[str, Any]) -> None:
    """BACKEND=FLASH on the resolved device: a CUDA device, and the block size its kernel has.

    The flash kernel is built for one block size per GPU generation
    (attngym.device.get_flash_block_size); any other block mask cannot run on it.
    """
    if not _flash(data["kernel_options"]):
        return
    device = data["device"]["name"]
    if device != "cuda":
        raise ConfigError(
            "kernel_options.BACKEND",
            f"FLASH is a CUDA backend, but device={device}; use device=cuda or drop BACKEND",
        )
    need = _flash_block_size(device)
    got = (data["block_size"]["q"], data["block_size"]["kv"])
    if got != need:
        raise ConfigError(
            "block_size",
            f"FLASH needs block_size (q, kv) = {need} on this GPU, got {got}; use block_size=flash",
        )


def _flash_is_installed(data: dict[str, Any]) -> None:
    """BACKEND=FLASH on a machine where flash-attn-4 and its CuTe DSL import: else Inductor
    fails while compiling the first call (`No module named 'cutlass'`)."""
    from attngym.tuning import flash_missing

    if _flash(data["kernel_options"]) and (why := flash_missing()):
        raise ConfigError(
            "kernel_options.BACKEND",
            f"FLASH runs flash-attn-4's kernels, but {why}; pip install --pre flash-attn-4 "
            '"nvidia-cutlass-dsl[cu13]" (or [cu12]), or drop BACKEND',
        )


# Triton flex's tiles and the block-mask side each one walks: forward (fwd_ or plain) and
# backward (bwd_ or plain; M1/N1 compute dK and dV, M2/N2 compute dQ).
TRITON_TILES = (
    ("fwd_", "BLOCK_M", "q"),
    ("fwd_", "BLOCK_N", "kv"),
    ("bwd_", "BLOCK_M1", "q"),
    ("bwd_", "BLOCK_N1", "kv"),
    ("bwd_", "BLOCK_M2", "q"),
    ("bwd_", "BLOCK_N2", "kv"),
)


def _triton_tiles_divide_blocks(data: dict[str, Any]) -> None:
    """On CUDA, Triton flex tiles each block of the block mask: every tile it is given (forward
    BLOCK_M/BLOCK_N, backward BLOCK_M1/N1/M2/N2, with or without their fwd_/bwd_ prefix) must
    divide the block size of its side, else Inductor refuses the kernel while compiling (a
    tuning trial that asks for it fails at once, not after a compile). FLASH picks its own
    tiles; a CPU runs eager flex, which has none."""
    options = data["kernel_options"]
    if _flash(options) or not str(data["device"]["name"]).startswith("cuda"):
        return
    for prefix, tile, side in TRITON_TILES:
        key = f"{prefix}{tile}" if f"{prefix}{tile}" in options else tile
        size, block = options.get(key), data["block_size"][side]
        if isinstance(size, int) and size > 0 and block % size:
            raise ConfigError(
                f"kernel_options.{key}",
                f"{size} must divide block_size.{side} ({block}): Triton flex tiles each block; "
                f"use a divisor of {block} or a larger block_size.{side}",
            )


# Inductor's backward kernel walks several inner tiles inside an outer one (static asserts in
# its template): (inner, outer), the outer tile a multiple of the inner one.
NESTED_BACKWARD_TILES = (("BLOCK_M1", "BLOCK_N1"), ("BLOCK_N2", "BLOCK_M2"))


def _triton_backward_tiles_nest(data: dict[str, Any]) -> None:
    """On CUDA, Triton flex's backward needs BLOCK_N1 a multiple of BLOCK_M1 (dK, dV) and
    BLOCK_M2 a multiple of BLOCK_N2 (dQ), else its template fails to compile (a CompilationError
    in bwd_dkdv_inner or bwd_dq_inner, after the compile has started): refused here at once."""
    options = data["kernel_options"]
    if (
        _flash(options)
        or "bwd" not in data["passes"]
        or not str(data["device"]["name"]).startswith("cuda")
    ):
        return
    for inner, outer in NESTED_BACKWARD_TILES:
        keys = [f"bwd_{t}" if f"bwd_{t}" in options else t for t in (inner, outer)]
        small, large = (options.get(k) for k in keys)
        if isinstance(small, int) and isinstance(large, int) and small > 0 and large % small:
            raise ConfigError(
                f"kernel_options.{keys[1]}",
                f"{large} must be a multiple of kernel_options.{keys[0]} ({small}): Triton "
                f"flex's backward walks {inner} tiles inside each {outer} one",
            )


def backward_block_error(
    blocks: Mapping[str, int], tiles: Sequence[tuple[int, int, int, int]]
) -> tuple[str, str] | None:
    """(key, why) where no backward tile set divides the block sizes (device.backward_tiles_fit,
    Inductor's own filter); None where one does."""
    from attngym.device import backward_tiles_fit

    if backward_tiles_fit(tiles, q=blocks["q"], kv=blocks["kv"]):
        return None
    side = "kv" if backward_tiles_fit(tiles, q=blocks["q"]) else "q"
    shown = ", ".join(f"M1 {m1} N1 {n1} M2 {m2} N2 {n2}" for m1, n1, m2, n2 in tiles)
    return f"block_size.{side}", (
        f"{blocks[side]} has no Triton backward kernel on this GPU: Inductor's backward tiles "
        f"({shown}) must divide the block sizes; use a larger block_size.{side} (e.g. 128), "
        "BACKEND=FLASH, or passes=[fwd]"
    )


def _triton_backward_has_a_kernel(data: dict[str, Any]) -> None:
    """On CUDA, compiled flex's Triton backward only exists for block sizes one of Inductor's
    backward tiles divides (attngym.device.triton_backward_tiles): refused here in one line, not
    after a compile with pages of Inductor's IR."""
    if (
        _flash(data["kernel_options"])
        or "bwd" not in data["passes"]
        or not data["compile"]
        or not str(data["device"]["name"]).startswith("cuda")
    ):
        return
    from attngym.device import triton_backward_tiles

    tiles = triton_backward_tiles(
        data["shape"]["head_dim"],
        data["dtype"],
        data["device"]["name"],
        autotune=str(data["compile_mode"]).startswith("max-autotune"),
    )
    refused = backward_block_error(data["block_size"], tiles) if tiles else None
    if refused:
        raise ConfigError(*refused)


FLASH_RULES = (
    _flash_needs_16_bit,
    _flash_needs_compile,
    _flash_on_this_device,
    _flash_is_installed,
)


def flash_refusal(settings: Settings) -> str | None:
    """Why this single-device run could not take FlexAttention's FLASH backend: the first FLASH
    rule its settings break with BACKEND=FLASH and block_size=flash, in one line; None where
    every rule passes (the kernel may still refuse what no rule here knows)."""
    return flash_refusal_of(
        settings.device, settings.dtype, settings.compile, settings.kernel_options,
        settings.block_size,
    )  # fmt: skip


def flash_refusal_of(
    device: str,
    dtype: str,
    compile: bool,
    kernel_options: Mapping[str, Any],
    block_size: tuple[int, int] | None = None,
) -> str | None:
    """flash_refusal from the values themselves (the tuner asks before any run has Settings);
    `block_size` only matters off CUDA, where FLASH's own is not known."""
    blocks = _flash_block_size(device) if device == "cuda" else (block_size or (128, 128))
    data = {
        "kernel_options": {**kernel_options, "BACKEND": "FLASH"},
        "dtype": dtype,
        "compile": compile,
        "device": {"name": device},
        "block_size": {"q": blocks[0], "kv": blocks[1]},
    }
    for rule in FLASH_RULES:
        try:
            rule(data)
        except ConfigError as err:  # its message, less the key and the advice after "; "
            return str(err).removeprefix(f"{err.key}: ").split("; ")[0]
    return None


def _workload(data: dict[str, Any]) -> None:
    """workload=documents: its batches can be made (a file read, its lines checked) and the
    attention entry has documents for them to set; the run's own entry becomes its first
    batch's (a factory of yours that takes doc_lengths needs no value of them in the config)."""
    spec = data["workload"]
    if spec["name"] == "none":
        return
    from attngym import workload
    from attngym.variants.spec import with_documents

    top = spec["max_len"]
    if top is not None and top < spec["min_len"]:
        raise ConfigError("workload.max_len", f"{top} is below min_len ({spec['min_len']})")
    try:
        first = workload_batches(data)[0]
    except workload.WorkloadError as err:
        raise ConfigError(f"workload.{err.key}", str(err)) from None
    data["attention"] = with_documents(data["attention"], first)


def workload_batches(data: Mapping[str, Any]) -> list[tuple[int, ...]]:
    """The document lengths of every batch of the config's workload (attngym.workload.batches);
    [] for workload=none."""
    from attngym import workload

    spec = data["workload"]
    if spec["name"] == "none":
        return []
    params = {k: v for k, v in spec.items() if k not in ("name", "distribution", "batches")}
    return workload.batches(spec["distribution"], count=spec["batches"],
                            seq_len=data["shape"]["seq_len"], **params)  # fmt: skip


# The rules on values alone, in this order (check_config and from_config).
VALUE_RULES: tuple[Callable[[dict[str, Any]], None], ...] = (
    _kv_heads_divide_heads,
    _workload,
    _topology_rules,
    _simulation,
    _flash_needs_16_bit,
    _flash_needs_compile,
)
# The rules on resolved values (from_config): those `auto` deferred, and the device's own.
RESOLVED_RULES: tuple[Callable[[dict[str, Any]], None], ...] = (
    _flash_needs_16_bit,
    _triton_tiles_divide_blocks,
    _triton_backward_tiles_nest,
    _triton_backward_has_a_kernel,
    _topology_rules,
    _cuda_graph,
    _flash_on_this_device,
    _flash_is_installed,
)


def _check_values(data: dict[str, Any]) -> Variant:
    """Every check that needs no hardware, on `data` (defaults written in); the built Variant."""
    _check_keys(data)
    _check_section(Settings, data)
    for rule in VALUE_RULES:
        rule(data)
    from attngym.variants.spec import build_variant

    shape = data["shape"]
    return build_variant(
        data["attention"], key="attention", seq_len=shape["seq_len"], heads=shape["heads"]
    )


def check_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Check every value that can be judged without hardware; return the plain dict, defaults
    filled in.

    Args:
        cfg: the composed config as a nested mapping (attngym.overrides.to_plain of Hydra's config).

    Raises:
        ConfigError: the first bad value, named by its dotted key.
    """
    data = plain(cfg)
    _check_values(data)
    return data


# ---------------------------------------------------------------------------------------------
# `auto` on this machine.


def _resolve_device(name: str) -> str:
    """`device.name` resolved by attngym.device.resolve_device (the one resolver): cpu | cuda."""
    from attngym.device import resolve_device

    try:
        return resolve_device(name).type
    except ValueError as err:
        raise ConfigError("device.name", str(err)) from None


# topology.world_size=auto on a CPU: two ranks (gloo), enough to exercise every exchange.
CPU_RANKS = 2


def ranks_asked(topology: Mapping[str, Any], gpus: int) -> int:
    """How many ranks a run of this `topology` section starts, known before it runs (the SLURM
    launcher asks for resources by it): 1 on one device or simulated, else its world_size, with
    `auto` resolved as on the machine that runs it: `gpus` where it lends GPUs, else CPU_RANKS."""
    if topology.get("simulate") or not _spread(str(topology.get("kind"))):
        return 1
    size = topology.get("world_size", AUTO)
    if size == AUTO:
        return gpus if gpus > 0 else CPU_RANKS
    return int(size)


def _resolve_world_size(kind: str, value: Any, device: str) -> int:
    """auto → 1 on one device; torchrun's WORLD_SIZE when launched by it; GPU count; 2 on CPU.

    Without a launcher, more ranks than GPUs fail here (the one check of the rule) unless
    TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 lets ranks share GPUs.
    """
    if not _spread(kind):
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
            if count < 1:
                raise ConfigError("topology.world_size", f"resolved to {count}; need at least 1")
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
        log.info("topology.world_size=auto: %d ranks on cpu", CPU_RANKS)
        return CPU_RANKS
    return value


def _resolve_blocks(
    data: dict[str, Any], device: str, dtype: str, kernel_options: dict[str, Any], variant: str
) -> tuple[tuple[int, int], dict[str, Any]]:
    """The block size on this device (a `flash` or `tuned` name resolved) and the kernel
    options (`tuned` adds the table's, yours win)."""
    names = (data["block_size"]["q"], data["block_size"]["kv"])
    if TUNED in names:
        from attngym import tuning
        from attngym.device import device_info

        blocks, kernel_options = tuning.resolve(
            variant,
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


def _resolve(data: dict[str, Any], variant: str) -> None:
    """Write the machine's values over `auto` and the named block sizes in the checked `data`:
    device, dtype, topology.world_size, block_size (and the kernel options `tuned` adds for the
    `variant` so named, a user's own too)."""
    device = data["device"]["name"] = _resolve_device(data["device"]["name"])
    if data["dtype"] == AUTO:
        from attngym.device import auto_dtype

        data["dtype"] = auto_dtype(device)
    topo = data["topology"]
    if not topo["simulate"]:  # simulated ranks: any number, whatever the GPUs
        topo["world_size"] = _resolve_world_size(topo["kind"], topo["world_size"], device)
    (q, kv), kernel_options = _resolve_blocks(
        data, device, data["dtype"], data["kernel_options"], variant
    )
    data["block_size"] = {"q": q, "kv": kv}
    data["kernel_options"] = kernel_options


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
        "available"
        if have is None
        else "in all (each rank of torchrun or SLURM judges by the total)",
    )
    return dict(result.skipped_baselines)


def from_config(cfg: Mapping[str, Any]) -> Settings:
    """Check the config, resolve `auto` values on this machine, return the run's Settings.

    Args:
        cfg: the composed config as a nested mapping (attngym.overrides.to_plain of Hydra's config).

    Raises:
        ConfigError: a bad value (see check_config) or one this machine cannot run.
    """
    data = plain(cfg)
    variant = _check_values(data)
    _resolve(data, variant.name)
    for rule in RESOLVED_RULES:
        rule(data)
    blocks = (data["block_size"]["q"], data["block_size"]["kv"])
    topo = data["topology"]
    # Simulated ranks hold the whole problem on this one device, as the one-device run does.
    ranks = 1 if topo["simulate"] else topo["world_size"]
    skipped = _check_fits(data, data["device"]["name"], data["dtype"], ranks, blocks)
    return _build(Settings, data, variant=variant, skipped_baselines=skipped)
