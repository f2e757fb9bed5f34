"""Timing and FLOP accounting: the one timer and the one FLOP formula of the project.

Every TFLOP/s number attngym reports goes through `attention_flops` and `tflops`, so runs, sweeps
and baselines are comparable; every time it reports comes from `time_fn` (one callable) or
`time_together` (several, in interleaved rounds), which synchronise CUDA around their events (like
gpt-fast) and keep warm-up calls out of the numbers. Given a budget they time as many calls as fill
it, as triton's do_bench does, rather than a fixed count; `ratio_ci95` gives the 95 % interval of
a ratio of two such timings. The seed's helpers (`calculate_tflops`,
`benchmark_cuda_function_in_microseconds`) are thin wrappers over these.

FLOP convention (FlashAttention's): the forward pass is two matmuls of 2·Sq·Skv·D FLOPs per head,
4·B·H·Sq·Skv·D in all, scaled by the fraction of blocks computed (1 − sparsity); the backward pass
counts 2.5 × the forward (five matmuls instead of two). Softmax and score_mod work is not counted.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

PASS_FACTORS = {"fwd": 1.0, "bwd": 2.5}  # multiples of the forward FLOPs


def attention_flops(
    batch: int,
    heads: int,
    seq_q: int,
    seq_kv: int,
    head_dim: int,
    *,
    sparsity: float = 0.0,
    passes: Iterable[str] = ("fwd",),
) -> float:
    """FLOPs of attention over the given passes.

    Args:
        batch, heads, seq_q, seq_kv, head_dim: problem size (B, H, Sq, Skv, D).
        sparsity: fraction of (q block, kv block) pairs skipped, in [0, 1].
        passes: any of "fwd", "bwd"; ("fwd", "bwd") counts 3.5 × the forward.

    Returns:
        4·B·H·Sq·Skv·D·(1 − sparsity) × (sum of the pass factors).
    """
    if not 0.0 <= sparsity <= 1.0:
        raise ValueError(f"sparsity must be in [0, 1], got {sparsity!r}")
    passes = (passes,) if isinstance(passes, str) else tuple(passes)
    for p in passes:
        if p not in PASS_FACTORS:
            raise ValueError(f"passes must contain only {', '.join(PASS_FACTORS)}; got {p!r}")
    sizes = [
        _count(name, value)
        for name, value in (
            ("batch", batch),
            ("heads", heads),
            ("seq_q", seq_q),
            ("seq_kv", seq_kv),
            ("head_dim", head_dim),
        )
    ]
    fwd = 4.0 * math.prod(sizes) * (1.0 - sparsity)
    return fwd * sum(PASS_FACTORS[p] for p in passes)


def _count(name: str, value: Any) -> int:
    """A non-negative integer: a Python int or anything that is one (numpy and torch integer
    scalars, as attention-gym's `calculate_tflops` takes them); bools and floats refused."""
    try:
        count = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        count = None
    if count is None or count < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return count


def tflops(flops: float, time_ms: float) -> float:
    """Achieved TFLOP/s of `flops` done in `time_ms` milliseconds."""
    if not time_ms > 0:
        raise ValueError(f"time_ms must be a positive number, got {time_ms!r}")
    return flops / (time_ms * 1e-3) / 1e12


def peak_fraction(flops: float, time_ms: float, peak_tflops: float | None) -> float | None:
    """The share of the device's peak that `flops` in `time_ms` reach (None without a peak)."""
    return None if not peak_tflops else tflops(flops, time_ms) / peak_tflops


def calculate_tflops(
    batch: int,
    heads: int,
    seq_q: int,
    seq_kv: int,
    head_dim: int,
    time_ms: float,
    sparsity: float = 0.0,
) -> float:
    """TFLOP/s of an attention forward pass that took `time_ms` (the seed's helper)."""
    flops = attention_flops(batch, heads, seq_q, seq_kv, head_dim, sparsity=sparsity)
    return tflops(flops, time_ms)


def block_sparsity(block_mask: Any) -> float:
    """Fraction of (q block, kv block) pairs a FlexAttention BlockMask skips (0.0 for None).

    Counted over every batch and head the mask has: 1 − (partial + full blocks) / all blocks.
    """
    if block_mask is None:
        return 0.0
    computed = int(block_mask.kv_num_blocks.sum())
    if block_mask.full_kv_num_blocks is not None:
        computed += int(block_mask.full_kv_num_blocks.sum())
    kv_blocks = math.ceil(block_mask.seq_lengths[1] / block_mask.BLOCK_SIZE[1])
    total = block_mask.kv_num_blocks.numel() * kv_blocks
    return 1.0 - computed / total if total else 0.0


# Entries (over every batch and head) mask_density evaluates at most; past it, every k-th row of
# blocks (partial blocks only: full ones are counted exactly whatever the size).
DENSITY_BUDGET = 1 << 32


def mask_density(
    mask_mod: Any, block_mask: Any, batch: int, heads: int, *, budget: int = DENSITY_BUDGET
) -> tuple[float, float]:
    """(density, rows): the fraction of the (q, kv) entries, over every batch and head, that the
    mask keeps, the FLOPs the mask needs (attention_flops with sparsity = 1 − density), as the
    kernel sees it: a full block of `block_mask` counts whole, a partial block's entries are
    evaluated (mask_mod at every batch and head, one row of blocks at a time), a skipped block
    keeps nothing. `rows`: the share of the rows of blocks whose partial blocks were evaluated,
    1.0 (exact) unless they hold more than `budget` entries, when every k-th row is and the
    others are taken to keep the same share. (1.0, 1.0) without a mask."""
    if mask_mod is None or block_mask is None:
        return 1.0, 1.0
    sq, skv = block_mask.seq_lengths
    bq, bkv = block_mask.BLOCK_SIZE
    num, idx = block_mask.kv_num_blocks.cpu(), block_mask.kv_indices.cpu()
    full_num = (
        None if block_mask.full_kv_num_blocks is None else block_mask.full_kv_num_blocks.cpu()
    )
    full_idx = None if full_num is None else block_mask.full_kv_indices.cpu()
    device = block_mask.kv_num_blocks.device
    rows_of = [min(bq, sq - i * bq) for i in range(num.shape[2])]
    planes = _planes(num.shape, batch, heads)
    full = 0
    if full_num is not None:  # counted exactly: each full block's area, cut at the sequence's end
        listed = torch.arange(full_idx.shape[-1]) < full_num.unsqueeze(-1)
        widths = (skv - full_idx.long() * bkv).clamp(max=bkv) * listed
        full = int((widths * torch.tensor(rows_of).view(1, 1, -1, 1)).sum()) * planes
    partial_entries = int((num.sum((0, 1)) * torch.tensor(rows_of)).sum()) * bkv * planes
    step = max(1, -(-partial_entries // budget))
    kept = torch.zeros((), dtype=torch.float64, device=device)
    for mb in range(num.shape[0]):  # the block mask's own batch and heads (1 when broadcast)
        bs = torch.arange(batch, device=device) if num.shape[0] == 1 else torch.tensor([mb])
        for mh in range(num.shape[1]):
            hs = torch.arange(heads, device=device) if num.shape[1] == 1 else torch.tensor([mh])
            b4, h4 = bs.to(device).view(-1, 1, 1, 1), hs.to(device).view(1, -1, 1, 1)
            for i in range(0, num.shape[2], step):
                blocks = idx[mb, mh, i, : int(num[mb, mh, i])]
                if not blocks.numel():
                    continue
                q_pos = torch.arange(i * bq, i * bq + rows_of[i], device=device)
                kv_pos = (blocks.view(-1, 1) * bkv + torch.arange(bkv)).view(-1)
                kv_pos = kv_pos[kv_pos < skv].to(device)
                keep = mask_mod(b4, h4, q_pos.view(1, 1, -1, 1), kv_pos.view(1, 1, 1, -1))
                shape = (b4.shape[0], h4.shape[1], q_pos.numel(), kv_pos.numel())
                kept += torch.broadcast_to(keep, shape).sum()
    evaluated = len(range(0, num.shape[2], step)) / num.shape[2]
    return (full + float(kept) / evaluated) / (batch * heads * sq * skv), evaluated


def _planes(shape: torch.Size, batch: int, heads: int) -> int:
    """The (batch, head) planes one (b, h) of a block mask stands for (all of them where the
    mask broadcasts over that dimension)."""
    return (batch if shape[0] == 1 else 1) * (heads if shape[1] == 1 else 1)


@dataclasses.dataclass(frozen=True)
class Timing:
    """Wall times of the timed calls, in milliseconds."""

    median_ms: float
    min_ms: float
    max_ms: float
    repeats: int
    all_ms: list[float]

    @classmethod
    def from_times(cls, all_ms: list[float]) -> Timing:
        """Summarise a list of per-call times (ms)."""
        return cls(
            median_ms=statistics.median(all_ms),
            min_ms=min(all_ms),
            max_ms=max(all_ms),
            repeats=len(all_ms),
            all_ms=list(all_ms),
        )


# Larger than any current L2 (H100/H200: 50/60 MB, B200: 126 MB).
L2_FLUSH_BYTES = 256 * 2**20
_L2_FLUSH: dict[torch.device, torch.Tensor] = {}


def l2_flush_buffer(device: str | torch.device) -> torch.Tensor:
    """The CUDA device's L2-flush buffer (L2_FLUSH_BYTES of int8), allocated once per device.

    Kept for the process's life, so timing does not allocate: a caller that measures peak memory
    calls this before resetting the peak, and the buffer is not counted in it.
    """
    dev = torch.device(device)
    if dev.index is None:
        dev = torch.device(dev.type, torch.cuda.current_device())
    if dev not in _L2_FLUSH:
        _L2_FLUSH[dev] = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device=dev)
    return _L2_FLUSH[dev]


# The most timed calls a budget gives one callable (do_bench's budget of a 3 µs kernel would
# be 30,000 calls; 1,000 already pin its median).
MAX_REPEATS = 1000
# The fewest timed calls of each side a ratio's interval is drawn from; below, it has none.
MIN_CI_REPEATS = 5
# Resamples of ratio_ci95's bootstrap, and its seed (the same samples give the same interval).
CI_RESAMPLES = 2000
CI_SEED = 0


def budget_repeats(
    call_ms: float, budget_ms: float | None, minimum: int, *, cap: int = MAX_REPEATS
) -> int:
    """How many timed calls of `call_ms` each fill `budget_ms`, as triton's do_bench sizes its
    repeats: at least `minimum`, else at most `cap`; exactly `minimum` without a budget (None
    or 0)."""
    if not budget_ms:
        return minimum
    fill = math.floor(budget_ms / max(call_ms, 1e-6))
    return max(minimum, min(cap, fill))


def time_fn(
    fn: Callable[[], Any],
    *,
    warmup: int = 2,
    repeats: int = 5,
    budget_ms: float | None = None,
    device: str | torch.device | None = None,
    progress: str | None = None,
    setup: Callable[[], Any] | None = None,
    agree: Callable[[int], int] | None = None,
) -> Timing:
    """Time `fn()` per call: `warmup` untimed calls, then `repeats` timed ones, or with a
    budget as many as fill it.

    On CUDA each call is bracketed by CUDA events, the device synchronised before the first and
    after the last, so the times are GPU execution times; before each timed call the L2 cache is
    flushed (a write of a buffer larger than L2, outside the events, as triton's do_bench does),
    so small inputs are not timed out of a warm cache. On the CPU each call is timed with
    `time.perf_counter`.

    Args:
        fn: the work to time, called with no arguments.
        warmup: untimed calls first (compilation, caches, allocator).
        repeats: timed calls, at least 1; with a budget, the least number of them.
        budget_ms: as triton's do_bench: the last warm-up call is timed on the host (setup
            included, the device synchronised), and the timed calls are as many as fill this
            many milliseconds at that pace (budget_repeats: at least `repeats`, at most
            MAX_REPEATS). With a budget and no warm-up, one untimed call sizes the count. None
            or 0: exactly `repeats`.
        device: where fn's work runs; None means CUDA when available, else CPU.
        progress: a label to show a progress bar over the repeats (see attngym.progress).
        setup: when given, called before every call outside the timed region, and `fn` is called
            with its result: e.g. a forward pass whose graph a timed backward consumes (compiled
            backwards free their buffers, so a graph cannot be replayed with retain_graph).
        agree: makes the count one that every rank shares (the ranks' largest, a collective
            where the calls are): ranks whose calls are collectives must make as many.

    Returns:
        Timing with the median, min, max and every per-call time in milliseconds.
    """
    dev = _timing_device(device, warmup, repeats)
    call_ms = _warm(fn, setup, warmup, dev, sized=bool(budget_ms))
    count = budget_repeats(call_ms, budget_ms, repeats)
    if agree is not None:
        count = agree(count)
    steps: Iterable[int] = range(count)
    if progress is not None:
        from attngym.progress import progress as bar

        steps = bar(steps, total=count, label=progress)
    with _Clock(dev) as clock:
        for _ in steps:
            clock.call(fn, setup)
    return Timing.from_times(clock.times)


def time_together(
    calls: dict[str, tuple[Callable[..., Any], Callable[[], Any] | None]],
    *,
    warmup: int = 2,
    repeats: int = 5,
    budget_ms: float | None = None,
    device: str | torch.device | None = None,
    progress: str | None = None,
    failures: dict[str, str] | None = None,
) -> dict[str, Timing]:
    """Time several callables in one pass: each warmed up (and sized) as time_fn does, then
    rounds of one timed call of each in turn, so a drift of the clock or of the machine's load
    falls on all of them alike, and no callable waits for the others' separate warm-ups.

    Args:
        calls: {name: (fn, setup)}, each as time_fn's `fn` and `setup`.
        warmup, repeats, device: as time_fn's, for every callable.
        progress: a label to show a progress bar over the rounds (see attngym.progress).
        budget_ms: each callable's budget, as time_fn's: the rounds fill len(calls) budgets at
            the callables' summed pace (at least `repeats` rounds, at most MAX_REPEATS).
        failures: a callable whose warm-up raises RuntimeError (a backend with no kernel for
            these inputs) is left out and its reason stored under its name; None: it raises.

    Returns:
        {name: Timing} of the callables timed, each over the same number of calls.
    """
    dev = _timing_device(device, warmup, repeats)
    pace: dict[str, float] = {}
    for name, (fn, setup) in calls.items():
        try:
            pace[name] = _warm(fn, setup, warmup, dev, sized=bool(budget_ms))
        except RuntimeError as exc:
            if failures is None:
                raise
            failures[name] = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
    if not pace:
        return {}
    budget = budget_ms * len(pace) if budget_ms else None
    rounds = budget_repeats(sum(pace.values()), budget, repeats)
    steps: Iterable[int] = range(rounds)
    if progress is not None:
        from attngym.progress import progress as bar

        steps = bar(steps, total=rounds, label=progress)
    with _Clock(dev) as clock:
        for _ in steps:
            for name in pace:
                clock.call(*calls[name])
    every = len(pace)
    return {name: Timing.from_times(clock.times[i::every]) for i, name in enumerate(pace)}


def ratio_ci95(over_ms: list[float], under_ms: list[float]) -> tuple[float, float] | None:
    """A 95 % interval of median(over_ms) / median(under_ms), from the timed calls of both.

    A percentile bootstrap over the two samples apart (their calls are not paired): each of
    CI_RESAMPLES draws resamples both with replacement, each side with its own fixed seed
    (CI_SEED over, CI_SEED + 1 under), and takes the ratio of the two medians; the interval is
    the 2.5th and 97.5th percentiles of those ratios. None when either side has fewer than
    MIN_CI_REPEATS calls: too few to tell.
    """
    if min(len(over_ms), len(under_ms)) < MIN_CI_REPEATS:
        return None
    over = _resampled_medians(tuple(over_ms), CI_SEED)
    ratios = over / _resampled_medians(tuple(under_ms), CI_SEED + 1)
    lo, hi = torch.quantile(ratios, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return lo, hi


@functools.lru_cache(maxsize=64)
def _resampled_medians(sample: tuple[float, ...], seed: int) -> torch.Tensor:
    """The medians of CI_RESAMPLES resamples of `sample` (drawn with `seed`; not to be written).

    Kept per sample: a run's flex timing is the under side of every contender's ratio, and a
    contender's the over side of its ratio and of the best contender's. Each resample's
    quantile(0.5) is found from its middle two order statistics, by counting its picks by their
    rank, not by sorting CI_RESAMPLES rows (4x slower at the 1,000 calls a budget gives a small
    kernel).
    """
    n = len(sample)
    gen = torch.Generator().manual_seed(seed)
    values, order = torch.tensor(sample, dtype=torch.float64).sort(stable=True)
    rank = torch.empty(n, dtype=torch.long)
    rank[order] = torch.arange(n)
    picks = rank[torch.randint(n, (CI_RESAMPLES, n), generator=gen)]
    ones = torch.ones(CI_RESAMPLES, n, dtype=torch.int32)
    seen = torch.zeros_like(ones).scatter_add_(1, picks, ones).cumsum_(1)
    middle = torch.tensor([[(n - 1) // 2, n // 2]], dtype=torch.int32).repeat(CI_RESAMPLES, 1)
    low, high = values[torch.searchsorted(seen, middle, right=True)].unbind(1)
    return low + (high - low) * 0.5


def _timing_device(device: str | torch.device | None, warmup: int, repeats: int) -> torch.device:
    """The device timed on (None: CUDA when available, else CPU), the counts checked."""
    from attngym.device import resolve_device

    for name, value, low in (("warmup", warmup, 0), ("repeats", repeats, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if device is None:  # not "auto": no log line per timing
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return resolve_device(device)


def _warm(fn, setup, warmup: int, dev: torch.device, *, sized: bool) -> float:
    """`warmup` untimed calls (one at least when `sized`); when `sized`, the last one's wall ms
    as a timed call costs it: setup and, on CUDA, the L2 flush before it included (a 256 MB
    write, more than a small call itself), the device synchronised around it; else 0."""
    from attngym.device import sync

    calls = max(warmup, 1) if sized else warmup
    for _ in range(calls - 1 if sized else calls):
        fn() if setup is None else fn(setup())
    if not sized:
        return 0.0
    sync(dev)
    start = time.perf_counter()
    if dev.type == "cuda":
        l2_flush_buffer(dev).zero_()
    fn() if setup is None else fn(setup())
    sync(dev)
    return (time.perf_counter() - start) * 1e3


class _Clock:
    """Times one call at a time on a device, `times` read once the block ends: on CUDA CUDA
    events around each call (the L2 flushed before it, the device synchronised before the
    first and after the last); on a CPU the host clock."""

    def __init__(self, dev: torch.device) -> None:
        self.dev = dev
        self.times: list[float] = []
        self._events: list[tuple[Any, Any]] = []

    def __enter__(self) -> _Clock:
        if self.dev.type == "cuda":
            self._device = torch.cuda.device(self.dev)
            self._device.__enter__()
            self._flush = l2_flush_buffer(self.dev)
            torch.cuda.synchronize()
        return self

    def call(self, fn: Callable[..., Any], setup: Callable[[], Any] | None) -> None:
        arg = None if setup is None else setup()
        if self.dev.type == "cuda":
            self._flush.zero_()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn() if setup is None else fn(arg)
            end.record()
            self._events.append((start, end))
        else:
            t0 = time.perf_counter()
            fn() if setup is None else fn(arg)
            self.times.append((time.perf_counter() - t0) * 1e3)

    def __exit__(self, *exc: Any) -> None:
        if self.dev.type == "cuda":
            try:
                torch.cuda.synchronize()
                self.times = [s.elapsed_time(e) for s, e in self._events]
            finally:
                self._device.__exit__(*exc)


@dataclasses.dataclass(frozen=True)
class StreamTiming:
    """A call's cost inside a stream of calls, in milliseconds (medians).

    gpu_ms: the device's time per call when the calls are queued back to back (the L2 flushed
        before each, as in time_fn); host_ms: the host's time to issue one call. A stream of calls
        runs at max(host_ms, gpu_ms) per call: the host issues ahead while the device is busier
        (on a CPU host_ms is 0: the work is the host's, timed in gpu_ms).
    """

    gpu_ms: float
    host_ms: float


# How long the spin holds the device while the host issues the one call that sizes the next.
PROBE_SPIN_MS = 50.0
MAX_SPIN_MS = 2000.0
# Clock cycles of the device's spin kernel per millisecond, measured once per device.
_SPIN_CYCLES_PER_MS: dict[torch.device, float] = {}


def _spin_cycles_per_ms(dev: torch.device) -> float:
    if dev not in _SPIN_CYCLES_PER_MS:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)  # warm
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        torch.cuda.synchronize()
        _SPIN_CYCLES_PER_MS[dev] = 10_000_000 / max(start.elapsed_time(end), 1e-3)
    return _SPIN_CYCLES_PER_MS[dev]


def stream_time(
    fn: Callable[[], Any],
    *,
    warmup: int = 2,
    repeats: int = 5,
    device: str | torch.device | None = None,
) -> StreamTiming:
    """Time `fn()` as one of a stream of calls: the device's time per call and the host's.

    On CUDA the device is first held busy by a spin kernel long enough for the host to issue all
    `repeats` calls, so each call's events bracket its device work alone, queued back to back
    (the L2 flushed before each, as time_fn does), and the host clock around each `fn()` is the
    host's issue time alone. time_fn instead times a call that the host may still be issuing:
    for a call whose host time nears its device time it measures neither. Where `fn`
    synchronises with the device the host clock waits for the spin, and host_ms is then the
    least host time seen (an upper bound).
    On a CPU the work is the host's: gpu_ms is its wall time and host_ms 0.
    """
    dev = _timing_device(device, warmup, repeats)
    if dev.type != "cuda":
        return StreamTiming(time_fn(fn, warmup=warmup, repeats=repeats, device=dev).median_ms, 0.0)
    for _ in range(warmup):
        fn()
    with torch.cuda.device(dev):
        flush = l2_flush_buffer(dev)
        _, (probe,) = _behind_spin(fn, flush, 1, PROBE_SPIN_MS, dev)  # one call's host time
        spin_ms = min(max(2.0, 3.0 * repeats * probe), MAX_SPIN_MS)
        gpu, host = _behind_spin(fn, flush, repeats, spin_ms, dev)
        if sum(host) >= 0.8 * spin_ms:  # fn waited for the device: no host time apart from it
            host = [min(probe, min(host))]
    return StreamTiming(statistics.median(gpu), statistics.median(host))


def _behind_spin(fn, flush, repeats: int, spin_ms: float, dev) -> tuple[list[float], list[float]]:
    """(device ms, host ms) per call of `repeats` calls issued while a spin holds the device."""
    torch.cuda.synchronize()
    torch.cuda._sleep(int(spin_ms * _spin_cycles_per_ms(dev)))
    events, host = [], []
    for _ in range(repeats):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in events], host


def graphed(fn: Callable[[], Any], device: str | torch.device) -> Callable[[], Any]:
    """`fn` captured once as a CUDA graph: the returned callable replays it and returns what the
    captured call returned (the same tensors, rewritten by each replay).

    Why: a call of many small kernels is bound by the host that issues them (stream_time's
    host_ms); a replay issues the whole call in one launch. `fn` must be capturable: its inputs
    at fixed addresses, no host synchronisation and no host state a replay would miss. It is
    called twice on a side stream first (compilation, plans, allocations), as PyTorch's own
    make_graphed_callables warms up; the graph's memory is freed with the returned callable.
    """
    from attngym.device import resolve_device

    dev = resolve_device(device)
    if dev.type != "cuda":
        raise ValueError(f"a CUDA graph needs a CUDA device, got {dev}")
    with torch.cuda.device(dev):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()

    def replay() -> Any:
        graph.replay()
        return out

    return replay


def benchmark_cuda_function_in_microseconds(func: Callable[..., Any], *args, **kwargs) -> float:
    """Median time of `func(*args, **kwargs)` in microseconds (the seed's helper).

    A thin wrapper over `torch.utils.benchmark.Timer.blocked_autorange`, which synchronises CUDA
    around its measurements and picks the number of runs itself. It times the CPU just as well.
    """
    from torch.utils import benchmark

    timer = benchmark.Timer(
        stmt="func(*args, **kwargs)", globals={"func": func, "args": args, "kwargs": kwargs}
    )
    return timer.blocked_autorange(min_run_time=0.1).median * 1e6
