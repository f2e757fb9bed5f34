"""Context-parallel runs: spawn the ranks, then shard, validate, time, instrument, compare.

One task per context-parallel algorithm (ring, allgather, ulysses, hybrid), registered from
`KINDS`, the one table from a task kind to its library attention function, the topology keys it
takes, its transfer-only timing and its own config check. Everything else is shared, so the
algorithms report comparable numbers.

The settings arrive checked (ranks against GPUs, the variant, seq_len against the layout: see
attngym.config); the parent process checks the transport against the device and raises
ConfigError before any rank starts; then attngym.distributed.launch runs `_rank_run` on every
rank. Every rank runs the same phases in order; each phase returns the metrics it measured:

1. `shard`: the same seeded whole-sequence inputs drawn on the CPU on every rank
   (attngym.inputs.make_inputs), this rank's shard in the layout moved to its device: no device
   holds the whole sequence. Reports `load_imbalance` (max over mean of the non-empty blocks each
   rank's queries attend; 1.0 is perfect balance, and always for head-parallel ulysses; hybrid:
   among its groups, whose members attend the same blocks).
2. `first_call`: one forward (+ backward when passes include bwd; on CPU the reference chunk kernel
   gives one) timed apart as `compile_s` (compilation on CUDA).
3. `validate`: validation.validate_rows, judged per dtype like a single run (a verdict over
   tolerance fails the run the same way): every rank attends with an output gradient kept on the
   sampled rows, the shards of out, lse and the gradients are gathered to rank 0's CPU, and rank 0
   compares them with the float64 dense reference on its CPU (sampled q rows against the whole
   K/V: O(R·S) host memory, no device memory beyond the shards).
4. `time`: fwd, bwd, fwd+bwd timed together with the peers (bench.time_fn; every rank makes the
   same calls), and `peak_mem_bytes`, the largest peak over the ranks of what the timed calls add
   (CUDA: beyond the live inputs; CPU: the process's peak RSS), so that ring and all-gather memory
   can be compared.
5. `instrument`: one instrumented forward (per-step compute, pairs, bytes) and a transfer-only
   pass (per-step transfer time).
6. `torch_cp`: when `baselines` lists it (the default for every context-parallel run), PyTorch's
   own flex context parallelism (attngym.distributed.torch_cp) on the same shards, variant and
   process group, timed like attngym: torch_cp_fwd_ms, torch_cp_fwd_bwd_ms,
   torch_cp_peak_mem_bytes, attngym_over_torch_cp_<pass> (torch_cp time / attngym time; above 1
   attngym is faster), torch_cp_status ("ok" or "skipped: <reason>") and torch_cp_bwd_status
   ("ok", "not requested" or "not available: no CPU backward": flex has no CPU backward, the CPU
   forward still runs). Its output is compared with attngym's on the validated rows
   (torch_cp_err_out_rel, torch_cp_err_out_max_abs); beyond the dtype's tolerance
   torch_cp_validation fails, and so does the run's `validation` verdict.
7. `one_device`: on rank 0, the whole problem on one device with the same kernel (single_fwd_ms,
   efficiency; with a backward also single_fwd_bwd_ms, efficiency_fwd_bwd).

Rank 0 alone does the float64 reference and the one-device comparison (which needs the whole
problem on its device, briefly). The other ranks wait for it inside
attngym.distributed.keepalive.rank0_work: rank 0 gives signs of life while it works, so every
wait stays bounded by topology.timeout_s however long the work takes (the one-device run of a long
sequence takes about P times a CP forward per call), and a rank 0 that dies or stops fails the
peers within topology.timeout_s. Measuring the one-device run on every rank at once was rejected: it
would put the whole problem on every device, which is what context parallelism avoids. On CPU the
dense one-device reference materialises B·H·S² scores, so it is skipped (logged; single_fwd_ms
and efficiency None) when they exceed SINGLE_CPU_MAX_BYTES.

Rank 0's metrics come back to the caller (layout from Settings.describe, the transport as
resolved); the other ranks log to rank<N>.log in the run folder.
Shape legend: B batch, H query heads, G kv heads, S sequence, D head dim, R validated rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import math
import statistics
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from attngym import kernels, registry
from attngym.config import Settings, Topology
from attngym.device import sync
from attngym.distributed.keepalive import rank0_work
from attngym.errors import ConfigError, choice_error
from attngym.inputs import make_inputs, torch_dtype
from attngym.metrics import pass_metrics
from attngym.validation import RTOL, max_abs_error, rel_error, sample_rows, validate_rows
from attngym.variants.base import Variant

log = logging.getLogger(__name__)

# On CPU the one-device comparison is skipped above this many bytes of float64 B·H·S² scores.
SINGLE_CPU_MAX_BYTES = 2 * 2**30
TORCH_CP = "torch_cp"
NO_CPU_BWD = "not available: no CPU backward"


def _ring_transfer_ms(transport, k_s: torch.Tensor, timeout_s: float, repeats: int) -> list:
    """Times of one ring step's K/V push alone, following the channel's step protocol: step i
    pushes what it holds (its own K/V at i = 0, else the slot received at step i) and receives
    step i + 1 once; the slot of step i is released only after its onward push is queued."""
    world_size = torch.distributed.get_world_size()
    kv = torch.stack([k_s.detach(), k_s.detach()])
    chan = transport.channel(
        tuple(k_s.shape), 2, dtype=k_s.dtype, device=k_s.device, timeout_s=timeout_s
    )
    times = []
    for _ in range(repeats):
        cur = kv
        for i in range(world_size - 1):
            sync(k_s.device)
            start = time.perf_counter()
            chan.send(cur, i)
            nxt = chan.recv(i + 1)
            sync(k_s.device)
            times.append((time.perf_counter() - start) * 1e3)
            if i > 0:
                chan.release(i)  # the onward push out of this slot is queued
            cur = nxt
        chan.release(world_size - 1)
        chan.join()
    return times


def _gather_transfer_ms(transport, k_s: torch.Tensor, timeout_s: float, repeats: int) -> list:
    """Times of one all-gather of every rank's K/V alone."""
    kv = torch.stack([k_s.detach(), k_s.detach()])
    ag = transport.allgather(
        tuple(k_s.shape), 2, 2, dtype=k_s.dtype, device=k_s.device, timeout_s=timeout_s
    )
    times = []
    for _ in range(repeats):
        sync(k_s.device)
        start = time.perf_counter()
        ag.start(kv)
        ag.wait(kv)
        sync(k_s.device)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def _alltoall_transfer_ms(transport, k_s: torch.Tensor, timeout_s: float, repeats: int) -> list:
    """Times of the Ulysses all-to-all of K and V alone (sequence shards to head slices), K/V
    heads repeated up to a multiple of the ranks as ulysses_attention does."""
    world_size = torch.distributed.get_world_size()
    heads = k_s.shape[1]
    kv = k_s.detach().repeat_interleave(math.lcm(heads, world_size) // heads, dim=1)
    a2a = transport.alltoall(
        tuple(kv.shape), 2, 1, 2, dtype=kv.dtype, device=kv.device, timeout_s=timeout_s
    )
    times = []
    for _ in range(repeats):
        sync(kv.device)
        start = time.perf_counter()
        a2a.exchange([kv, kv])
        sync(kv.device)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def _check_ulysses(settings: Settings) -> None:
    """Head-parallel attention splits the heads over the ranks, in a contiguous or zigzag layout."""
    from attngym.distributed import check_ulysses_heads

    shape, topo = settings.shape, settings.topology
    try:
        check_ulysses_heads(shape.heads, shape.kv_heads, topo.world_size)
    except ValueError as err:
        key, _, message = str(err).partition(": ")
        raise ConfigError(f"shape.{key}", message) from None
    _check_head_parallel_layout(settings)


def _hybrid_groups(settings: Settings) -> int:
    """Groups of a hybrid run (collective: a2a_size None is resolved from the NVLink domains);
    every member of a group attends the group's whole shard for its head slice. A group size the
    domains or the heads refuse is a ConfigError on every rank alike (exit 2, as before launch)."""
    import torch.distributed as dist

    from attngym.distributed import check_ulysses_heads
    from attngym.distributed.ulysses import hybrid_groups

    shape, topo = settings.shape, settings.topology
    try:
        a2a_group, across_group = hybrid_groups(topo.a2a_size)
        check_ulysses_heads(shape.heads, shape.kv_heads, dist.get_world_size(a2a_group))
    except ValueError as err:
        key, _, message = str(err).partition(": ")
        where = f"topology.{key}" if key == "a2a_size" else f"shape.{key}"
        raise ConfigError(where, message) from None
    return dist.get_world_size(across_group)


def _check_head_parallel_layout(settings: Settings) -> None:
    """The all-to-all puts contiguous or zigzag shards back in global order (exchange_order)."""
    topo = settings.topology
    if topo.layout not in ULYSSES_LAYOUTS:
        raise ConfigError(
            "topology.layout",
            choice_error(f"layout for {topo.kind}", topo.layout, ULYSSES_LAYOUTS),
        )


ULYSSES_LAYOUTS = ("contiguous", "zigzag")


@dataclasses.dataclass(frozen=True)
class Kind:
    """What differs between context-parallel algorithms: the call and what one step moves."""

    attention: str  # name of the attention function in attngym.distributed
    # (transport, k_s, timeout_s, repeats) -> step times in ms; None: step_transfer_ms not measured
    transfer_ms: Callable[..., list] | None
    check: Callable[[Settings], None] | None = None  # ConfigError before any rank starts
    # (settings) -> how many shards of the sequence the ranks attend apart, on the ranks (may be
    # collective); load_imbalance is judged among them. 1: every rank attends the whole
    # sequence for H/P heads, balanced whatever the layout (load_imbalance 1.0).
    sequence_shards: Callable[[Settings], int] = lambda s: s.topology.world_size
    # The topology's own keyword arguments of the attention function (reported with the metrics).
    options: Callable[[Topology], dict[str, Any]] = lambda topo: {}


# Task kind -> its algorithm. A new algorithm is one row here: its function takes the shards, the
# variant, ring_attention's keyword arguments and the row's options, and fills what it can of a
# CPStats (the merged lse for validation; metrics it leaves empty are None).
KINDS = {
    "ring": Kind("ring_attention", _ring_transfer_ms),
    "allgather": Kind("allgather_attention", _gather_transfer_ms),
    "ulysses": Kind(
        "ulysses_attention",
        _alltoall_transfer_ms,
        _check_ulysses,
        sequence_shards=lambda s: 1,
    ),
    # Two levels of transfers (all-to-all in a group, ring or all-gather across): no one step to
    # time alone.
    "hybrid": Kind(
        "hybrid_attention",
        None,
        _check_head_parallel_layout,
        sequence_shards=_hybrid_groups,
        options=lambda topo: {"a2a_size": topo.a2a_size, "across": topo.across},
    ),
}


def check_hardware(settings: Settings) -> None:
    """ConfigError for a transport that cannot run here, before any tensor work (no collective
    needed).

    transport=copy_engine on CPU (and any transport that cannot move this device's tensors) fails
    on `topology.transport`. Ranks against GPUs and seq_len against the layout were checked with
    the settings (attngym.config); ranks outside one NVLink domain with copy_engine are caught on
    the ranks (resolve_transport).
    """
    from attngym.distributed.transport import check_transport

    check_transport(settings.topology.transport, settings.device, key="topology.transport")
    check = KINDS[settings.topology.kind].check if settings.topology.kind in KINDS else None
    if check is not None:
        check(settings)


def run_context_parallel(
    settings: Settings, run_dir: Path, kind: str, metrics: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Check, launch the ranks, and return rank 0's metrics (kind: a key of KINDS), filled into
    `metrics` (the settings first: a run stopped part-way keeps what it ran)."""
    from attngym.distributed.launch import launch

    check_hardware(settings)
    metrics = {} if metrics is None else metrics
    metrics.update(settings.describe())
    metrics.update(KINDS[kind].options(settings.topology))
    metrics.update(
        launch(
            _rank_run,
            settings.topology.world_size,
            args=(settings, kind),
            device=settings.device,
            timeout_s=settings.topology.timeout_s,
            run_dir=run_dir,
            progress=metrics,  # rank 0 reports after each phase
        )
    )
    return metrics


def _register(kind: str) -> None:
    @registry.register("task", kind)
    def run(
        settings: Settings, run_dir: Path, metrics: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        return run_context_parallel(settings, run_dir, kind, metrics)

    run.__doc__ = f"{KINDS[kind].attention} over topology.world_size ranks (module docstring)."


for _kind in KINDS:
    _register(_kind)


def _rank_run(rank: int, world_size: int, settings: Settings, kind: str) -> dict[str, Any]:
    from attngym.distributed.launch import report
    from attngym.distributed.transport import clear_cache, resolve_transport

    topo = settings.topology
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if settings.device == "cuda"
        else torch.device("cpu")
    )
    resolved = resolve_transport(topo.transport, device, key="topology.transport")
    log.info("%s attention: rank %d of %d, transport %s", kind, rank, world_size, resolved.name)
    job = RankJob(
        settings,
        kind,
        rank,
        world_size,
        device,
        resolved,
        _gloo_group(topo.timeout_s),
    )
    metrics: dict[str, Any] = {
        "transport": resolved.name,
        "bwd_status": "ok" if job.do_bwd else "not requested",
    }
    try:
        # torch_cp right after attngym's own timings (same conditions); one_device last, as only
        # rank 0 works there while the others wait for it.
        for phase in (shard, first_call, validate, time_passes, instrument, torch_cp):
            metrics.update(phase(job))
            report(metrics)
        with rank0_work(topo.timeout_s):
            metrics.update(one_device(job))
        _fold_torch_cp_verdict(metrics)
        job.whole = None
        return metrics
    finally:
        # Free this job's channels and symmetric memory: the next job of a torchrun sweep may use
        # other shapes, and every rank is past the job's last transfer and rank0_work here.
        sync(device)
        clear_cache()


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
    """One rank's run: the settings, where it runs, and what the phases hand to the next ones
    (the shards, rank 0's whole inputs, attngym's timings and block mask)."""

    def __init__(self, settings, kind, rank, world_size, device, transport, wait_group):
        self.settings, self.kind = settings, kind
        self.rank, self.world_size, self.device = rank, world_size, device
        self.transport, self.wait_group = transport, wait_group
        self.dtype = torch_dtype(settings.dtype)
        self.seq_len = settings.shape.seq_len
        self.do_bwd = "bwd" in settings.passes
        self.variant_cpu: Variant = settings.variant
        self.variant = self.variant_cpu.to(device)
        self.shards: tuple[torch.Tensor, ...] = ()  # q, k, v, grad_out of this rank
        self.whole: tuple[torch.Tensor, ...] | None = None  # rank 0: the whole inputs, run dtype
        self.timings: dict[str, Any] = {}
        self.block_mask = None  # rank 0: the whole problem's block mask

    @property
    def qkv(self) -> tuple[torch.Tensor, ...]:
        return self.shards[:3]

    def mine(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a whole-sequence tensor, in the run's layout."""
        from attngym.distributed import shard as shard_of

        layout = self.settings.topology.layout
        return shard_of(t, self.rank, self.world_size, layout, variant=self.variant_cpu)

    def gather(self, t: torch.Tensor) -> torch.Tensor | None:
        """Every rank's shard of t, unsharded on rank 0's CPU (None elsewhere)."""
        from attngym.distributed import unshard

        t = t.detach().cpu().contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world_size)] if self.rank == 0 else None
        torch.distributed.gather(t, parts, dst=0, group=self.wait_group)
        if self.rank != 0:
            return None
        return unshard(parts, self.settings.topology.layout, variant=self.variant_cpu)

    def attend(self, stats=None) -> torch.Tensor:
        """attngym's context-parallel call of this rank's shards."""
        import attngym.distributed

        s = self.settings
        fn = getattr(attngym.distributed, KINDS[self.kind].attention)
        return fn(
            *self.qkv,
            self.variant,
            stats=stats,
            transport=self.transport.name,
            layout=s.topology.layout,
            block_size=tuple(s.block_size),
            kernel_options=s.kernel_options or None,
            timeout_s=s.topology.timeout_s,
            compile=s.compile,
            compile_mode=s.compile_mode,
            **KINDS[self.kind].options(s.topology),
        )

    def timed(self, call, setup=None) -> Any:
        from attngym import bench

        b = self.settings.benchmark
        return bench.time_fn(
            call, warmup=b.warmup, repeats=b.repeats, device=self.device, setup=setup
        )

    def max_over_ranks(self, value: int) -> int:
        return self.over_ranks(value, torch.distributed.ReduceOp.MAX)

    def over_ranks(self, value: int, op) -> int:
        """`value` of every rank reduced with `op` (a collective: every rank calls it)."""
        t = torch.tensor([value], dtype=torch.int64)
        torch.distributed.all_reduce(t, op=op, group=self.wait_group)
        return int(t.item())


