"""The machinery ring and all-gather attention share: options, plan of chunk pairs, accumulators.

Context-parallel attention splits the sequence over P ranks (attngym.distributed.layout); each
rank holds the q/k/v rows of its chunks and computes attention of its q chunks over every K/V
chunk, the variant evaluated at global positions. The algorithms (ring.py, allgather.py) differ in
how K/V travel; what they share lives here:

    CPOptions    the kernel and backward choices of one call (one dataclass, validated once)
    CPStats      what a call did (pairs, bytes, per-step timings, the merged lse)
    CPCall       a resolved call: options plus rank, world size, transport, layout, variant
    pairs        the plan of (q chunk, kv chunk) pairs against one K/V shard (or the rows of it
                 held), masked ones skipped; rows_read / runs_read: which rows of a shard a rank
                 reads
    Accumulator  the lse merge of a rank's output: partials held as the kernels gave them and
                 merged in one pass (compiled on CUDA); a q chunk that meets one pair keeps the
                 kernel's partial as is (nothing filled or merged)
    GradSum      the sum of a gradient's pieces, held and added in one pass: a single piece is
                 handed back as is, float32 only where two pieces meet
    forward_pairs / backward_pairs   attend, or differentiate, this rank's q over one K/V shard
    StepClock    per-step host timings for CPStats

Backward of one pair (`CPOptions.backward`):
    flex       the pair's gradient from the merged (global) out and lse through flex's backward
               op (attngym.distributed.flex_backward): P = exp(s - lse), D = rowsum(dO * O), as
               ring-flash-attention and TransformerEngine do; no forward is run again.
    recompute  re-run the pair's forward under autograd and weight its gradient by
               w = exp(lse_pair - lse) (the chunk kernel's own backward).
    auto       flex where this PyTorch has the op (logged once), else recompute; a flex failure
               at run time under auto is logged and recompute takes over for the process.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import time
import weakref
from collections.abc import Mapping
from typing import Any

import torch

from attngym import kernels, reference
from attngym.distributed import layout as layouts
from attngym.distributed.grid import plans_for
from attngym.distributed.merge import compiled_sums, merged_weights, weighted_sum, weights
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
    from attngym.distributed import flex_backward

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


# Variant -> {(batch, heads, q chunk, kv chunk, block size, backend, device): (skip, block_mask)}.
# Weak keys: an entry (with its device BlockMasks) goes when its Variant is collected, so a caller
# whose variant prepare() moves to the device on every call builds per call and leaks nothing.
_PLANS: weakref.WeakKeyDictionary[Variant, dict[tuple, tuple[bool, Any]]] = (
    weakref.WeakKeyDictionary()
)


def _pair_plan(
    variant: Variant,
    batch: int,
    heads: int,
    q_chunk: tuple[int, int],
    kv_chunk: tuple[int, int],
    block_size: tuple[int, int],
    backend: str,
    device: torch.device,
    source=None,
):
    """(skip, block_mask) for one chunk pair: skip when the variant masks every entry.

    backend "reference": the exact dense mask over (B, H) decides and no block mask is kept (the
    mask is small there). "flex": the block mask the kernels use anyway decides, and is kept for
    them; a variant without a mask gets a full block mask (flex's backward op needs one). Memoised
    in _PLANS; `source` (CPCall.plans) may supply it first.
    """
    plans = _PLANS.setdefault(variant, {})
    key = (batch, heads, q_chunk, kv_chunk, block_size, backend, device)
    if key not in plans:
        plan = None if source is None else source(*key)
        plans[key] = plan if plan is not None else _build_pair_plan(
            variant, batch, heads, q_chunk, kv_chunk, block_size, backend, device
        )  # fmt: skip
    return plans[key]


def _build_pair_plan(variant, batch, heads, q_chunk, kv_chunk, block_size, backend, device):
    if backend == "reference":
        if variant.mask_mod is None:
            return False, None
        q_pos = torch.arange(q_chunk[0], q_chunk[0] + q_chunk[1], device=device)
        kv_pos = torch.arange(kv_chunk[0], kv_chunk[0] + kv_chunk[1], device=device)
        keep = reference.dense_mask(variant.mask_mod, batch, heads, q_pos, kv_pos)
        return not bool(keep.any()), None
    block_mask = kernels.make_block_mask(
        variant,
        q_chunk[1],
        kv_chunk[1],
        q_offset=q_chunk[0],
        kv_offset=kv_chunk[0],
        block_size=block_size,
        device=device,
        full_when_unmasked=True,
    )
    return kernels.block_mask_is_empty(block_mask), block_mask


def pairs(
    call: CPCall,
    q: torch.Tensor,
    kv_rank: int,
    *,
    block_masks: str | None = None,
    window: tuple[int, int] | None = None,
):
    """The (q rows, kv rows, q chunk, kv chunk, block_mask) pairs to compute against kv_rank.

    Rows are local slices of this rank's q shard and of the K/V held; chunks are global
    (offset, length). Skipped pairs are counted in call.stats.

    Args:
        block_masks: the backend whose block masks to return ("flex", or "reference" for none);
            default the call's backend. The flex backward asks for "flex" masks whatever the
            forward kernel is.
        window: (start, length): only rows [start, start + length) of kv_rank's shard are held
            (a halo, see ring.py); kv rows are then relative to `start` and each kv chunk is cut
            to the window. Rows outside it must be masked for this rank (the halo plan ensures
            it), so the cut is exact.
    """
    backend = block_masks or call.backend
    lo, hi = (0, call.seq_len // call.world_size) if window is None else (window[0], sum(window))
    out = []
    q_start = 0
    for qc in call.chunks(call.rank):
        kv_start = 0
        for kc in call.chunks(kv_rank):
            a, b = max(kv_start, lo), min(kv_start + kc[1], hi)
            kv_start += kc[1]
            if a >= b:
                continue
            kc_cut = (kc[0] + a - (kv_start - kc[1]), b - a)
            skip, block_mask = _call_plan(call, q, qc, kc_cut, backend)
            if call.stats is not None and block_masks is None:
                call.stats.pairs_skipped += int(skip)
                call.stats.pairs_computed += int(not skip)
            if not skip:
                out.append(
                    (slice(q_start, q_start + qc[1]), slice(a - lo, b - lo), qc, kc_cut, block_mask)
                )
        q_start += qc[1]
    return out


def read_part(call: CPCall, q: torch.Tensor, pair, backend: str):
    """The pair (as `pairs` gives it) cut to the query rows and keys its mask reads, when they
    are at most half of either side (a halo pair then returns gradient pieces over the band it
    touches, not over the whole q chunk and kv window). A cut is a power-of-two number of blocks
    (`_bucket`), so the kernel shapes cuts add, each compiled once, stay few. Memoised."""
    q_rows, kv_rows, qc, kc, block_mask = pair
    plans = _PLANS.setdefault(call.variant, {})
    key = ("read", *q.shape[:2], qc, kc, call.options.block_size, backend, q.device)
    if key not in plans:
        qa, qb, ka, kb = _read_extent(call, q, qc, kc, block_mask, backend)
        bq, bkv = call.options.block_size
        plans[key] = (*_bucket(qa, qb, qc[1], bq), *_bucket(ka, kb, kc[1], bkv))
    qa, qb, ka, kb = plans[key]
    if (qa, qb, ka, kb) == (0, qc[1], 0, kc[1]):
        return pair
    qc_cut, kc_cut = (qc[0] + qa, qb - qa), (kc[0] + ka, kb - ka)
    _, cut_mask = _call_plan(call, q, qc_cut, kc_cut, backend)
    return (
        slice(q_rows.start + qa, q_rows.start + qb),
        slice(kv_rows.start + ka, kv_rows.start + kb),
        qc_cut,
        kc_cut,
        cut_mask,
    )


def _bucket(a: int, b: int, n: int, block: int) -> tuple[int, int]:
    """Rows [a, b) of n widened to a power-of-two number of blocks inside [0, n); all of [0, n)
    when they are more than half of it."""
    if 2 * (b - a) > n:
        return 0, n
    start = a - a % block
    blocks = -(-(b - start) // block)
    length = min(block << math.ceil(math.log2(blocks)), n)
    start = min(start, n - length)
    return start, start + length


def _read_extent(call: CPCall, q: torch.Tensor, qc, kc, block_mask, backend: str):
    """(q first, q stop, kv first, kv stop) local rows of a chunk pair that its mask reads."""
    if call.variant.mask_mod is None:
        return 0, qc[1], 0, kc[1]
    if backend == "reference":
        q_pos = torch.arange(qc[0], qc[0] + qc[1], device=q.device)
        kv_pos = torch.arange(kc[0], kc[0] + kc[1], device=q.device)
        keep = reference.dense_mask(call.variant.mask_mod, *q.shape[:2], q_pos, kv_pos)
        rows = keep.flatten(0, 1).any(0)  # (q rows, kv rows)
        q_read, kv_read = rows.any(1).nonzero(), rows.any(0).nonzero()
        return int(q_read[0]), int(q_read[-1]) + 1, int(kv_read[0]), int(kv_read[-1]) + 1
    bq, bkv = block_mask.BLOCK_SIZE
    kept = block_mask.kv_num_blocks
    if block_mask.full_kv_num_blocks is not None:
        kept = kept + block_mask.full_kv_num_blocks
    q_blocks = (kept.flatten(0, 1).amax(0) > 0).nonzero()
    kv_blocks = _kv_blocks_kept(block_mask, -(-kc[1] // bkv)).nonzero()
    return (
        int(q_blocks[0]) * bq,
        min((int(q_blocks[-1]) + 1) * bq, qc[1]),
        int(kv_blocks[0]) * bkv,
        min((int(kv_blocks[-1]) + 1) * bkv, kc[1]),
    )


@dataclasses.dataclass(frozen=True, eq=False)
class PositionedCall:
    """A kernel call whose query rows and keys sit at given global positions (several chunks,
    or keys gathered from several shards): the variant read there (positions.at_positions),
    the block mask of those positions (cut from the call's grid where it has one) and the
    positions as flex's backward op takes them (positions.BackwardMaps)."""

    variant: Variant
    block_mask: Any  # None on the reference backend when flex's backward op does not run
    maps: Any  # positions.BackwardMaps


def positioned(
    call: CPCall, q_positions: torch.Tensor, kv_positions: torch.Tensor, name: str
) -> PositionedCall:
    """The PositionedCall of queries at `q_positions` against keys at `kv_positions` (global
    positions in local order) for this call; the block mask is built where a flex kernel reads
    it (the forward on flex, flex's backward op on any backend)."""
    from attngym.distributed.positions import at_positions, backward_maps

    device = q_positions.device
    tables = kernels.offsets_as_tables(call.options.kernel_options)
    mapped = at_positions(
        call.variant, q_positions, kv_positions, device, name, offsets_as_tables=tables
    )
    block_mask = None
    if call.plans is not None:  # cut from the grid: no mask evaluated for this call
        block_mask = call.plans.sub_mask(q_positions, kv_positions, mapped.mask_mod)
    if block_mask is None and "flex" in (call.backend, call.backward):
        block_mask = kernels.make_block_mask(
            mapped, q_positions.numel(), kv_positions.numel(), block_size=call.options.block_size,
            device=device, full_when_unmasked=True,
        )  # fmt: skip
    return PositionedCall(mapped, block_mask, backward_maps(q_positions, kv_positions))


def one_call_steps(call: CPCall) -> bool:
    """Whether the ring steps of this call are one PositionedCall each (step_call): where a
    shard holds several chunks (zigzag, balanced, a user's layout). A host issues a compiled
    call in about 0.1-0.3 ms, far longer than a pair kernel of small chunks runs (64 ranks of
    128K: 1K rows, microseconds), so pair kernels would leave the device waiting on the host.
    A contiguous shard's step is one pair anyway, at offsets: its callbacks read no table."""
    return len(call.chunks(call.rank)) > 1


# Variant -> {(layout, rank, kv rank, window, B, H, block size, backend, backward, device,
# tables): PositionedCall | None}.
_STEPS: weakref.WeakKeyDictionary[Variant, dict[tuple, PositionedCall | None]] = (
    weakref.WeakKeyDictionary()
)


def step_call(
    call: CPCall, q: torch.Tensor, kv_rank: int, window: tuple[int, int] | None = None
) -> PositionedCall | None:
    """The call of this rank's whole q shard against kv_rank's shard (or the `window` of it
    held, as `pairs` takes it); None when the mask keeps nothing there. Memoised per variant."""
    n = call.seq_len // call.world_size
    window = (0, n) if window is None else tuple(window)
    tables = kernels.offsets_as_tables(call.options.kernel_options)
    key = (call.layout, call.rank, kv_rank, window, *q.shape[:2], call.options.block_size,
           call.backend, call.backward, q.device, tables)  # fmt: skip
    per = _STEPS.setdefault(call.variant, {})
    if key not in per:
        # The chunk pairs decide (uncounted: block_masks given).
        if not pairs(call, q, kv_rank, block_masks=call.backend, window=window):
            per[key] = None
            return None
        q_pos = call.layout.positions(call.rank, q.device)
        kv_pos = call.layout.positions(kv_rank, q.device)[window[0] : sum(window)]
        name = f"{call.variant.name}@{call.layout.name}.rank{call.rank}.step{kv_rank}"
        per[key] = positioned(call, q_pos, kv_pos, name)
    return per[key]


def rows_read(call: CPCall, q: torch.Tensor, q_rank: int, kv_rank: int) -> tuple[int, int] | None:
    """[lo, hi): the local rows of kv_rank's shard that q_rank's queries read (the hull of
    `runs_read`, a superset of the exact rows), or None when they read none."""
    runs = runs_read(call, q, q_rank, kv_rank)
    return (runs[0][0], runs[-1][1]) if runs else None


def runs_read(
    call: CPCall, q: torch.Tensor, q_rank: int, kv_rank: int
) -> tuple[tuple[int, int], ...]:
    """The runs [a, b) of kv_rank's local rows that q_rank's queries read, in order and merged:
    the whole kv blocks some query block keeps (partial or full) in the pairs' block masks,
    read from their block indices (no dense copy: the all-gather asks this of P² rank pairs)."""
    runs: list[tuple[int, int]] = []
    kv_start = 0
    for kc in call.chunks(kv_rank):
        used = None
        for qc in call.chunks(q_rank):
            skip, block_mask = _call_plan(call, q, qc, kc, "flex")
            if skip:
                continue
            block = block_mask.BLOCK_SIZE[1]
            kept = _kv_blocks_kept(block_mask, -(-kc[1] // block))
            used = kept if used is None else used | kept
        if used is not None:
            for a, b in _true_runs(used.cpu()):
                a, b = kv_start + a * block, kv_start + min(b * block, kc[1])
                if runs and runs[-1][1] == a:
                    a = runs.pop()[0]
                runs.append((a, b))
        kv_start += kc[1]
    return tuple(runs)


def _kv_blocks_kept(block_mask, num_kv_blocks: int) -> torch.Tensor:
    """(num_kv_blocks,) bool: the kv blocks some query block keeps (partial or full)."""
    kept = None
    for num, idx in (
        (block_mask.kv_num_blocks, block_mask.kv_indices),
        (block_mask.full_kv_num_blocks, block_mask.full_kv_indices),
    ):
        if num is None:
            continue
        listed = idx[torch.arange(idx.shape[-1], device=idx.device) < num.unsqueeze(-1)]
        here = torch.zeros(num_kv_blocks, dtype=torch.bool, device=idx.device)
        here[listed.long()] = True
        kept = here if kept is None else kept | here
    return kept


def _true_runs(flags: torch.Tensor) -> list[tuple[int, int]]:
    """[a, b) runs of True in a 1-D bool tensor."""
    edges = torch.diff(flags.to(torch.int8), prepend=flags.new_zeros(1, dtype=torch.int8),
                       append=flags.new_zeros(1, dtype=torch.int8))  # fmt: skip
    starts, stops = (edges == 1).nonzero()[:, 0].tolist(), (edges == -1).nonzero()[:, 0].tolist()
    return list(zip(starts, stops, strict=True))


def _call_plan(call: CPCall, q: torch.Tensor, qc, kc, backend: str):
    """_pair_plan for one chunk pair of this call (q gives batch, heads and device)."""
    return _pair_plan(
        call.variant, q.shape[0], q.shape[1], qc, kc, call.options.block_size, backend, q.device,
        call.plans,
    )  # fmt: skip


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


# Pieces of one sum held before they are added. A step's partial (or gradient piece) is kept as
# the kernel returned it, and up to HELD of them are added in one pass that reads each once and
# writes the sum once (Accumulator, GradSum). Added as each came, every piece cost a read and a
# write of the float32 sum, the largest cost of a ring step's own after its kernel. With 8, a
# ring of 8 ranks sums its steps in one pass. Memory: at most 8 pieces of a sum are held (the
# first may be the float32 sum of earlier ones).
HELD = 8


class Accumulator:
    """The lse merge of the partials (out, lse) of this rank's q chunks, one entry per chunk.

    Partials are held as the kernels returned them and merged in one pass (merge.merged_weights
    and merge.weighted_sum, compiled when `fused`: CUDA, compiled calls): at `result` straight
    into q's dtype, or, when a chunk holds HELD and one more comes, into one float32 (float64)
    partial that takes their place. A chunk that meets a single pair (every chunk at world size
    1, a local mask's far chunks) gets its partial back unchanged: nothing allocated or merged.
    """

    def __init__(self, q: torch.Tensor, dv: int, *, fused: bool = False):
        self.dtype, self.device = q.dtype, q.device
        self.acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        self.shape = (*q.shape[:3], dv)
        self._weights, self._sum = compiled_sums() if fused else (merged_weights, weighted_sum)
        self._chunks: dict[tuple[int, int], list] = {}  # (start, stop) -> [(out, lse), ...]

    @classmethod
    def of(cls, call: CPCall, q: torch.Tensor, dv: int) -> Accumulator:
        """The accumulator of a call: fused where the call compiles its kernels on CUDA."""
        return cls(q, dv, fused=call.options.compile and q.device.type == "cuda")

    def add(self, rows: slice, out_i: torch.Tensor, lse_i: torch.Tensor) -> None:
        """Hold one pair's partial over q rows `rows` (a chunk of the shard); out_i and lse_i
        are the kernel's own new tensors."""
        held = self._chunks.setdefault((rows.start, rows.stop), [])
        if len(held) == HELD:
            held[:] = [self._merged(held, self.acc_dtype)]
        held.append((out_i, lse_i))

    def fork(self) -> Accumulator:
        """A copy holding the same partials (shared, never written): the simulation times one
        step's add from the state the steps before it leave."""
        twin = copy.copy(self)
        twin._chunks = {key: list(held) for key, held in self._chunks.items()}
        return twin

    def held(self) -> tuple[tuple[int, int, int], ...]:
        """(start, stop, partials held) of each chunk: what the next add or result costs."""
        return tuple((a, b, len(held)) for (a, b), held in sorted(self._chunks.items()))

    def _merged(self, held: list, dtype: torch.dtype):
        """(out in `dtype`, lse) of the partials `held`."""
        if len(held) == 1:
            out, lse = held[0]
            return _to(self._sum, out, dtype), lse.to(self.acc_dtype)
        lse, ws = self._weights([lse.to(self.acc_dtype) for _, lse in held])
        return self._sum([out for out, _ in held], ws, self.acc_dtype, dtype), lse

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(out in q's dtype, lse in the accumulator dtype) over the whole shard; rows no pair
        reached are out = 0, lse = -inf. Consumes the accumulator."""
        n = self.shape[2]
        chunks, self._chunks = self._chunks, {}  # consumed: each chunk let go once written
        if list(chunks) == [(0, n)]:
            return self._merged(chunks.pop((0, n)), self.dtype)
        out = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        lse = torch.empty(self.shape[:3], dtype=self.acc_dtype, device=self.device)
        covered = 0
        for start, stop in sorted(chunks):
            if start > covered:
                _no_key(out, lse, covered, start)
            out_c, lse_c = self._merged(chunks.pop((start, stop)), self.dtype)
            out[:, :, start:stop].copy_(out_c)
            lse[:, :, start:stop].copy_(lse_c)
            del out_c, lse_c
            covered = stop
        if covered < n:
            _no_key(out, lse, covered, n)
        return out, lse


def _no_key(out: torch.Tensor, lse: torch.Tensor, start: int, stop: int) -> None:
    out[:, :, start:stop].zero_()
    lse[:, :, start:stop].fill_(float("-inf"))


@dataclasses.dataclass
class _Rows:
    """One row range of a GradSum: the pieces over it, held until they are added."""

    start: int
    stop: int
    pieces: list[torch.Tensor]  # each (..., stop - start, D), ours to write; [0] may be a sum
    root: torch.Tensor | None  # pieces[0] is rows start.. of this whole kernel output

    def narrow(self, start: int, stop: int) -> _Rows:
        pieces = [p.narrow(-2, start - self.start, stop - start) for p in self.pieces]
        return _Rows(start, stop, pieces, self.root)


class GradSum:
    """The sum of gradient pieces over the rows of one (..., n, D) tensor, built as they come.

    A rank's dq, and each shard's dK/dV, get one piece per chunk pair: often a single one (every
    piece at world size 1), often over a band of the rows (a halo). A zero-filled float32
    accumulator of full size, added into and cast back, costs about as much as the kernel on a
    thin band, so instead each row range holds its pieces as the kernels returned them, and
    adds them in one pass in `sum_dtype` (float32, float64 for float64 inputs; in order, so the
    totals are those of that accumulator): at `total` straight into the result's dtype, or into
    one sum_dtype piece when HELD are held and one more comes. Ranges never overlap: a piece
    that cuts a range splits it (views, no copy). `total` writes each range once into the
    result: in place into a kernel output that covers every row when there is one, and hands a
    single whole piece back unchanged.

    Pieces marked fresh are a kernel's own new outputs, which the sum may keep and write into;
    others (a channel's receive slot, valid until released) are added at once and never kept.
    `fused` (CUDA, compiled calls): the sums run compiled (merge.compiled_sums).
    """

    def __init__(self, shape, sum_dtype: torch.dtype, device, fused: bool = False):
        self.shape = tuple(shape)
        self.sum_dtype, self.device = sum_dtype, device
        self._sum = compiled_sums()[1] if fused else weighted_sum
        self._ranges: list[_Rows] = []  # disjoint, by start

    @classmethod
    def of(cls, call: CPCall, shape, sum_dtype: torch.dtype, device) -> GradSum:
        """The sum of a call's gradient: fused where the call compiles its kernels on CUDA."""
        fused = call.options.compile and torch.device(device).type == "cuda"
        return cls(shape, sum_dtype, device, fused=fused)

    def add(
        self, start: int, piece: torch.Tensor, *, fresh: bool = True, last: bool = False
    ) -> None:
        """Add `piece` (..., m, D) into rows [start, start + m).

        last: no piece follows over these rows, and `total` will be asked for in the dtype of
            the kernel outputs kept there: those take the sum rounded to their dtype at once
            (what total would write), with no sum_dtype copy of the rows held.
        """
        stop = start + piece.shape[-2]
        assert 0 <= start <= stop <= self.shape[-2], (start, stop, self.shape)
        self._split(start)
        self._split(stop)
        kept, pos = [], start
        for r in self._ranges:
            if r.stop <= start or r.start >= stop:
                continue
            if r.start > pos:
                kept.append(self._new(pos, r.start, piece, start, fresh))
            self._plus(r, piece.narrow(-2, r.start - start, r.stop - r.start), fresh, last)
            pos = r.stop
        if pos < stop:
            kept.append(self._new(pos, stop, piece, start, fresh))
        if kept:
            self._ranges = sorted(self._ranges + kept, key=lambda r: r.start)

    def fork(self) -> GradSum:
        """A copy holding the same pieces (shared): the simulation times one step's pieces
        from the state the steps before it leave."""
        twin = copy.copy(self)
        twin._ranges = [dataclasses.replace(r, pieces=list(r.pieces)) for r in self._ranges]
        return twin

    def held(self) -> tuple[tuple[int, int, int], ...]:
        """(start, stop, pieces held) of each row range: what the next add or total costs."""
        return tuple((r.start, r.stop, len(r.pieces)) for r in self._ranges)

    def _split(self, at: int) -> None:
        for j, r in enumerate(self._ranges):
            if r.start < at < r.stop:
                self._ranges[j : j + 1] = [r.narrow(r.start, at), r.narrow(at, r.stop)]
                return

    def _new(self, a: int, b: int, piece: torch.Tensor, start: int, fresh: bool) -> _Rows:
        value = piece if b - a == piece.shape[-2] else piece.narrow(-2, a - start, b - a)
        if not fresh:  # not ours to keep: a copy, in the sum dtype
            return _Rows(a, b, [value.to(self.sum_dtype, copy=True)], None)
        whole = start == 0 and tuple(piece.shape) == self.shape
        return _Rows(a, b, [value], piece if whole else None)

    def _plus(self, r: _Rows, piece: torch.Tensor, fresh: bool, last: bool) -> None:
        if last:  # the exact sum, rounded once, into the rows kept
            first = r.pieces[0]
            self._sum([*r.pieces, piece], None, self.sum_dtype, first.dtype, first)
            r.pieces = [first]
        elif fresh:  # held, added with the others later
            if len(r.pieces) == HELD:
                r.pieces, r.root = [self._sum(r.pieces, None, self.sum_dtype, self.sum_dtype)], None
            r.pieces.append(piece)
        else:  # read now: the slot it lies in is released after this
            pieces = [*r.pieces, piece]
            r.pieces, r.root = [self._sum(pieces, None, self.sum_dtype, self.sum_dtype)], None

    def total(self, dtype: torch.dtype) -> torch.Tensor:
        """The sum over every row in `dtype` (0 on rows no piece reached). It consumes the sum:
        each range is let go once written, so its pieces do not outlive it."""
        n = self.shape[-2]
        ranges, self._ranges = self._ranges, []
        if len(ranges) == 1 and (ranges[0].start, ranges[0].stop) == (0, n):
            pieces = ranges.pop().pieces
            if len(pieces) == 1:
                return _to(self._sum, pieces[0], dtype)
            return self._sum(pieces, None, self.sum_dtype, dtype)
        roots = [r.root for r in ranges if r.root is not None and r.root.dtype == dtype]
        out = roots[0] if roots else torch.empty(self.shape, dtype=dtype, device=self.device)
        del roots
        covered = 0
        while ranges:
            r = ranges.pop(0)
            if r.start > covered:
                out.narrow(-2, covered, r.start - covered).zero_()
            if r.root is not out or len(r.pieces) > 1:  # else already in place
                # Summed apart, then copied: `out` may be a kernel output these pieces view,
                # and a compiled call given two views of one storage (the output rows and a
                # piece) raises in Inductor's CPU code.
                summed = r.pieces[0] if len(r.pieces) == 1 else self._sum(
                    r.pieces, None, self.sum_dtype, dtype
                )  # fmt: skip
                out.narrow(-2, r.start, r.stop - r.start).copy_(summed)
                del summed
            covered = r.stop
            del r
        if covered < n:
            out.narrow(-2, covered, n - covered).zero_()
        return out


def _to(sum_fn, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in `dtype` through `sum_fn` (merge.weighted_sum, eager or compiled), x itself when it
    is already."""
    return x if x.dtype == dtype else sum_fn([x], None, dtype, dtype)


def forward_pairs(call: CPCall, acc: Accumulator, q, k, v, kv_rank: int, window=None) -> None:
    """Attend this rank's q chunks to kv_rank's K/V (its shard, or the `window` of it held): one
    call over the whole shard where it has several chunks (step_call), else per chunk pair."""
    if one_call_steps(call):
        if call.stats is not None:
            pairs(call, q, kv_rank, window=window)  # counted, as the pairs the call covers
        step = step_call(call, q, kv_rank, window)
        if step is not None:
            out_i, lse_i = attend(call, q, k, v, 0, 0, step.block_mask, variant=step.variant)
            acc.add(slice(0, q.shape[2]), out_i, lse_i)
        return
    for q_rows, kv_rows, qc, kc, block_mask in pairs(call, q, kv_rank, window=window):
        out_i, lse_i = attend(
            call, q[:, :, q_rows], k[:, :, kv_rows], v[:, :, kv_rows], qc[0], kc[0], block_mask
        )
        acc.add(q_rows, out_i, lse_i)


@dataclasses.dataclass(frozen=True)
class Saved:
    """What a rank's backward needs of its forward: its q shard and the merged results.

    q, out, dout: (B, H, S/P, D) in the input dtype; lse: (B, H, S/P) merged, natural base, in the
    accumulator dtype (float32, float64 for float64 inputs); lse2: per q chunk (start, stop) of
    rows, the same in the base flex's backward op reads (flex_backward.kernel_lse), converted
    once per backward, not per pair (None: each pair converts its own).
    """

    q: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    dout: torch.Tensor
    lse2: Mapping[tuple[int, int], torch.Tensor] | None = None


def backward_pairs(
    call: CPCall,
    saved: Saved,
    k,
    v,
    kv_rank: int,
    dq: GradSum,
    dk: GradSum,
    dv: GradSum,
    *,
    window: tuple[int, int] | None = None,
    dkv_offset: int = 0,
) -> None:
    """Add the gradients of the pairs against kv_rank's shard: dq into `dq`, dK/dV into `dk`, `dv`.

    Args:
        saved: this rank's forward (Saved).
        k, v: kv_rank's shard (B, G, S/P, D), or the `window` of it held.
        dq: the GradSum of this rank's dq, (B, H, S/P, D).
        dk, dv: the GradSums of kv_rank's dK, dV, (B, G, rows, D): kv row j of the held K/V
            lands at row j + dkv_offset.
        window: the rows of kv_rank's shard held (see `pairs`).
    """
    from attngym.distributed import flex_backward

    flex = call.backward == "flex"
    if one_call_steps(call):
        step = step_call(call, saved.q, kv_rank, window)
        if step is not None:
            _step_backward(call, saved, k, v, step, dq, dk, dv, dkv_offset)
        return
    masks = "flex" if flex else call.backend
    for pair in pairs(call, saved.q, kv_rank, block_masks=masks, window=window):
        # Cut to what the mask reads: a halo pair's pieces cover its band, not the whole chunk.
        q_rows, kv_rows, qc, kc, block_mask = read_part(call, saved.q, pair, masks)
        k_i, v_i = k[:, :, kv_rows], v[:, :, kv_rows]
        grads = None
        if flex:
            grads = flex_backward.pair_grads(call, saved, q_rows, k_i, v_i, qc, kc, block_mask)
        if grads is None:  # recompute, or flex failed under backward=auto (logged)
            grads = recompute_pair(call, saved, q_rows, k_i, v_i, qc, kc, block_mask)
        dq_i, dk_i, dv_i = grads
        dq.add(q_rows.start, dq_i)
        dk.add(kv_rows.start + dkv_offset, dk_i)
        dv.add(kv_rows.start + dkv_offset, dv_i)


def _step_backward(call: CPCall, saved: Saved, k, v, step: PositionedCall, dq, dk, dv, dkv_offset):
    """A step call's gradients added into dq (the whole shard) and dk, dv (held rows at
    `dkv_offset`): flex's backward op at the step's positions, or its forward re-run."""
    from attngym.distributed import flex_backward

    whole = slice(0, saved.q.shape[2])
    grads = None
    if call.backward == "flex":
        maps = step.maps
        grads = flex_backward.grads(
            call, saved.q, k, v, saved.out, saved.lse, saved.dout, step.block_mask,
            q_offset=maps.q_offset, kv_offset=maps.kv_offset,
            lse2=None if saved.lse2 is None else saved.lse2.get((0, whole.stop)),
            q_positions=maps.q_positions, kv_positions=maps.kv_positions,
        )  # fmt: skip
    if grads is None:  # recompute, or flex failed under backward=auto (logged)
        grads = recompute_pair(
            call, saved, whole, k, v, (0, 0), (0, 0), step.block_mask, variant=step.variant
        )
    dq_i, dk_i, dv_i = grads
    dq.add(0, dq_i)
    dk.add(dkv_offset, dk_i)
    dv.add(dkv_offset, dv_i)


def recompute_pair(call: CPCall, saved: Saved, q_rows, k_i, v_i, qc, kc, block_mask, variant=None):
    """One pair's (dq, dk, dv): its forward again under autograd, weighted by exp(lse_i - lse);
    `variant`: a PositionedCall's, at its positions (qc, kc at 0)."""
    lse = saved.lse[:, :, q_rows]
    out = saved.out[:, :, q_rows].to(lse.dtype)
    dout = saved.dout[:, :, q_rows].to(lse.dtype)
    with torch.enable_grad():
        q_i = saved.q[:, :, q_rows].detach().requires_grad_()
        k_i = k_i.detach().requires_grad_()
        v_i = v_i.detach().requires_grad_()
        out_i, lse_i = attend(call, q_i, k_i, v_i, qc[0], kc[0], block_mask, variant=variant)
        w = weights(lse_i.detach().to(lse.dtype), lse)
        g_out = (w.unsqueeze(-1) * dout).to(out_i.dtype)
        g_lse = w * (dout * (out_i.detach().to(lse.dtype) - out)).sum(-1)
        return torch.autograd.grad([out_i, lse_i], [q_i, k_i, v_i], [g_out, g_lse.to(lse_i.dtype)])


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
