"""Context-parallel runs: spawn the ranks, then shard, validate, time, instrument, compare.

One task per context-parallel topology (ring, allgather, ulysses, hybrid, and custom: a user's
scheme), registered from the topology table (attngym.distributed.schemes.topologies): each
topology's TopologySpec (in the `CPRun` made once per process: custom bound to topology.scheme)
gives its library attention function, its own options, its config rules, its transfer-only timing
and how many sequence shards its ranks attend apart. Everything else is shared, so the algorithms
report comparable numbers; first call, timed passes and peak memory are attngym.runner.tasks.phases,
the ones the single-device task runs (what each timed metric means is written there).

The settings arrive checked (ranks against GPUs, the variant: see attngym.runner.config); the parent
process runs `check_hardware` (the topology's rules, the transport against the device) and raises
ConfigError before any rank starts; then attngym.distributed.ranks.launch runs `_rank_run` on every
rank. Every rank runs the same phases in order; each phase returns the metrics it measured:

1. `shard`: the same seeded whole-sequence inputs drawn on the CPU on every rank
   (attngym.inputs.make_inputs), this rank's shard in the layout moved to its device: no device
   holds the whole sequence. Reports `load_imbalance` (max over mean of the non-empty blocks each
   rank's queries attend; 1.0 is perfect balance, and always for head-parallel ulysses; hybrid:
   among its groups, whose members attend the same blocks).
2. `first_call`: one forward (+ backward when passes include bwd; on CPU the reference chunk kernel
   gives one) timed apart as `first_call_s` (compilation on CUDA).
3. `validate`: validation.validate_rows, judged per dtype like a single run (a verdict over
   tolerance fails the run the same way): every rank attends with an output gradient kept on the
   validated rows (a seeded sample, and always every rank's first and last query blocks and the
   edges of every piece of the layout: `validation.sample_rows`), the shards of out, lse and the
   gradients are gathered to rank 0, and rank 0 compares them with the float64 dense reference
   (validated q rows against the whole K/V, O(R·S) memory) on its GPU where that fits in half
   its free memory (`_reference_device`), else on its CPU.
4. `time`: fwd, bwd, fwd+bwd timed together with the peers (bench.time_fn; every rank makes the
   same calls), and `peak_mem_bytes`, the largest peak over the ranks of what the timed calls add
   (CUDA: beyond the live inputs; CPU: the process's peak RSS), so that ring and all-gather memory
   can be compared; then one more call of the timed kind, gathered and held to the validated
   one by rank 0 (`validation.Validated.agrees`).
5. `instrument`: one instrumented forward (per-step compute, pairs, bytes) and a transfer-only
   pass (per-step transfer time).
6. `torch_cp`: when `baselines` lists it (the default for every context-parallel run), PyTorch's
   own flex context parallelism (attngym.distributed.schemes.torch_cp) on the same shards, variant
   and process group, timed like attngym: torch_cp_fwd_ms, torch_cp_fwd_bwd_ms,
   torch_cp_peak_mem_bytes, attngym_over_torch_cp_<pass> (torch_cp time / attngym time; above 1
   attngym is faster) and its _ci95 (phases.ratio), torch_cp_status ("ok" or "skipped:
   <reason>") and torch_cp_bwd_status ("ok", "not requested" or phases.NO_CPU_BWD: flex has no
   CPU backward, the CPU forward still runs). Its output is compared with attngym's on the
   validated rows (torch_cp_err_out_rel, torch_cp_err_out_max_abs); beyond the dtype's tolerance
   torch_cp_validation fails, and so does the run's `validation` verdict.
7. `one_device`: on rank 0, the whole problem on one device with the same kernel (single_fwd_ms,
   efficiency and its _ci95; with a backward also single_fwd_bwd_ms, efficiency_fwd_bwd).

Rank 0 alone does the float64 reference and the one-device comparison (which needs the whole
problem on its device, briefly). The other ranks wait for it inside
attngym.distributed.ranks.keepalive.rank0_work: rank 0 gives signs of life while it works, so every
wait stays bounded by topology.timeout_s however long the work takes (the one-device run of a long
sequence takes about P times a CP forward per call), and a rank 0 that dies or stops fails the
peers within topology.timeout_s. Measuring the one-device run on every rank at once was rejected: it
would put the whole problem on every device, which is what context parallelism avoids. On CPU the
dense one-device reference materialises B·H·S² scores, so it is skipped (logged; single_fwd_ms
and efficiency None) when they exceed SINGLE_CPU_MAX_BYTES.

Rank 0's metrics come back to the caller (layout from Settings.describe, the transport as
resolved); the other ranks log to rank<N>.log in the run folder.

With topology.simulate=true no rank starts: attngym.runner.tasks.cp_simulate runs every rank's
compute in turn on this one device and predicts the call (its one-device comparison is
`whole_problem_ms`, the one_device phase's timing).
Shape legend: B batch, H query heads, G kv heads, S sequence, D head dim, R validated rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import logging
import statistics
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from attngym import kernels, registry, timeline
from attngym.device import sync
from attngym.distributed.call.cp import attend_chunk
from attngym.distributed.ranks.keepalive import rank0_work
from attngym.errors import ConfigError
from attngym.inputs import make_inputs, torch_dtype
from attngym.metrics import ci95_metric, pass_flops, pass_metrics
from attngym.runner.config import Settings
from attngym.runner.tasks import phases
from attngym.runner.tasks.cp_setup import CPRun
from attngym.validation import (
    RTOL,
    Validated,
    add_failure,
    max_abs_error,
    rel_error,
    sample_rows,
    validate_rows,
)
from attngym.variants.base import Variant

log = logging.getLogger(__name__)

# On CPU the one-device comparison is skipped above this many bytes of float64 B·H·S² scores.
SINGLE_CPU_MAX_BYTES = 2 * 2**30
TORCH_CP = "torch_cp"


def check_hardware(run: CPRun) -> None:
    """ConfigError for what cannot run, before any tensor work (no collective needed): the
    topology's own rules (TopologySpec.check: layout, heads, hybrid groups, seq_len) and the
    transport against the device.

    transport=copy_engine on CPU (and any transport that cannot move this device's tensors) fails
    on `topology.transport`; ranks outside one NVLink domain with copy_engine, and a hybrid group
    size taken from the NVLink domains, are judged on the ranks.
    """
    from attngym import user_code
    from attngym.distributed.placement.layout import is_user_layout
    from attngym.distributed.schemes import custom as custom_scheme
    from attngym.distributed.transport import check_transport
    from attngym.variants import custom

    settings = run.settings
    topo = settings.topology
    in_process = custom.in_this_process_only(settings.attention)
    for key, path in (("topology.scheme", topo.scheme), ("topology.layout", topo.layout)):
        if in_process is None and user_code.lives_in_this_process(path):
            in_process = key
    if in_process is not None:  # the ranks rebuild what a path names by importing it
        raise ConfigError(
            in_process,
            "the callable lives only in this process, and context-parallel ranks start as new "
            "processes that import it by path: define it at the top of a module (mymasks.py) "
            "and pass its path (mymasks.NAME), or pass its factory's path and args",
        )
    run.check()
    check_transport(topo.transport, settings.device, key="topology.transport")
    if run.bound:
        custom_scheme.probe(run.spec, topo.scheme)
    if is_user_layout(topo.layout):  # a user's balancer, called and its placement checked here
        run.placement(settings.variant, run.on_rank())


def run_context_parallel(
    settings: Settings, run_dir: Path, kind: str, metrics: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Check, launch the ranks, and return rank 0's metrics (kind: a registered topology),
    filled into `metrics` (the settings first: a run stopped part-way keeps what it ran)."""
    from attngym.distributed.ranks.launch import launch

    metrics = {} if metrics is None else metrics
    if settings.workload.name != "none":  # each batch a run of this task (tasks.workloads)
        from attngym.runner.tasks import workloads

        if registry.get("topology", kind).chooses:  # auto: one pick for the whole workload
            from attngym.runner.tasks.cp_auto import choose_for_workload

            with timeline.phase("auto_choice"):
                settings = choose_for_workload(settings, run_dir, metrics)
            kind = settings.topology.kind
        if not settings.topology.simulate:
            return _workload_on_ranks(settings, run_dir, kind, metrics)

        def one_batch(batch: Settings, folder: Path, into: dict[str, Any]) -> dict[str, Any]:
            return run_context_parallel(batch, folder, kind, into)

        return workloads.run(settings, run_dir, metrics, one_batch)
    if registry.get("topology", kind).chooses:  # auto: the model picks a topology to run
        from attngym.runner.tasks.cp_auto import choose

        with timeline.phase("auto_choice"):
            settings, result, inputs = choose(settings, run_dir, metrics)
        kind = settings.topology.kind
        if settings.topology.simulate and result is not None:  # its simulation is the run's
            from attngym.runner.tasks.cp_simulate import simulated_metrics

            run = CPRun.of(settings)
            return simulated_metrics(run, kind, metrics, result, inputs, whole_problem_ms)
    if settings.topology.simulate:  # one process, every rank's compute in turn, predicted
        from attngym.runner.tasks.cp_simulate import run_simulated

        return run_simulated(CPRun.of(settings), kind, metrics, one_device=whole_problem_ms)
    run = CPRun.of(settings)
    check_hardware(run)
    metrics.update(settings.describe())
    metrics.update(run.metrics())
    with timeline.phase("ranks_start"):  # what rank 0's own phases do not cover
        metrics.update(
            launch(
                _rank_run,
                settings.topology.world_size,
                args=(settings, kind),
                device=settings.device,
                timeout_s=settings.topology.timeout_s,
                run_dir=run_dir,
                progress=metrics,  # rank 0 reports after each phase
                in_process=True,  # a world of one: no rank to start
            )
        )
        rank_time = metrics.pop(RANK_TIME, None)
        if rank_time is not None and (current := timeline.current()) is not None:
            current.add(rank_time)
    metrics.update(auto_check(metrics, "bwd" in settings.passes))
    return metrics


def _workload_on_ranks(
    settings: Settings, run_dir: Path, kind: str, metrics: dict[str, Any]
) -> dict[str, Any]:
    """A workload's batches on ranks started once for all of them (`_rank_workload`): rank 0
    writes batches.csv as batches finish and returns the workload's metrics."""
    from attngym.distributed.ranks.launch import launch

    run = CPRun.of(settings)
    check_hardware(run)
    metrics.update(run.metrics())
    with timeline.phase("ranks_start"):
        metrics.update(
            launch(
                _rank_workload,
                settings.topology.world_size,
                args=(settings, kind, run_dir),
                device=settings.device,
                timeout_s=settings.topology.timeout_s,
                run_dir=run_dir,
            )
        )
    return metrics


def _rank_workload(
    rank: int, world_size: int, settings: Settings, kind: str, run_dir: Path
) -> dict[str, Any]:
    """One rank's part of every batch of the workload, in order (each a `_rank_run` of the
    batch's settings: its own group, plans and phases)."""
    from attngym.runner.tasks import workloads

    def one_batch(batch: Settings, _folder: Path | None, _into: dict) -> dict[str, Any]:
        out = _rank_run(rank, world_size, batch, kind)
        out.pop(RANK_TIME, None)
        return out

    return workloads.run(settings, run_dir if rank == 0 else None, {}, one_batch)


def auto_check(metrics: dict[str, Any], backward: bool) -> dict[str, Any]:
    """auto_measured_over_predicted: a real run of auto's pick against the model's time for it
    (fwd+bwd where the run has a backward), so a pick can be checked on the GPUs it ran on."""
    predicted = metrics.get("auto_pick_ms")
    measured = metrics.get("fwd_bwd_ms" if backward else "fwd_ms")
    if not predicted or measured is None:
        return {}
    return {"auto_measured_over_predicted": measured / predicted}


def register_task(kind: str) -> None:
    """Register the context-parallel task of topology `kind` (a registered TopologySpec)."""

    @registry.register("task", kind)
    def run(
        settings: Settings, run_dir: Path, metrics: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        return run_context_parallel(settings, run_dir, kind, metrics)

    run.__doc__ = f"topology {kind} over topology.world_size ranks (module docstring)."


for _kind in registry.names("topology"):
    register_task(_kind)


def _rank_run(rank: int, world_size: int, settings: Settings, kind: str) -> dict[str, Any]:
    from attngym.distributed.transport import clear_cache, resolve_transport

    run = CPRun.of(settings)
    topo = settings.topology
    device = run.on_rank()
    resolved = resolve_transport(topo.transport, device, key="topology.transport")
    log.info("%s attention: rank %d of %d, transport %s", kind, rank, world_size, resolved.name)
    job = RankJob(
        run,
        kind,
        rank,
        world_size,
        device,
        resolved,
        _gloo_group(topo.timeout_s),
    )
    spawned = timeline.current() is None  # under torchrun the job's own timeline runs here
    if spawned:
        timeline.begin()
    metrics: dict[str, Any] = {
        "transport": resolved.name,
        # The CP call has a backward on CPU too (the reference chunk kernel's autograd).
        "bwd_status": phases.bwd_status(job.do_bwd, job.do_bwd),
    }
    try:
        with kernels.kept_block_masks():  # freed with this job's channels below
            return _rank_phases(job, metrics, spawned)
    finally:
        # Free this job's channels and symmetric memory: the next job of a torchrun sweep may use
        # other shapes, and every rank is past the job's last transfer and rank0_work here.
        sync(device)
        clear_cache()
        if spawned:
            timeline.end()


def _rank_phases(job: RankJob, metrics: dict[str, Any], spawned: bool) -> dict[str, Any]:
    """The rank's phases in order, each timed; rank 0 reports after each."""
    from attngym.distributed.ranks.launch import report

    topo = job.settings.topology
    # torch_cp right after attngym's own timings (same conditions); one_device last, as only
    # rank 0 works there while the others wait for it.
    for phase in (shard, first_call, validate, time_passes, check_timed, instrument, torch_cp):
        with timeline.phase(PHASE_NAMES.get(phase.__name__, phase.__name__)):
            metrics.update(phase(job))
        report(metrics)
    with rank0_work(topo.timeout_s), timeline.phase("one_device"):
        metrics.update(one_device(job))
    add_failure(metrics, metrics.get("torch_cp_validation"), "attngym and torch_cp disagree")
    if job.validated is not None:
        job.validated.fold(metrics)
    job.whole = None
    if spawned:  # the caller's timeline takes these in (run_context_parallel)
        metrics[RANK_TIME] = timeline.current().metrics()  # type: ignore[union-attr]
    return metrics


# The timeline's names of the rank phases whose function names differ.
PHASE_NAMES = {"validate": "validation", "time_passes": "timed", "check_timed": "validation"}
# Where a spawned rank 0 returns its own timeline's metrics (attngym.timeline), taken out of the
# run's metrics by run_context_parallel.
RANK_TIME = "rank_timeline"


# Default group -> {timeout: a gloo group of every rank, for gathers to rank 0}.
_WAIT_GROUPS: weakref.WeakKeyDictionary[Any, dict[float, Any]] = weakref.WeakKeyDictionary()


def _gloo_group(timeout_s: float):
    """The gloo group for gathers to rank 0, built once per default group and kept: re-creating
    it for every job of a torchrun sweep raced with peers still finishing the previous job."""
    import torch.distributed as dist

    groups = _WAIT_GROUPS.setdefault(dist.group.WORLD, {})
    if timeout_s not in groups:
        groups[timeout_s] = dist.new_group(
            backend="gloo", timeout=datetime.timedelta(seconds=timeout_s)
        )
    return groups[timeout_s]


class RankJob:
    """One rank's run: the CPRun, where it runs, and what the phases hand to the next ones
    (the shards and the measured call on them, rank 0's whole inputs, attngym's timings and block
    mask)."""

    def __init__(self, run: CPRun, kind, rank, world_size, device, transport, wait_group):
        settings = run.settings
        self.run, self.settings, self.kind, self.spec = run, settings, kind, run.spec
        self.options = run.options
        self.rank, self.world_size, self.device = rank, world_size, device
        self.transport, self.wait_group = transport, wait_group
        self.dtype = torch_dtype(settings.dtype)
        self.seq_len = settings.shape.seq_len
        self.do_bwd = "bwd" in settings.passes
        # fwd is always timed: the one-device efficiency and the torch_cp ratios divide by it.
        self.passes = ("fwd", *(phases.BACKWARD_PASSES if self.do_bwd else ()))
        self.variant_cpu: Variant = settings.variant
        self.variant = self.variant_cpu.to(device)
        self.shards: tuple[torch.Tensor, ...] = ()  # q, k, v, grad_out of this rank
        self.measured: phases.Rank | None = None  # the CP call on the shards (from `shard`)
        self.whole: tuple[torch.Tensor, ...] | None = None  # rank 0: the whole inputs, run dtype
        self.timings: dict[str, Any] = {}
        self.block_mask = None  # rank 0: the whole problem's block mask
        self.validated: Validated | None = None  # rank 0: the validated call (`validate`)

    @property
    def qkv(self) -> tuple[torch.Tensor, ...]:
        return self.shards[:3]

    @functools.cached_property
    def rows(self) -> torch.Tensor:
        """(R,) the validated rows, on the CPU: the sample, and always every rank's first and last
        query blocks and both edges of every piece of the layout (validation.sample_rows)."""
        from attngym.distributed import plan

        s = self.settings
        placement = plan(self.layout, self.world_size, self.seq_len).placement
        return sample_rows(
            self.seq_len, s.validate_rows, s.seed, "cpu", shards=placement, block=s.block_size[0]
        )

    @functools.cached_property
    def layout(self):
        """The run's layout as the shards and every call get it (balanced: the one Layout
        planned for this topology, TopologySpec.placement)."""
        return self.run.placement(self.variant, self.device, self.world_size)

    def mine(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a whole-sequence tensor, in the run's layout."""
        from attngym.distributed import shard as shard_of

        return shard_of(t, self.rank, self.world_size, self.layout)

    def gather(self, t: torch.Tensor, layout=None) -> torch.Tensor | None:
        """Every rank's shard of t (in `layout`, default the run's), unsharded on rank 0's CPU
        (None elsewhere)."""
        from attngym.distributed import unshard

        t = t.detach().cpu().contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world_size)] if self.rank == 0 else None
        torch.distributed.gather(t, parts, dst=0, group=self.wait_group)
        if self.rank != 0:
            return None
        return unshard(parts, self.layout if layout is None else layout)

    def attend(self, stats=None) -> torch.Tensor:
        """attngym's context-parallel call of this rank's shards."""
        return self.spec.attention(
            *self.qkv,
            self.variant,
            group=None,
            stats=stats,
            transport=self.transport.name,
            layout=self.layout,
            options=self.options,
            **self.run.scheme_options,
        )

    def max_over_ranks(self, value: int) -> int:
        return self.over_ranks(value, torch.distributed.ReduceOp.MAX)

    def over_ranks(self, value: int, op) -> int:
        """`value` of every rank reduced with `op` (a collective: every rank calls it)."""
        t = torch.tensor([value], dtype=torch.int64)
        torch.distributed.all_reduce(t, op=op, group=self.wait_group)
        return int(t.item())

    def sum_over_devices(self, value: float) -> float:
        """`value` summed over the devices the ranks run on: of the ranks that share a device
        (several processes on one GPU), the lowest counts (a collective)."""
        t = torch.tensor([value if self._first_on_device else 0.0], dtype=torch.float64)
        torch.distributed.all_reduce(t, group=self.wait_group)
        return float(t.item())

    @functools.cached_property
    def _first_on_device(self) -> bool:
        return first_on_device(self.device, self.rank, self.world_size, self.wait_group)


def first_on_device(device: torch.device, rank: int, world_size: int, group: Any = None) -> bool:
    """Whether no lower rank runs on `device` (the same host and device): the rank that speaks
    for a device several ranks share (a collective over `group`)."""
    import socket

    here = (socket.gethostname(), _device_id(device))
    every: list[Any] = [None] * world_size
    torch.distributed.all_gather_object(every, here, group=group)
    return every.index(here) == rank


def _device_id(device: torch.device) -> str:
    """The device's identity on its host: the GPU's UUID (two ranks given one GPU by different
    indices still match), else its name."""
    if device.type == "cuda":
        return str(torch.cuda.get_device_properties(device).uuid)
    return str(device)


def shard(job: RankJob) -> dict[str, Any]:
    """Draw the whole inputs on the CPU (the same draw on every rank), keep this rank's shards on
    its device; rank 0 keeps the whole inputs on its CPU, rounded to the run dtype like the
    shards. Reports load_imbalance."""
    s = job.settings
    # First: hybrid resolves its groups here and refuses a bad group size before any tensor.
    shards = job.run.sequence_shards()
    start = time.perf_counter()
    job.layout  # noqa: B018  (planned here, timed: a balanced placement reads the block mask)
    planning_ms = 1e3 * (time.perf_counter() - start)
    whole = make_inputs(s.shape, s.seed, "cpu", torch.float32)  # q, k, v, grad_out
    job.shards = tuple(job.mine(t).to(device=job.device, dtype=job.dtype) for t in whole)
    job.whole = tuple(t.to(job.dtype) for t in whole) if job.rank == 0 else None
    for t in job.qkv:
        t.requires_grad_(job.do_bwd)
    job.measured = phases.Rank(
        attend=job.attend,
        leaves=job.qkv,
        grad_out=job.shards[3],
        device=job.device,
        warmup=s.benchmark.warmup,
        repeats=s.benchmark.repeats,
        budget_ms=s.benchmark.budget_ms,
        max_over_ranks=job.max_over_ranks,
        sum_over_devices=job.sum_over_devices,
    )
    return {
        "planning_ms": planning_ms,
        **job.run.placement_imbalance(job.layout, job.variant, shards, job.device),
        **job.run.kv_needed(job.layout, job.variant, shards, job.device),
    }


def first_call(job: RankJob) -> dict[str, Any]:
    """The first call (compilation on CUDA), timed apart: first_call_s
    (attngym.runner.tasks.phases); with topology.cuda_graph the call is captured here (its warm-up
    compiles), and every later phase that times or validates it replays the graphs."""
    start = time.perf_counter()
    if job.settings.topology.cuda_graph:
        job.measured = phases.graphed(job.measured)
    phases.first_call(job.measured, backward=job.do_bwd)
    return {"first_call_s": time.perf_counter() - start}


def _row_mask(job: RankJob) -> torch.Tensor:
    """This rank's shard of a (1, 1, S, 1) mask of the validated rows."""
    keep = torch.zeros(1, 1, job.seq_len, 1, dtype=torch.bool)
    keep[:, :, job.rows] = True
    return job.mine(keep).to(job.device)


def validate(job: RankJob) -> dict[str, Any]:
    """Sampled rows against the float64 reference (rank 0 judges; the others attend and send)."""
    from attngym.distributed import CPStats

    s = job.settings
    if not s.validate:
        return {"validated_rows": 0, "validation": "not run (validate=false)"}
    g_s = job.shards[3]
    g_masked_s = torch.where(_row_mask(job), g_s, torch.zeros_like(g_s))
    # Rank 0's work inside validate_rows comes in two parts, the reference before it calls
    # `attend` and the comparison after: the peers wait through each in rank0_work.
    rank0_alone = contextlib.ExitStack()

    def attend(g_masked: torch.Tensor | None = None):
        """The CP call with the row-masked output gradient; (out, lse, grads) on rank 0."""
        rank0_alone.close()  # rank 0 has its reference: every rank attends
        stats = CPStats()
        out_s = job.attend(stats)  # the lse comes from the call itself
        if job.settings.topology.cuda_graph:  # the replayed graphs are what is timed
            out_s = job.measured.attend()
        grads = None
        if job.do_bwd:
            grads = tuple(job.gather(g) for g in job.measured.grads(out_s, g_masked_s))
        lse = None if stats.lse is None else job.gather(stats.lse)  # ulysses keeps no lse
        result = job.gather(out_s), lse, grads
        rank0_alone.enter_context(rank0_work(s.topology.timeout_s))  # rank 0 compares
        return result

    metrics: dict[str, Any] = {}
    with rank0_alone:
        rank0_alone.enter_context(rank0_work(s.topology.timeout_s))  # rank 0's reference
        if job.rank == 0:
            on = _reference_device(job)
            q, k, v, grad_out = (t.to(on) for t in job.whole)

            def attend_on(g_masked: torch.Tensor | None = None):
                out, lse, grads = attend(g_masked)
                grads = None if grads is None else tuple(t.to(on) for t in grads)
                return out.to(on), None if lse is None else lse.to(on), grads

            metrics, job.validated = validate_rows(
                job.variant_cpu if on.type == "cpu" else job.variant,
                q,
                k,
                v,
                grad_out,
                attend_on,
                do_bwd=job.do_bwd,
                rows=job.rows.to(on),
                rows_at_once=s.validate_rows,
            )
        else:
            attend()
    return metrics


def _reference_device(job: RankJob) -> torch.device:
    """Where rank 0's float64 reference runs: its GPU where what the reference holds (a row
    group's transient, estimate.reference_bytes; float64 K/V and their gradients repeated over
    the heads; the whole problem gathered in the run dtype) takes at most half its free memory;
    else its CPU, seconds at 64K."""
    from attngym.estimate import available_memory, reference_bytes

    if job.device.type != "cuda":
        return torch.device("cpu")
    shape = job.settings.shape
    whole = shape.batch * shape.heads * shape.seq_len * shape.head_dim
    need = reference_bytes(shape.batch, shape.heads, job.settings.validate_rows, shape.seq_len,
                           backward=job.do_bwd)  # fmt: skip
    need += 8 * 6 * whole + 8 * whole * job.shards[0].element_size()
    on = job.device if need <= available_memory(job.device) // 2 else torch.device("cpu")
    log.info("float64 reference on %s (~%.1f GiB)", on, need / 2**30)
    return on


def check_timed(job: RankJob) -> dict[str, Any]:
    """One more call as the timed ones are made (the measured call, their grad mode), after
    them, gathered and held to the validated call by rank 0: a scheme whose result changes with
    the calls before it (a cache, a stale buffer) fails the run here."""
    if not job.settings.validate:
        return {}
    with torch.set_grad_enabled(job.do_bwd):
        out = job.gather(phases.first(job.measured.attend()))
    return {} if job.validated is None else job.validated.agrees(out)  # rank 0 judges


def time_passes(job: RankJob) -> dict[str, Any]:
    """fwd, bwd, fwd+bwd timed on every rank at once (attngym.runner.tasks.phases); sparsity,
    peak_mem_bytes (the largest rank's); then how near the limit they ran (phases.limits: the
    fraction of every device's peak on the FLOPs the mask keeps, the joules over every device,
    the kernel path) with the mask's density, from rank 0's whole-problem block mask."""
    s = job.settings
    # Rank 0's are the run's: the other ranks' mask metrics and limits are not reported.
    metrics: dict[str, Any] = {"sparsity": 0.0}
    kept: dict[str, float] = {}
    if job.rank == 0:
        job.block_mask = kernels.make_block_mask(
            job.variant, job.seq_len, job.seq_len, block_size=s.block_size, device=job.device
        )
        metrics = phases.mask_work(
            job.variant.mask_mod, job.block_mask, s.shape.batch, s.shape.heads
        )
        kept = {
            p: f / job.world_size
            for p, f in pass_flops(s.shape, job.seq_len, 1.0 - metrics["mask_density"]).items()
        }
    sparsity = metrics["sparsity"]
    with phases.peak_memory(job.measured, metrics, "peak_mem_bytes"):
        phases.time_passes(job.measured, job.passes, into=job.timings)
    metrics.update(pass_metrics(job.timings, s.shape, job.seq_len, sparsity))
    metrics.update(
        phases.limits(job.measured, job.timings, kept, dtype=s.dtype,
                      tokens=s.shape.batch * job.seq_len)
    )  # fmt: skip
    return metrics


def instrument(job: RankJob) -> dict[str, Any]:
    """One instrumented forward and the transfers alone: pairs summed over the ranks, bytes the
    most any rank sent, rank 0's median step compute."""
    from attngym.distributed import CPStats

    stats = CPStats()
    with torch.no_grad():
        job.attend(stats)
    repeats = job.settings.benchmark.repeats
    total = torch.distributed.ReduceOp.SUM
    counts = {
        "pairs_computed": job.over_ranks(stats.pairs_computed, total),
        "pairs_skipped": job.over_ranks(stats.pairs_skipped, total),
        "bytes_moved": job.max_over_ranks(stats.bytes_sent),
    }
    if not job.spec.fills_stats and not any(counts.values()):  # a user's scheme counted none
        counts = dict.fromkeys(counts)  # not reported, not measured zeros
    return {
        "step_compute_ms": (
            statistics.median(stats.step_compute_ms) if stats.step_compute_ms else None
        ),
        **counts,
        "step_transfer_ms": _step_transfer_ms(job, repeats),
    }


def _step_transfer_ms(job: RankJob, repeats: int) -> float | None:
    """Median time of one step's K/V transfer alone (TopologySpec.transfer_ms; 0.0 on one rank;
    None where the topology has no single step to time)."""
    if job.world_size == 1:
        return 0.0
    times = job.spec.transfer_ms(
        job.transport, job.shards[1], job.settings.topology.timeout_s, repeats
    )
    return None if times is None else statistics.median(times)


def one_device(job: RankJob) -> dict[str, Any]:
    """The whole problem on rank 0's device with the same kernel: single_<pass>_ms, efficiency.

    efficiency = (one-device time / world_size) / CP time, for fwd and (when the CP run did a
    backward) fwd+bwd: 1.0 is perfect scaling. The other ranks return at once (they wait for rank
    0 in the rank0_work around this phase).
    """
    metrics: dict[str, Any] = dict.fromkeys(
        ("single_fwd_ms", "efficiency", "efficiency_ci95", "single_fwd_bwd_ms",
         "efficiency_fwd_bwd", "efficiency_fwd_bwd_ci95")
    )  # fmt: skip
    if job.rank != 0:
        return metrics
    shape = job.settings.shape
    dense_bytes = shape.batch * shape.heads * job.seq_len**2 * 8
    if job.device.type == "cpu" and dense_bytes > SINGLE_CPU_MAX_BYTES:
        log.info(
            "one-device comparison skipped: the dense CPU reference would hold %.1f GiB of "
            "scores (B·H·S²·8 bytes, limit %.1f GiB); efficiency not measured",
            dense_bytes / 2**30,
            SINGLE_CPU_MAX_BYTES / 2**30,
        )
        return metrics
    single: dict[str, Any] = {}
    oom = None
    try:
        _time_whole_problem(job, "fwd_bwd" in job.timings, single)
    except Exception as err:  # noqa: BLE001  (only out of memory is caught; the rest re-raised)
        oom = _out_of_memory(err)
        if oom is None:
            raise
    if oom is not None:
        # The comparison is optional: the run keeps everything it measured before it. The
        # tensors went with the failed call's frames (the error is gone here): free the cache.
        torch.cuda.empty_cache()
        log.warning(
            "one-device comparison %s: the whole problem does not fit on one device (%s)",
            "stopped after the forward" if single else "skipped",
            oom,
        )
    for name, result in single.items():
        suffix = "" if name == "fwd" else f"_{name}"
        key = f"efficiency{suffix}"
        # (one device's time / world_size) / the CP time: their speed ratio over world_size.
        over = phases.ratio(key, result, job.timings[name])
        efficiency = over[key] / job.world_size
        interval = over[ci95_metric(key)]
        metrics[f"single_{name}_ms"] = result.median_ms
        metrics[key] = efficiency
        metrics[ci95_metric(key)] = interval and [x / job.world_size for x in interval]
        log.info(
            "%s %s %.2f ms vs one device %.2f ms over %d ranks: efficiency %.2f",
            job.kind,
            name,
            job.timings[name].median_ms,
            result.median_ms,
            job.world_size,
            efficiency,
        )
    return metrics


def whole_problem_ms(run: CPRun, kind: str, whole, device, do_bwd: bool) -> dict:
    """{pass: median ms} of the whole problem on `device` (`whole`: q, k, v, grad_out there), as
    the one_device phase times it; {} where the dense CPU reference would exceed
    SINGLE_CPU_MAX_BYTES. For the simulated ranks (attngym.runner.tasks.cp_simulate)."""
    settings = run.settings
    shape = settings.shape
    if device.type == "cpu" and shape.batch * shape.heads * shape.seq_len**2 * 8 > (
        SINGLE_CPU_MAX_BYTES
    ):
        log.info("one-device comparison skipped: the dense CPU reference is too large")
        return {}
    job = RankJob(run, kind, 0, settings.topology.world_size, device, None, None)
    job.whole = whole
    if device.type == "cuda":
        job.block_mask = kernels.make_block_mask(
            job.variant, shape.seq_len, shape.seq_len, block_size=settings.block_size,
            device=device,
        )  # fmt: skip
    single: dict[str, Any] = {}
    _time_whole_problem(job, do_bwd, single)
    return {name: timing.median_ms for name, timing in single.items()}


def _time_whole_problem(job: RankJob, do_bwd: bool, into: dict[str, Any]) -> None:
    """Time the whole problem on rank 0's device into `into` (fwd, then fwd_bwd): the phases of
    the CP call at world size 1, so efficiency compares like with like."""
    s = job.settings
    q, k, v = (t.to(job.device).requires_grad_(do_bwd) for t in job.whole[:3])
    grad_out = job.whole[3].to(job.device)

    block_mask = job.block_mask if job.device.type == "cuda" else None

    def call():
        return attend_chunk(q, k, v, job.variant, options=job.options, block_mask=block_mask)[0]

    whole = phases.Rank(
        attend=call,
        leaves=(q, k, v),
        grad_out=grad_out,
        device=job.device,
        warmup=s.benchmark.warmup,
        repeats=s.benchmark.repeats,
        budget_ms=s.benchmark.budget_ms,
    )
    if s.topology.cuda_graph:  # like with like: the CP call's graphs against one device's
        whole = phases.graphed(whole)
    phases.first_call(whole, backward=do_bwd)  # compiles on CUDA; not reported
    phases.time_passes(whole, ("fwd", "fwd_bwd") if do_bwd else ("fwd",), into=into)


def _out_of_memory(err: BaseException) -> str | None:
    """The first line of the out-of-memory error in err's chain (a compiler may wrap it), else
    None."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, torch.OutOfMemoryError):
            return (str(seen).splitlines() or ["out of memory"])[0]
        seen = seen.__cause__ or seen.__context__
    return None


def torch_cp_skip_reason(
    settings: Settings, world_size: int, device_type: str = "cuda", backend: str = "nccl"
) -> str | None:
    """Why PyTorch's flex CP cannot run this job on this torch (None: it can). No collective.

    device_type, backend: the ranks' device and process-group backend.
    """
    from attngym.distributed.schemes import torch_cp as tcp

    ok, why = tcp.torch_cp_available()
    if not ok:
        return why
    if world_size > 1 and device_type == "cuda" and backend == "gloo":
        return (
            # Measured: SIGSEGV in all_gather_tensor, two ranks on one H200 over gloo.
            "PyTorch's CP needs nccl for CUDA shards (it crashed on gloo)"
        )
    block = tcp.block_size()
    if tuple(settings.block_size) != (block, block):
        return f"PyTorch's CP uses ({block}, {block}) blocks, block_size is {settings.block_size}"
    try:  # whatever attngym's layout, PyTorch's runs its own balancers' (resharded to them)
        tcp.check_shape(settings.shape.seq_len, world_size, tcp.DEFAULT_TORCH_LAYOUT)
    except ValueError as err:
        return str(err)
    return None


def torch_cp(job: RankJob) -> dict[str, Any]:
    """PyTorch's own flex CP on the same inputs, variant and group, once with each of its load
    balancers that can place this variant (attngym.distributed.schemes.torch_cp.BALANCERS: the
    shards resharded into its placement outside the timing), timed like attngym, its output compared
    with attngym's on the validated rows; the fastest balancer is the contender
    (torch_cp_balancer, torch_cp_<pass>_ms), each one's times beside it."""
    from attngym.distributed.schemes.torch_cp import BALANCERS

    s = job.settings
    if TORCH_CP not in s.baselines:
        return {}
    backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else "gloo"
    reason = torch_cp_skip_reason(s, job.world_size, job.device.type, backend)
    if reason is not None:
        log.info("baseline torch_cp skipped: %s", reason)
        return {"torch_cp_status": f"skipped: {reason}"}
    do_bwd = job.do_bwd and job.device.type == "cuda"  # flex has no CPU backward
    metrics: dict[str, Any] = {"torch_cp_bwd_status": phases.bwd_status(job.do_bwd, do_bwd)}
    runs: dict[str, dict[str, Any]] = {}
    times: dict[str, dict[str, Any]] = {}  # each balancer's {pass: Timing}
    for balancer in BALANCERS:
        runs[balancer] = _torch_cp_balanced(job, balancer, do_bwd)
        times[balancer] = runs[balancer].pop("timings", {})
        metrics.update({f"torch_cp_{balancer}_{k}": v for k, v in runs[balancer].items()
                        if k in ("status", "fwd_ms", "fwd_bwd_ms")})  # fmt: skip
    timed = {b: r for b, r in runs.items() if r["status"] == "ok"}
    if not timed:
        metrics["torch_cp_status"] = "skipped: " + "; ".join(
            f"{b}: {r['status'].removeprefix('skipped: ')}" for b, r in runs.items()
        )
        return metrics
    last = "fwd_bwd_ms" if do_bwd else "fwd_ms"
    best = min(timed, key=lambda b: timed[b][last])
    metrics.update({f"torch_cp_{k}": v for k, v in timed[best].items()})
    metrics["torch_cp_balancer"] = best
    failed = [r["validation"] for r in timed.values() if r.get("validation", "").startswith("f")]
    if failed:  # any balancer's disagreement is one (PyTorch's, or attngym's, or the comparison)
        metrics["torch_cp_validation"] = failed[0]
    for p in ("fwd", "fwd_bwd"):
        mine, theirs = job.timings.get(p), times[best].get(p)
        if mine is not None and theirs is not None:
            metrics.update(phases.ratio(f"attngym_over_torch_cp_{p}", theirs, mine))
    return metrics


def _torch_cp_balanced(job: RankJob, balancer: str, do_bwd: bool) -> dict[str, Any]:
    """PyTorch's CP with one of its balancers: {status, fwd_ms, fwd_bwd_ms, peak_mem_bytes,
    err_out_rel, err_out_max_abs, validation} (the torch_cp_ metrics, unprefixed) and timings
    ({pass: Timing}, for the ratio's interval); status `skipped: why` where the balancer cannot
    place the variant (a collective either way)."""
    from attngym.distributed.schemes.torch_cp import TorchCP, reshard

    s, shape = job.settings, job.settings.shape
    try:
        contender = TorchCP(
            job.variant, batch=shape.batch, heads=shape.heads, kv_heads=shape.kv_heads,
            seq_len=job.seq_len, device=job.device, block_size=tuple(s.block_size),
            kernel_options=s.kernel_options or None, compile=s.compile,
            compile_mode=s.compile_mode, balancer=balancer,
        )  # fmt: skip
    except ValueError as err:  # the same answer on every rank: no collective was started
        log.info("torch_cp %s skipped: %s", balancer, err)
        return {"status": f"skipped: {err}"}
    # Flex refuses CPU inputs that require grad, even under no_grad: plain tensors there.
    moved = [reshard(t.detach(), job.layout, contender.layout, variant=job.variant)
             for t in (*job.qkv, job.shards[3])]  # fmt: skip
    leaves = tuple(t.requires_grad_(do_bwd) for t in moved[:3])
    grad_out = moved[3]
    measured = dataclasses.replace(job.measured, leaves=leaves, grad_out=grad_out)

    def call() -> torch.Tensor:
        return contender(*leaves)

    phases.first_call(measured, call, backward=do_bwd)  # compiles on CUDA; not reported
    out: dict[str, Any] = {"status": "ok"}
    out.update(_torch_cp_agreement(job, call, contender.layout))
    with phases.peak_memory(measured, out, "peak_mem_bytes"):
        timings = phases.time_passes(measured, ("fwd", "fwd_bwd") if do_bwd else ("fwd",), call)
    out.update({f"{p}_ms": t.median_ms for p, t in timings.items()})
    out["timings"] = timings  # for the ratio's interval; not a metric
    return out


def _torch_cp_agreement(job: RankJob, call: Callable[[], torch.Tensor], layout) -> dict[str, Any]:
    """torch_cp's output (its shards in `layout`) against attngym's on the validated rows,
    judged at the dtype's RTOL (unprefixed: err_out_rel, err_out_max_abs, validation)."""
    s = job.settings
    if not s.validate:
        return {"validation": "not run (validate=false)"}
    with torch.no_grad():
        theirs, ours = job.gather(call(), layout), job.gather(job.attend())
    if job.rank != 0:
        return {}
    theirs, ours = theirs[:, :, job.rows], ours[:, :, job.rows]
    # Both are checked against the same tolerance attngym meets against the float64 reference:
    # two kernels each within RTOL of the truth agree within about 2 x RTOL, and a wrong mask or
    # position mapping gives errors of order 1e-1 to 1.
    limit = 2 * RTOL[s.dtype]
    err = rel_error(theirs, ours)
    verdict = "ok" if err <= limit else f"failed: torch_cp_err_out_rel={err:.3g} > {limit:g}"
    return {
        "err_out_rel": err,
        "err_out_max_abs": max_abs_error(theirs, ours),
        "validation": verdict if verdict == "ok" else f"{verdict} ({s.dtype})",
    }