def shard(job: RankJob) -> dict[str, Any]:
    """Draw the whole inputs on the CPU (the same draw on every rank), keep this rank's shards on
    its device; rank 0 keeps the whole inputs on its CPU, rounded to the run dtype like the
    shards. Reports load_imbalance."""
    from attngym.distributed import layout as layouts
    from attngym.distributed import load_imbalance

    s = job.settings
    # First: hybrid resolves its groups here and refuses a bad group size before any tensor.
    shards = KINDS[job.kind].sequence_shards(s)
    whole = make_inputs(s.shape, s.seed, "cpu", torch.float32)  # q, k, v, grad_out
    job.shards = tuple(job.mine(t).to(device=job.device, dtype=job.dtype) for t in whole)
    job.whole = tuple(t.to(job.dtype) for t in whole) if job.rank == 0 else None
    for t in job.qkv:
        t.requires_grad_(job.do_bwd)
    if shards == 1:
        return {"load_imbalance": 1.0}
    # The placement the CP call uses (balanced: planned at its default blocks), counted at the
    # run's block size.
    used = layouts.resolve(s.topology.layout, shards, job.seq_len, job.variant, job.device)
    imbalance = load_imbalance(used, job.variant, shards, job.seq_len, s.block_size, job.device)
    return {"load_imbalance": imbalance}


