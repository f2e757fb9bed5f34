"""The phases every task runs around the call it measures, written once.

The single-device task is world size 1 of the same phases the context-parallel task runs on each
rank: a `Rank` holds the measured call, its gradient leaves and output gradient, the benchmark
settings and how a number is reduced over the ranks (the identity at one rank). Both tasks run,
in order, `first_call`, their validation, then `time_passes` inside `peak_memory`, and time their
contenders (SDPA baselines, PyTorch's own CP) with the same `time_passes` on the same Rank.

What the timed metrics mean, in every task:

    first_call_s       the first call, timed apart with the host clock and the device synchronised:
                    the forward, then the backward when the run times one; on CUDA mostly
                    compilation (with topology.cuda_graph also the capture, `graphed`), on CPU
                    the first eager call.
    fwd_ms          the forward call. With autograd recording when the run also times a backward
                    (as training runs it: the graph compiled for it is the one fwd_bwd runs);
                    under torch.no_grad when the run is forward only. Median over the timed
                    calls, as many as fill benchmark.budget_ms (at least benchmark.repeats;
                    fwd_ms_min, fwd_ms_max: the extremes).
    bwd_ms          the backward alone: torch.autograd.grad of the output with the seeded output
                    gradient, each timed call on a fresh forward graph built outside the timing.
    fwd_bwd_ms      the forward and that backward in one timed call.
    peak_mem_bytes  what the timed calls add to the memory live before them (the inputs, the
                    L2-flush buffer, anything an earlier phase still holds): on CUDA the
                    allocator's peak, on CPU the growth of the process's peak resident set; in a
                    context-parallel run the largest over the ranks.

Timings are bench.time_fn's (CUDA events, the L2 cache flushed before each call; the host clock
on CPU). A contender's `<name>_<pass>_ms` has the same meaning as attngym's `<pass>_ms`; the
single-device task times its contenders together (`time_contenders`: interleaved rounds, one
warm-up each, no separate phase per contender). Every speed ratio comes from `ratio`, with its
`<ratio>_ci95` beside it.

After the timings the single-device task asks `limits`: the fraction of the device's peak on the
FLOPs the mask keeps, the energy of the timed passes (NVML) and the kernel path one profiled call
took, with what of these the device cannot give said in `not_measured`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from attngym.device import sync

log = logging.getLogger(__name__)

# bwd_status (and a contender's) where the run wants a backward that FlexAttention cannot give.
NO_CPU_BWD = "not available: FlexAttention has no CPU backward"
BACKWARD_PASSES = ("bwd", "fwd_bwd")


def bwd_status(wanted: bool, done: bool) -> str:
    """ok | not requested | NO_CPU_BWD (wanted, but no backward runs here)."""
    if done:
        return "ok"
    return NO_CPU_BWD if wanted else "not requested"


def first(result: Any) -> torch.Tensor:
    """The output of a call that returns it alone or as (out, lse)."""
    return result[0] if isinstance(result, tuple) else result


def _same(value: Any) -> Any:
    return value


@dataclasses.dataclass(kw_only=True)
class Rank:
    """One rank's measured call and what timing it needs; world size 1 unless `max_over_ranks`
    reduces over the ranks (a collective: every rank calls it).

    Attributes:
        attend: the measured call, no arguments; returns out or (out, lse).
        leaves: the tensors the gradients are of (q, k, v, or this rank's shards of them).
        grad_out: the seeded output gradient, shaped as the output.
        device: where the call runs.
        warmup, repeats, budget_ms: benchmark.warmup, benchmark.repeats and
            benchmark.budget_ms (bench.time_fn); a budget's count of calls is the ranks'
            largest (`max_over_ranks`), so every rank makes as many.
        label: what progress bars call the measured call (None: no bar).
        max_over_ranks: an int of every rank reduced to its largest.
        sum_over_devices: a float of every rank summed over the devices the ranks run on, a
            device that several ranks share counted once (energy read from a device's counter
            holds every process on it).
    """

    attend: Callable[[], Any]
    leaves: tuple[torch.Tensor, ...]
    grad_out: torch.Tensor | None
    device: torch.device
    warmup: int
    repeats: int
    budget_ms: float | None = None
    label: str | None = None
    max_over_ranks: Callable[[int], int] = _same
    sum_over_devices: Callable[[float], float] = _same

    def grads(self, out: Any, grad_out: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """The gradients of the leaves for output gradient `grad_out` (default: the seeded one)."""
        gradient = self.grad_out if grad_out is None else grad_out
        return torch.autograd.grad(first(out), self.leaves, gradient)

    def timed(
        self,
        fn: Callable[..., Any],
        setup: Callable[[], Any] | None = None,
        label: str | None = None,
    ) -> Any:
        """bench.time_fn of `fn` with the run's warmup, repeats and budget (a Timing)."""
        from attngym import bench

        return bench.time_fn(
            fn,
            warmup=self.warmup,
            repeats=self.repeats,
            budget_ms=self.budget_ms,
            device=self.device,
            progress=label,
            setup=setup,
            agree=self.max_over_ranks,
        )


def graphed(rank: Rank) -> Rank:
    """The rank with its call captured as CUDA graphs (topology.cuda_graph): `attend` replays
    them. Where the leaves need gradients, forward and backward are captured by PyTorch's
    make_graphed_callables (its warm-up calls compile), so `grads` replays the backward's graph;
    else the forward alone (bench.graphed). What the timed passes mean is unchanged: each
    replays what a training step would."""
    from attngym import bench
    from attngym.errors import ConfigError

    try:
        if any(t.requires_grad for t in rank.leaves):
            call = torch.cuda.make_graphed_callables(lambda *_: first(rank.attend()), rank.leaves)
            leaves = rank.leaves
            return dataclasses.replace(rank, attend=lambda: call(*leaves))
        replay = bench.graphed(lambda: first(rank.attend()), rank.device)
    except RuntimeError as exc:
        if "captur" not in str(exc):  # not CUDA refusing the capture: the call's own error
            raise
        raise ConfigError(
            "topology.cuda_graph",
            f"the call cannot be captured as a CUDA graph ({str(exc).splitlines()[0]}): it "
            "synchronises with the host or moves tensors through it; use "
            "topology.cuda_graph=false",
        ) from exc
    return dataclasses.replace(rank, attend=replay)


def first_call(rank: Rank, call: Callable[[], Any] | None = None, *, backward: bool) -> float:
    """first_call_s: the first call (and its backward when the run times one), timed apart.

    Grad mode is the one the timed forward uses (see fwd_ms), so on CUDA the graph compiled here
    is the one timed.
    """
    call = rank.attend if call is None else call
    start = time.perf_counter()
    with torch.set_grad_enabled(backward):
        out = call()
    if backward:
        rank.grads(out)
    sync(rank.device)
    return time.perf_counter() - start


@contextlib.contextmanager
def peak_memory(rank: Rank, into: dict[str, Any], key: str) -> Iterator[None]:
    """into[key]: what the block adds to the memory live when it starts (peak_mem_bytes), the
    largest over the ranks; the L2-flush buffer is allocated before, so it is not counted.

    On a CPU the figure is the growth of the process's resident set: a process that already
    holds freed pages (a sweep's later job, a contender after attngym) can run the block in
    them without growing at all, and a 0 there is not a measurement: None (empty), not 0 B."""
    from attngym import bench
    from attngym import device as device_mod

    if rank.device.type == "cuda":
        bench.l2_flush_buffer(rank.device)
    sync(rank.device)
    with device_mod.peak_memory(rank.device) as peak:
        yield
        sync(rank.device)
    grown = rank.max_over_ranks(peak["bytes"])
    into[key] = None if grown == 0 and rank.device.type == "cpu" else grown


def time_passes(
    rank: Rank,
    passes: tuple[str, ...],
    call: Callable[[], Any] | None = None,
    *,
    label: str | None = None,
    failures: dict[str, str] | None = None,
    into: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Timings of `passes` (of fwd, bwd, fwd_bwd) of `call` (default: the measured call).

    The forward records autograd when `passes` holds a backward (module docstring: fwd_ms).

    Args:
        passes: which to time, in order.
        label: the progress bars' name for the call (None: the Rank's label).
        failures: for a contender: a pass whose call raises RuntimeError (a backend with no
            kernel for it) is left out, its reason stored under its name, and the other passes
            are still timed. None: the error propagates and fails the run.
        into: filled as each pass is timed (kept when a later pass raises); a new dict if None.

    Returns:
        `into`: {pass: Timing}.
    """
    call = rank.attend if call is None else call
    label = rank.label if label is None else label
    timings: dict[str, Any] = {} if into is None else into
    records = any(p in BACKWARD_PASSES for p in passes)
    runs = _pass_calls(rank, call)
    for name in passes:
        fn, setup = runs[name]
        try:
            with torch.set_grad_enabled(records):
                timings[name] = rank.timed(fn, setup, None if label is None else f"{label} {name}")
        except RuntimeError as exc:
            if failures is None:
                raise
            failures[name] = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
    return timings


def time_contenders(
    contenders: Mapping[str, tuple[Rank, Callable[[], Any]]],
    passes: tuple[str, ...],
    failures: dict[str, dict[str, str]],
) -> dict[str, dict[str, Any]]:
    """Timings of `passes` of several contenders on one device in one pass: for each pass,
    bench.time_together's interleaved rounds of one call of each (the first contender's Rank
    gives the benchmark settings), in the grad mode time_passes uses.

    Args:
        contenders: {name: (its Rank: leaves and output gradient, its call)}.
        failures: filled with {name: {pass: reason}} for a pass whose call raises RuntimeError
            (a backend with no kernel for it); that contender's other passes are still timed.

    Returns:
        {name: {pass: Timing}} for every contender.
    """
    from attngym import bench

    timings: dict[str, dict[str, Any]] = {name: {} for name in contenders}
    if not contenders:
        return timings
    rank = next(iter(contenders.values()))[0]
    records = any(p in BACKWARD_PASSES for p in passes)
    for p in passes:
        calls = {name: _pass_calls(r, call)[p] for name, (r, call) in contenders.items()}
        failed: dict[str, str] = {}
        with torch.set_grad_enabled(records):
            found = bench.time_together(
                calls,
                warmup=rank.warmup,
                repeats=rank.repeats,
                budget_ms=rank.budget_ms,
                device=rank.device,
                progress=None if rank.label is None else f"baselines {p}",
                failures=failed,
            )
        for name, timing in found.items():
            timings[name][p] = timing
        for name, why in failed.items():
            failures.setdefault(name, {})[p] = why
    return timings


def ratio(key: str, over: Any, under: Any) -> dict[str, Any]:
    """A speed ratio of two Timings and its interval: {key: over's median / under's median,
    key_ci95: [lo, hi]}, the 95 % interval of bench.ratio_ci95 (a bootstrap over both sides'
    timed calls), null where a side has fewer than bench.MIN_CI_REPEATS calls (logged)."""
    from attngym import bench
    from attngym.metrics import ci95_metric

    interval = bench.ratio_ci95(over.all_ms, under.all_ms)
    if interval is None:
        log.info(
            "%s: no interval (%d and %d timed calls; it needs %d a side)",
            key, over.repeats, under.repeats, bench.MIN_CI_REPEATS,
        )  # fmt: skip
    return {
        key: over.median_ms / under.median_ms,
        ci95_metric(key): None if interval is None else list(interval),
    }


def _pass_calls(
    rank: Rank, call: Callable[[], Any]
) -> Mapping[str, tuple[Callable[..., Any], Callable[[], Any] | None]]:
    """What each pass runs: (the timed call, its untimed setup)."""
    return {
        "fwd": (call, None),
        # A fresh forward graph per timed backward, built outside the timed region.
        "bwd": (rank.grads, lambda: first(call())),
        "fwd_bwd": (lambda: rank.grads(call()), None),
    }


def mask_work(mask_mod: Any, block_mask: Any, batch: int, heads: int) -> dict[str, Any]:
    """What the block mask makes the kernel compute against what the mask keeps: sparsity (the
    blocks skipped), mask_density and mask_density_rows (bench.mask_density) and
    flops_spent_over_kept ((1 − sparsity) / mask_density; None for a mask keeping nothing)."""
    from attngym import bench

    sparsity = bench.block_sparsity(block_mask)
    density, rows = bench.mask_density(mask_mod, block_mask, batch, heads)
    return {
        "sparsity": sparsity,
        "mask_density": density,
        "mask_density_rows": rows,
        "flops_spent_over_kept": (1.0 - sparsity) / density if density else None,
    }


# The passes whose energy is read: each is one call with no setup to keep apart.
ENERGY_PASSES = ("fwd", "fwd_bwd")


def pass_energy(rank: Rank, timings: Mapping[str, Any], meter: Any) -> dict[str, Any]:
    """{pass: energy.Energy} of the measured call's timed passes in ENERGY_PASSES, each from a
    loop of about 0.4 s (attngym.energy.joules_per_call), in the grad mode they were timed
    in; empty when a rank's counter did not move. Every rank makes as many calls (the slowest
    rank's count: the calls may be collectives) and the joules are summed over the devices
    (Rank.sum_over_devices)."""
    from attngym import energy

    runs = _pass_calls(rank, rank.attend)
    records = any(p in BACKWARD_PASSES for p in timings)
    out = {}
    for name in (p for p in ENERGY_PASSES if timings.get(p) is not None):
        call_ms = rank.max_over_ranks(round(timings[name].median_ms * 1e3)) / 1e3
        with torch.set_grad_enabled(records):
            spent = energy.joules_per_call(
                meter, runs[name][0], rank.device, call_ms=call_ms, repeats=rank.repeats
            )
        if rank.max_over_ranks(int(spent is None)):
            return {}
        out[name] = energy.Energy(
            rank.sum_over_devices(spent.joules), rank.sum_over_devices(spent.watts)
        )
    return out


def limits(
    rank: Rank, timings: Mapping[str, Any], kept_flops: Mapping[str, float], *, dtype: str,
    tokens: int,
) -> dict[str, Any]:  # fmt: skip
    """How near the device's limit the timed passes ran, and what they cost; on several ranks a
    collective (every rank calls it; rank 0's result is the run's).

    Args:
        kept_flops: per pass, the FLOPs of this rank's share of what the mask keeps (the whole
            problem's over the world size); a pass missing here gets no peak fraction.
        tokens: the tokens one call attends, over every rank.

    Returns:
        peak_tflops and peak_source (attngym.peak), <pass>_peak_fraction (`kept_flops` over the
        pass's time, over the peak); energy_source and <pass>_joules, _watts and
        _joules_per_token of one call over every device (NVML); kernel_path_fwd and
        kernel_path_bwd (`kernel_paths`); and not_measured: what of these this device cannot
        give, and why, in one place (None when everything was measured).
    """
    from attngym import bench, energy, peak

    top = peak.peak(rank.device, dtype)
    meter, energy_why = energy.meter(rank.device)
    if rank.max_over_ranks(int(meter is None)) and meter is not None:
        meter, energy_why = None, "another rank's device has no readable energy counter"
    out: dict[str, Any] = {
        "peak_tflops": top.tflops,
        "peak_source": top.source if top.tflops else None,
        "energy_source": energy_why if meter is not None else None,
    }
    for p, timing in timings.items():
        if timing is not None and p in kept_flops:
            out[f"{p}_peak_fraction"] = bench.peak_fraction(
                kept_flops[p], timing.median_ms, top.tflops
            )
    if meter is not None:
        spent_by_pass = pass_energy(rank, timings, meter)
        if not spent_by_pass:
            meter, energy_why = (
                None,
                "NVML's energy counter did not move, or failed, during the calls",
            )
            out["energy_source"] = None
        for p, spent in spent_by_pass.items():
            out[f"{p}_joules"], out[f"{p}_watts"] = spent.joules, spent.watts
            out[f"{p}_joules_per_token"] = spent.joules / tokens
    on_gpu = rank.device.type == "cuda"
    if on_gpu:
        out.update(kernel_paths(rank, backward=any(p in BACKWARD_PASSES for p in timings)))
    missing = [
        f"fraction of peak ({top.source})" if top.tflops is None else "",
        f"energy ({energy_why})" if meter is None else "",
        "" if on_gpu else f"kernel path (no CUDA kernels on {rank.device.type})",
    ]
    out["not_measured"] = "; ".join(m for m in missing if m) or None
    return out


def kernel_paths(rank: Rank, *, backward: bool) -> dict[str, str]:
    """kernel_path_fwd (and kernel_path_bwd): the kernel family one profiled call ran
    (attngym.profiling.kernel_family), read from the kernels launched, not from what was asked."""
    from attngym.profiling import cuda_kernel_profiler, kernel_family

    with torch.set_grad_enabled(backward), cuda_kernel_profiler() as fwd:
        out = rank.attend()
        sync(rank.device)
    paths = {"kernel_path_fwd": kernel_family(fwd["kernel_names"])}
    if backward:
        with cuda_kernel_profiler() as bwd:
            rank.grads(out)
            sync(rank.device)
        paths["kernel_path_bwd"] = kernel_family(bwd["kernel_names"])
    return paths
