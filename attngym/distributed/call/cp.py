"""The call every context-parallel scheme shares: its options, its statistics, its resolution.

Context-parallel attention splits the sequence over P ranks (attngym.distributed.placement.layout);
each rank holds the q/k/v rows of its chunks and computes attention of its q chunks over every K/V
chunk, the variant evaluated at global positions. The algorithms (ring.py, allgather.py) differ in
how K/V travel; what they share is split by concern, this module holding what every scheme
(Ulysses, torch_cp and a user's included) takes:

    CPOptions    the kernel and backward choices of one call (one dataclass, validated once)
    CPStats      what a call did (pairs, bytes, per-step timings, the merged lse)
    CPCall       a resolved call: options plus rank, world size, transport, layout, variant
    run          the one body of ring_attention and allgather_attention (prepare, then run)
    attend_chunk the kernel call of every scheme, a q chunk over a kv chunk at global positions
    StepClock    per-step host timings for CPStats

Beside it: pairs.py (the plan of chunk pairs, the rows a rank reads, the loops that attend and
differentiate them) and accumulate.py (the lse merge of a rank's partials, the gradient sums).

Backward of one pair (`CPOptions.backward`):
    flex       the pair's gradient from the merged (global) out and lse through flex's backward
               op (attngym.distributed.call.flex_backward): P = exp(s - lse), D = rowsum(dO * O), as
               ring-flash-attention and TransformerEngine do; no forward is run again.
    recompute  re-run the pair's forward under autograd and weight its gradient by
               w = exp(lse_pair - lse) (the chunk kernel's own backward).
    auto       flex where this PyTorch has the op (logged once), else recompute; a flex failure
               at run time under auto is logged and recompute takes over for the process.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import Any

import torch

from attngym import kernels
from attngym.distributed.placement import layout as layouts
from attngym.distributed.placement.grid import plans_for
from attngym.errors import choice_error
from attngym.variants.base import Variant

log = logging.getLogger(__name__)

BACKWARDS = ("auto", "flex", "recompute")


@dataclasses.dataclass
class CPStats:
    """What one context-parallel call did, filled when passed as `stats=` (for tasks and tests).

    Timing a step synchronises the device around it on CUDA, so a call with stats measures steps,
    not the overlapped whole; time the whole without stats.
    """

    pairs_computed: int = 0  # (q chunk, kv chunk) pairs attended
    pairs_skipped: int = 0  # pairs skipped as fully masked
    bytes_sent: int = 0  # bytes this rank pushed or contributed to a gather
    step_compute_ms: list[float] = dataclasses.field(default_factory=list)
    step_wait_ms: list[float] = dataclasses.field(default_factory=list)  # blocked on a transfer
    lse: torch.Tensor | None = None  # (B, H, S/P) merged log-sum-exp of the last forward
    backward: str | None = (
        None  # the last call's backward: flex | recompute (ring), or the kernel's own
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class CPOptions:
    """The kernel and backward choices of one context-parallel call.

    Attributes:
        backend: chunk kernel, auto | flex | reference (auto: flex on CUDA, reference on CPU).
        block_size: (q, kv) block size of the block masks.
        kernel_options: passed to flex_attention (and to its backward op).
        scale: score scale, default 1 / sqrt(D).
        timeout_s: how long a CPU transfer may wait before RankFailure.
        compile: compile the flex kernels (False: eager flex); see attngym.kernels.attend_chunk.
        compile_mode: torch.compile mode when compiling (attngym.kernels.COMPILE_MODES).
        backward: how a pair's gradient is computed: auto | flex | recompute (module docstring).
    """

    backend: str = "auto"
    block_size: tuple[int, int] = (128, 128)
    kernel_options: Mapping[str, Any] | None = None
    scale: float | None = None
    timeout_s: float = 60.0
    compile: bool = True
    compile_mode: str = "default"
    backward: str = "auto"

    def __post_init__(self):
        if self.backend not in kernels.BACKENDS:
            raise ValueError(choice_error("backend", self.backend, kernels.BACKENDS))
        try:
            block = tuple(int(x) for x in self.block_size)
        except (TypeError, ValueError):
            raise ValueError(f"block_size must be (q, kv) ints, got {self.block_size!r}") from None
        if len(block) != 2 or min(block) <= 0:
            raise ValueError(
                f"block_size must be two positive ints (q, kv), got {self.block_size!r}"
            )
        object.__setattr__(self, "block_size", block)
        if self.compile_mode not in kernels.COMPILE_MODES:
            raise ValueError(choice_error("compile_mode", self.compile_mode, kernels.COMPILE_MODES))
        if self.backward not in BACKWARDS:
            raise ValueError(choice_error("backward", self.backward, BACKWARDS))
        if self.backward == "recompute" and kernels.is_flash(self.kernel_options):
            raise ValueError(
                "backward='recompute' differentiates each pair's lse, which FLASH's backward "
                "cannot; with kernel_options BACKEND=FLASH use backward='flex' or 'auto'"
            )
        if isinstance(self.timeout_s, bool) or not self.timeout_s > 0:
            raise ValueError(
                f"timeout_s must be a positive number of seconds, got {self.timeout_s!r}"
            )
        object.__setattr__(self, "compile", bool(self.compile))


def options_from(options: CPOptions | None, **overrides: Any) -> CPOptions:
    """`options` (default CPOptions()) with the keyword arguments a caller passed on top."""
    base = options if options is not None else CPOptions()
    if not isinstance(base, CPOptions):
        raise TypeError(f"options must be a CPOptions, got {type(options).__name__}")
    return dataclasses.replace(base, **overrides) if overrides else base


@dataclasses.dataclass(frozen=True, eq=False)
class CPCall:
    """A resolved context-parallel call: its options and where this rank stands."""

    variant: Variant
    group: Any
    transport: Any  # transport.Transport
    layout: layouts.Layout
    options: CPOptions
    backend: str  # resolved: flex | reference
    backward: str  # resolved: flex | recompute
    rank: int
    world_size: int
    seq_len: int
    stats: CPStats | None
    # Where its chunk-pair plans come from before they are built one by one: a callable taking
    # _pair_plan's key and returning (skip, block_mask), or None to build it (grid.GridPlans:
    # cut from the whole sequence's block grid, on flex).
    plans: Any = None
    # A backward will follow: autograd records the call (what the forward keeps for it).
    grad: bool = True

    def chunks(self, rank: int) -> list[tuple[int, int]]:
        """The (global offset, length) chunks of `rank`'s shard."""
        return self.layout.chunks(rank)