def _grads(job: RankJob, out: torch.Tensor, grad_out: torch.Tensor | None = None):
    return torch.autograd.grad(out, job.qkv, job.shards[3] if grad_out is None else grad_out)


def first_call(job: RankJob) -> dict[str, Any]:
    """The first call (compilation on CUDA), timed apart: compile_s."""
    start = time.perf_counter()
    out = job.attend()
    if job.do_bwd:
        _grads(job, out)
    sync(job.device)
    return {"compile_s": time.perf_counter() - start}


def _row_mask(job: RankJob) -> torch.Tensor:
    """This rank's shard of a (1, 1, S, 1) mask of the validated rows."""
    s = job.settings
    rows = sample_rows(job.seq_len, s.validate_rows, s.seed, "cpu")
    keep = torch.zeros(1, 1, job.seq_len, 1, dtype=torch.bool)
    keep[:, :, rows] = True
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
        out_s = job.attend(stats)
        grads = None
        if job.do_bwd:
            grads = tuple(job.gather(g) for g in _grads(job, out_s, g_masked_s))
        lse = None if stats.lse is None else job.gather(stats.lse)  # ulysses keeps no lse
        result = job.gather(out_s), lse, grads
        rank0_alone.enter_context(rank0_work(s.topology.timeout_s))  # rank 0 compares
        return result

    metrics: dict[str, Any] = {}
    with rank0_alone:
        rank0_alone.enter_context(rank0_work(s.topology.timeout_s))  # rank 0's reference
        if job.rank == 0:
            q, k, v, grad_out = job.whole
            metrics = validate_rows(
                job.variant_cpu,
                q,
                k,
                v,
                grad_out,
                attend,
                do_bwd=job.do_bwd,
                max_rows=s.validate_rows,
                seed=s.seed,
            )
        else:
            attend()
    return metrics


