"""The settings types: each setting stated once, as a typed dataclass field.

A field holds its default, its allowed values (a `Literal` type, or `setting(choices=...)` where
another module owns the list) and any check its type does not say (`setting(check=...)`). Apart
from the walker that reads them (walker.py) and the rules between fields (topology.py, flash.py),
so that a new key is one field here and the types read as the list of settings.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, get_args

from attngym.errors import ConfigError, choice_error
from attngym.runner.config.machine import AUTO, Auto, _resolve_device, _resolve_world_size, _spread

if TYPE_CHECKING:
    from attngym.variants.base import Variant

# Choices, each stated once as a type; the tuples the checks use come from them.
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
# (attngym.distributed.model.transfer_model.FABRIC_NAMES, held equal by tests/test_config.py).
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
    """The field's rule: `setting`'s, or an int's least value as a scheme's options (which the
    run layer's `setting` does not reach) write it, `field(default=3, metadata={"low": 0})`."""
    if "low" in field.metadata:
        return _Rule(low=field.metadata["low"])
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
    """attngym.kernels' tuple, imported when first needed (`import attngym.runner.config` pulls no
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
    (contiguous, zigzag, double_zigzag, balanced for ring, allgather and custom; contiguous,
    zigzag, double_zigzag for ulysses; contiguous, zigzag for hybrid), or your own balancer's
    import path (module.function) where the spec takes one. Unused on one device."""
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The topology's own options (topology.options.<key>), typed and checked by its spec's
    options dataclass (hybrid: a2a_size, across); a topology ignores other topologies' keys,
    so one sweep may set them for all."""
    scheme: str | None = None
    """topology=custom: your scheme's import path (module.function, or a module-level
    TopologySpec), attngym.distributed.schemes.custom; ignored by the built-in topologies."""
    scheme_args: dict[str, Any] = dataclasses.field(default_factory=dict)
    """topology=custom: when given, topology.scheme names a factory called with these keyword
    arguments that returns the scheme."""
    timeout_s: float = setting(120.0, check=_seconds)
    """A rank that waits longer than this fails the run."""
    simulate: bool = False
    """Simulated ranks: every rank's compute run one after another on this one device, the call
    over world_size ranks (2 to MAX_SIMULATED_RANKS, whatever the GPUs present) predicted from
    those times and the fabric's transfers (attngym.runner.tasks.cp_simulate)."""
    fabric: Fabric = "h200_nvlink"
    """simulate: the links transfers are priced on. h200_nvlink: measured on two H200s for
    topology.transport (auto: copy_engine), every rank in one NVLink domain; hgx_h200: nodes of
    8 such GPUs joined by InfiniBand; nvl72: racks of 72 on NVLink 5 joined by InfiniBand;
    nvlink5, infiniband: one level; custom: fabric_gbps and fabric_latency_us
    (attngym.distributed.model.transfer_model states each assumption)."""
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