def check_shards(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """ValueError unless q (B, H, S/P, D) and k, v (B, G, S/P, D) are one rank's shards of one
    call: 4-D, k and v alike, G dividing H, one dtype and one device."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D (B, H, S/P, D); got {q.shape}, {k.shape}, {v.shape}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {k.shape} and {v.shape}")
    b, h, s, d = q.shape
    if k.shape[0] != b or k.shape[2] != s or k.shape[3] != d:
        raise ValueError(f"k/v shape {tuple(k.shape)} does not match q shape {tuple(q.shape)}")
    if h % k.shape[1]:
        raise ValueError(f"kv heads ({k.shape[1]}) must divide query heads ({h})")
    if not (q.dtype == k.dtype == v.dtype and q.device == k.device == v.device):
        raise ValueError("q, k, v must share one dtype and one device")


def prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    variant: Variant,
    *,
    group,
    transport: str,
    layout: str | layouts.Layout,
    options: CPOptions,
    stats: CPStats | None,
) -> CPCall:
    """Check the shards and arguments (ValueError naming the parameter) and resolve the choices."""
    import torch.distributed as dist

    from attngym.distributed.transport import resolve_transport

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("context-parallel attention needs an initialised process group")
    check_shards(q, k, v)
    world_size = dist.get_world_size(group)
    seq_len = q.shape[2] * world_size
    variant.check_seq_len(seq_len)
    if variant.device is not None and variant.device != q.device:
        variant = variant.to(q.device)
    plan = layouts.resolve(layout, world_size, seq_len, variant, q.device)
    backend = kernels.resolve_backend(options.backend, q.device)
    return CPCall(
        variant=variant,
        group=group,
        transport=resolve_transport(transport, q.device, group),
        layout=plan,
        options=options,
        backend=backend,
        backward=resolve_backward(options),
        rank=dist.get_rank(group),
        world_size=world_size,
        seq_len=seq_len,
        stats=stats,
        # Block masks cut from the whole sequence's grid, evaluated once (any mask); the
        # reference backend decides skips on the exact mask over (B, H) instead.
        plans=plans_for(variant, seq_len, options.block_size, q.device)
        if backend == "flex"
        else None,
    )


def resolve_backward(options: CPOptions) -> str:
    """flex | recompute for options.backward. With FLASH, auto means flex and never falls back
    to recompute: FLASH's backward has no lse gradient, which a recompute needs."""
    from attngym.distributed.call import flex_backward

    choice = options.backward
    if choice == "recompute":
        return "recompute"
    usable, why = flex_backward.available()
    flash = kernels.is_flash(options.kernel_options)
    if choice == "flex" or flash:
        if usable:
            return "flex"
        if flash:
            raise ValueError(f"BACKEND=FLASH needs flex's backward op for a CP backward: {why}")
        raise ValueError(f"backward='flex' is unusable on this PyTorch: {why}; use recompute")
    if not usable or flex_backward.failed_before():
        flex_backward.log_once(f"backward=auto resolved to 'recompute': {why or 'flex failed'}")
        return "recompute"
    flex_backward.log_once("backward=auto resolved to 'flex' (no forward re-run)")
    return "flex"


def attend_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    variant: Variant,
    *,
    q_offset: int = 0,
    kv_offset: int = 0,
    options: CPOptions | None = None,
    block_mask=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of a q chunk over a kv chunk at global positions: the kernel call of every
    scheme, attngym's and yours, with one CPOptions for its choices.

    q (B, H, m, D) holds tokens q_offset .., k and v (B, G, n, D) tokens kv_offset ..; the
    variant is evaluated at those global positions. Flex on CUDA (compiled as `options` say),
    the differentiable dense reference on CPU; `block_mask`: one built for exactly this pair,
    reused. Returns (out (B, H, m, D) in q's dtype, lse (B, H, m) natural log, float32 or
    float64), both differentiable; a row the mask hides from every key has out 0 and lse -inf,
    so `merge` of the chunks of all keys is exact.
    """
    opts = options if options is not None else CPOptions()
    return kernels.attend_chunk(
        q, k, v, variant, q_offset=q_offset, kv_offset=kv_offset, backend=opts.backend,
        block_size=opts.block_size, block_mask=block_mask, kernel_options=opts.kernel_options,
        scale=opts.scale, compile=opts.compile, compile_mode=opts.compile_mode,
    )  # fmt: skip


def attend(call: CPCall, q, k, v, q_offset, kv_offset, block_mask, variant=None):
    """attend_chunk with the call's options (and variant, unless given)."""
    variant = call.variant if variant is None else variant
    return attend_chunk(
        q, k, v, variant, q_offset=q_offset, kv_offset=kv_offset, options=call.options,
        block_mask=block_mask,
    )  # fmt: skip


class StepClock:
    """Per-step host timings for CPStats (synchronising the device when stats are wanted)."""

    def __init__(self, stats: CPStats | None, device: torch.device):
        self.stats, self.device = stats, device
        self.t = 0.0

    def start(self) -> None:
        if self.stats is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.t = time.perf_counter()

    def stop(self, into: str) -> None:
        """Record the time since start() in stats.<into> (step_compute_ms or step_wait_ms)."""
        if self.stats is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            getattr(self.stats, into).append((time.perf_counter() - self.t) * 1e3)


def run(
    function: type[torch.autograd.Function] | Any,
    q,
    k,
    v,
    variant,
    *,
    group=None,
    transport: str = "auto",
    layout: str | layouts.Layout = "contiguous",
    options: CPOptions | None = None,
    stats: CPStats | None = None,
    **overrides: Any,
) -> torch.Tensor:
    """Check and resolve the arguments (prepare), then run `function` (ring or all-gather).

    The one body of ring_attention and allgather_attention: they differ only in `function`, an
    autograd Function or a plain callable taking (q, k, v, call).
    """
    opts = options_from(options, **overrides)
    call = prepare(
        q, k, v, variant, group=group, transport=transport, layout=layout, options=opts, stats=stats
    )
    if stats is not None:
        stats.backward = call.backward
    if isinstance(function, type) and issubclass(function, torch.autograd.Function):
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        return function.apply(q, k, v, dataclasses.replace(call, grad=grad))
    return function(q, k, v, call)