@contextlib.contextmanager
def _peak_over_ranks(job: RankJob, into: dict[str, Any], key: str) -> Iterator[None]:
    """into[key]: the largest over the ranks of what the block adds to the memory live when it
    starts (the inputs, the L2-flush buffer, anything an earlier phase still holds)."""
    from attngym import bench
    from attngym import device as device_mod

    if job.device.type == "cuda":
        bench.l2_flush_buffer(job.device)
    sync(job.device)
    with device_mod.peak_memory(job.device) as peak:
        yield
        sync(job.device)
    into[key] = job.max_over_ranks(peak["bytes"])


def time_passes(job: RankJob) -> dict[str, Any]:
    """fwd, bwd, fwd+bwd timed on every rank at once; sparsity, peak_mem_bytes."""
    from attngym import bench

    if job.rank == 0:
        job.block_mask = kernels.make_block_mask(
            job.variant,
            job.seq_len,
            job.seq_len,
            block_size=job.settings.block_size,
            device=job.device,
        )
    sparsity = float(bench.block_sparsity(job.block_mask))
    metrics: dict[str, Any] = {"sparsity": sparsity}
    with _peak_over_ranks(job, metrics, "peak_mem_bytes"):
        with torch.no_grad():
            job.timings["fwd"] = job.timed(job.attend)
        if job.do_bwd:
            # A fresh forward graph per timed backward, built outside the timed region.
            job.timings["bwd"] = job.timed(lambda out: _grads(job, out), job.attend)
            job.timings["fwd_bwd"] = job.timed(lambda: _grads(job, job.attend()))
    metrics.update(pass_metrics(job.timings, job.settings.shape, job.seq_len, sparsity))
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
    return {
        "step_compute_ms": (
            statistics.median(stats.step_compute_ms) if stats.step_compute_ms else None
        ),
        "pairs_computed": job.over_ranks(stats.pairs_computed, total),
        "pairs_skipped": job.over_ranks(stats.pairs_skipped, total),
        "bytes_moved": job.max_over_ranks(stats.bytes_sent),
        "step_transfer_ms": _transfer_ms(
            job.kind, job.transport, job.shards[1], job.settings.topology.timeout_s, repeats
        ),
    }


def _transfer_ms(
    kind: str, transport, k_s: torch.Tensor, timeout_s: float, repeats: int
) -> float | None:
    """Median time of one step's K/V transfer alone for `kind` (0.0 on one rank; None where the
    kind has no single step to time)."""
    if torch.distributed.get_world_size() == 1:
        return 0.0
    transfer_ms = KINDS[kind].transfer_ms
    if transfer_ms is None:
        return None
    return statistics.median(transfer_ms(transport, k_s, timeout_s, repeats))


def one_device(job: RankJob) -> dict[str, Any]:
    """The whole problem on rank 0's device with the same kernel: single_<pass>_ms, efficiency.

    efficiency = (one-device time / world_size) / CP time, for fwd and (when the CP run did a
    backward) fwd+bwd: 1.0 is perfect scaling. The other ranks return at once (they wait for rank
    0 in the rank0_work around this phase).
    """
    metrics: dict[str, Any] = dict.fromkeys(
        ("single_fwd_ms", "efficiency", "single_fwd_bwd_ms", "efficiency_fwd_bwd")
    )
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
        efficiency = (result.median_ms / job.world_size) / job.timings[name].median_ms
        metrics[f"single_{name}_ms"] = result.median_ms
        metrics[f"efficiency{suffix}"] = efficiency
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


def _time_whole_problem(job: RankJob, do_bwd: bool, into: dict[str, Any]) -> None:
    """Time the whole problem on rank 0's device into `into` (fwd, then fwd_bwd)."""
    s = job.settings
    q, k, v = (t.to(job.device).requires_grad_(do_bwd) for t in job.whole[:3])
    grad_out = job.whole[3].to(job.device)

    def call():
        return kernels.attend_chunk(
            q,
            k,
            v,
            job.variant,
            backend="auto",
            block_size=tuple(s.block_size),
            block_mask=job.block_mask if job.device.type == "cuda" else None,
            kernel_options=s.kernel_options or None,
            compile=s.compile,
            compile_mode=s.compile_mode,
        )[0]

    with torch.no_grad():
        call()
        into["fwd"] = job.timed(call)
    if do_bwd:
        into["fwd_bwd"] = job.timed(lambda: torch.autograd.grad(call(), (q, k, v), grad_out))


def _out_of_memory(err: BaseException) -> str | None:
    """The first line of the out-of-memory error in err's chain (a compiler may wrap it), else
    None."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, torch.OutOfMemoryError):
            return (str(seen).splitlines() or ["out of memory"])[0]
        seen = seen.__cause__ or seen.__context__
    return None


def torch_cp_skip_reason(settings: Settings, world_size: int) -> str | None:
    """Why PyTorch's flex CP cannot run this job on this torch (None: it can). No collective."""
    from attngym.distributed import torch_cp as tcp

    ok, why = tcp.torch_cp_available()
    if not ok:
        return why
    block = tcp.block_size()
    if tuple(settings.block_size) != (block, block):
        return f"PyTorch's CP uses ({block}, {block}) blocks, block_size is {settings.block_size}"
    layout = settings.topology.layout
    if layout not in tcp.TORCH_LAYOUTS:
        return f"layout {layout} has no PyTorch counterpart (it has {sorted(tcp.TORCH_LAYOUTS)})"
    try:
        tcp.check_shape(settings.shape.seq_len, world_size, layout)
    except ValueError as err:
        return str(err)
    return None


def torch_cp(job: RankJob) -> dict[str, Any]:
    """PyTorch's own flex CP on the same shards, variant and group, timed like attngym, its
    output compared with attngym's on the validated rows (see the module docstring)."""
    s = job.settings
    if TORCH_CP not in s.baselines:
        return {}
    reason = torch_cp_skip_reason(s, job.world_size)
    if reason is not None:
        log.info("baseline torch_cp skipped: %s", reason)
        return {"torch_cp_status": f"skipped: {reason}"}
    from attngym.distributed.torch_cp import TorchCP

    shape = s.shape
    contender = TorchCP(
        job.variant,
        batch=shape.batch,
        heads=shape.heads,
        kv_heads=shape.kv_heads or shape.heads,
        seq_len=job.seq_len,
        layout=s.topology.layout,
        device=job.device,
        block_size=tuple(s.block_size),
        kernel_options=s.kernel_options or None,
        compile=s.compile,
        compile_mode=s.compile_mode,
    )
    do_bwd = job.do_bwd and job.device.type == "cuda"  # flex has no CPU backward
    # Flex refuses CPU inputs that require grad, even under no_grad: detached views there.
    qkv = job.qkv if do_bwd else tuple(t.detach() for t in job.qkv)

    def call() -> torch.Tensor:
        return contender(*qkv)

    with torch.no_grad():
        call()  # compiles on CUDA
    if do_bwd:
        _grads(job, call())
    metrics: dict[str, Any] = {
        "torch_cp_status": "ok",
        "torch_cp_bwd_status": "ok" if do_bwd else (NO_CPU_BWD if job.do_bwd else "not requested"),
    }
    metrics.update(_torch_cp_agreement(job, call))
    with _peak_over_ranks(job, metrics, "torch_cp_peak_mem_bytes"):
        with torch.no_grad():
            timings = {"fwd": job.timed(call)}
        if do_bwd:
            timings["fwd_bwd"] = job.timed(lambda: _grads(job, call()))  # same leaves as attngym
    for p, timing in timings.items():
        metrics[f"torch_cp_{p}_ms"] = timing.median_ms
        mine = job.timings.get(p)
        if mine is not None:
            metrics[f"attngym_over_torch_cp_{p}"] = timing.median_ms / mine.median_ms
    return metrics


def _torch_cp_agreement(job: RankJob, call: Callable[[], torch.Tensor]) -> dict[str, Any]:
    """torch_cp's output against attngym's on the validated rows, judged at the dtype's RTOL."""
    s = job.settings
    if not s.validate:
        return {"torch_cp_validation": "not run (validate=false)"}
    with torch.no_grad():
        theirs, ours = job.gather(call()), job.gather(job.attend())
    if job.rank != 0:
        return {}
    rows = sample_rows(job.seq_len, s.validate_rows, s.seed, "cpu")
    theirs, ours = theirs[:, :, rows], ours[:, :, rows]
    # Both are checked against the same tolerance attngym meets against the float64 reference:
    # two kernels each within RTOL of the truth agree within about 2 x RTOL, and a wrong mask or
    # position mapping gives errors of order 1e-1 to 1.
    limit = 2 * RTOL[s.dtype]
    err = rel_error(theirs, ours)
    verdict = "ok" if err <= limit else f"failed: torch_cp_err_out_rel={err:.3g} > {limit:g}"
    return {
        "torch_cp_err_out_rel": err,
        "torch_cp_err_out_max_abs": max_abs_error(theirs, ours),
        "torch_cp_validation": verdict if verdict == "ok" else f"{verdict} ({s.dtype})",
    }


def _fold_torch_cp_verdict(metrics: dict[str, Any]) -> None:
    """A torch_cp disagreement fails the run: attngym, PyTorch, or the comparison is wrong."""
    verdict = metrics.get("torch_cp_validation")
    if not (isinstance(verdict, str) and verdict.startswith("failed")):
        return
    own = metrics.get("validation")
    disagreement = f"attngym and torch_cp disagree: {verdict.removeprefix('failed: ')}"
    if isinstance(own, str) and own.startswith("failed"):
        metrics["validation"] = f"{own}; {disagreement}"
    else:
        metrics["validation"] = f"failed: {disagreement}"
