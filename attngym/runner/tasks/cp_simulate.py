"""Simulated ranks (`topology.simulate=true`): a context-parallel run on one device, predicted.

One process, one device, no process group. For topology.world_size = P ranks (2 to
config.MAX_SIMULATED_RANKS, whatever the GPUs present), attngym.distributed.model.simulate runs
every rank's exact compute one after another (the same plans, pair block masks and kernels as the
real call, identical work timed once), and attngym.distributed.model.transfer_model adds the
transfers on `topology.fabric` and each topology's overlap. The prediction is the slowest rank.

Metrics (attngym.metrics.METRICS): predicted_fwd_ms, predicted_fwd_bwd_ms (and predicted_bwd_ms,
their difference), predicted_efficiency / predicted_efficiency_fwd_bwd against the one-device call
timed in the same job (single_fwd_ms, single_fwd_bwd_ms, as the CP task times them),
rank_compute_ms_min / _max and time_imbalance (each rank's compute alone, fwd+bwd where the run
has a backward), rank_host_ms_max (the host's time to issue a rank's compute: a rank takes at
least that), predicted_peak_mem_bytes, bottleneck, fabric; bytes_moved, pairs_computed,
pairs_skipped and load_imbalance mean what they mean in a real run; predicted_torch_cp_<pass>_ms
(PyTorch's scheme: one call per rank, whole K/V shards gathered, on the placement of the fastest
of its load balancers, predicted_torch_cp_balancer; `predicted_torch_cp`) where baselines
list torch_cp;
sim_s (the simulation's wall time), sim_items and sim_timed (items of work, and how many distinct
ones were timed).

On CPU the chunk kernel is the dense reference (FlexAttention runs forward only there), so CPU
predictions test the machinery, not a GPU's times: a CPU run says so in one line
(`cpu_caveat`, also `prediction_refused`) and predicts no scaling (no bottleneck, no
efficiency).
"""

from __future__ import annotations

import functools
import logging
import time
import types
from collections.abc import Callable
from typing import Any

import torch

from attngym import timeline
from attngym.inputs import make_inputs, torch_dtype
from attngym.runner.config import AUTO, Settings
from attngym.runner.tasks.cp_setup import CPRun

log = logging.getLogger(__name__)


def fabric_of(settings: Settings, transport: str | None = None):
    """The run's Fabric (attngym.distributed.model.transfer_model.fabric), named by topology.fabric,
    for `transport` (default topology.transport; auto: the copy engine inside one NVLink
    domain, NCCL once the ranks span domains, as a real run resolves it)."""
    from attngym.distributed.model.transfer_model import fabric, spans_domains

    topo = settings.topology
    transport = topo.transport if transport is None else transport
    if transport in (AUTO, "gloo"):
        transport = "nccl" if spans_domains(topo.fabric, topo.world_size) else "copy_engine"
    return fabric(topo.fabric, transport, topo.fabric_gbps, topo.fabric_latency_us)


def cpu_caveat(settings: Settings) -> str | None:
    """On a CPU, the one line that says its predictions are no GPU's and what to run instead;
    None on a GPU. The ranks' compute is this CPU's (the dense reference kernel) and the fabric
    a GPU cluster's: their sum ranks this run's candidates, it predicts no GPU's scaling."""
    if settings.device != "cpu":
        return None
    instead = (
        "to measure CPU ranks use topology.simulate=false"
        if settings.topology.simulate
        else "the CPU ranks' own times follow"
    )
    return (
        f"device cpu is not the fabric's ({settings.topology.fabric} prices GPUs): this CPU's "
        "compute priced on a GPU fabric predicts no GPU's scaling, so no bottleneck or "
        f"efficiency is predicted; to predict GPUs run this on one (device=cuda); {instead}"
    )


def simulated(
    run: CPRun, inputs: tuple[torch.Tensor, ...], device, on_timed=None, *, timer=None, seen=None
):
    """The ranks of `run`'s scheme over topology.world_size on this device (its rules checked
    first, ConfigError naming the key): (Simulation, the Layout it ran, the variant on device).
    on_timed: called after each distinct item of work is timed (progress); timer: how items
    are timed (default: the run's benchmark timing, with topology.cuda_graph); seen: timings
    shared with other simulations on this device (simulate.Clock)."""
    from attngym.distributed.model.simulate import bench_timer, simulate
    from attngym.distributed.model.transfer_model import domain_size

    s, topo = run.settings, run.settings.topology
    run.check()
    q, k, v, grad_out = inputs
    variant = s.variant.to(device)
    # The placement a real run would use (balanced: planned for this topology's kernels).
    planning = time.perf_counter()
    layout = run.placement(variant, device)
    planned_ms = (time.perf_counter() - planning) * 1e3
    sim = simulate(
        run.spec,
        q,
        k,
        v,
        grad_out if "bwd" in s.passes else None,
        variant,
        world_size=topo.world_size,
        layout=layout,
        options=run.options,
        scheme_options=run.scheme_options,
        timer=timer or bench_timer(device, s.benchmark.warmup, s.benchmark.repeats,
                                   topo.cuda_graph),
        domain_size=domain_size(topo.fabric),
        on_timed=on_timed,
        seen=seen,
    )  # fmt: skip
    sim.extra["planning_ms"] = planned_ms
    return sim, layout, variant


def simulation_inputs(settings: Settings, device) -> tuple[torch.Tensor, ...]:
    """The run's seeded whole inputs (q, k, v, grad_out) on `device`, in the run's dtype (the
    last draw kept: a workload's batches share shape and seed, and a draw at 128K takes seconds
    on the host; read-only, as every simulation takes them)."""
    s = settings.shape
    return _inputs((s.batch, s.heads, s.kv_heads, s.seq_len, s.head_dim), settings.seed,
                   str(torch.device(device)), settings.dtype)  # fmt: skip


@functools.lru_cache(maxsize=1)
def _inputs(shape: tuple[int, ...], seed: int, device: str, dtype: str) -> tuple[torch.Tensor, ...]:
    batch, heads, kv_heads, seq_len, head_dim = shape
    drawn = make_inputs(
        types.SimpleNamespace(batch=batch, heads=heads, kv_heads=kv_heads, seq_len=seq_len,
                              head_dim=head_dim),
        seed, "cpu", torch.float32,
    )  # fmt: skip
    return tuple(t.to(device=device, dtype=torch_dtype(dtype)) for t in drawn)


def run_simulated(
    run: CPRun, kind: str, metrics: dict[str, Any], one_device: Callable[..., dict]
) -> dict[str, Any]:
    """Simulate the run's topology over topology.world_size ranks on this device; fill and
    return metrics. What the scheme computes on each rank, and how its transfers overlap, are
    its TopologySpec's (`simulate`, `price`).

    one_device: (run, kind, (q, k, v, grad_out), device, do_bwd) -> {pass: median ms} of
    the whole problem on this device (the CP task's one-device phase), {} when skipped.
    """
    settings = run.settings
    run.check()  # before the inputs are drawn
    device = run.on_rank()
    if (caveat := cpu_caveat(settings)) is not None:
        log.warning("%s", caveat)
    from attngym.progress import Progress

    with timeline.phase("inputs"):
        inputs = simulation_inputs(settings, device)
    label = f"simulated {kind} over {settings.topology.world_size} ranks: items timed"
    # the progress prints a line every 10 s when redirected: never silent
    with timeline.phase("simulate"), Progress(None, label) as bar:
        sim, layout, variant = simulated(run, inputs, device, on_timed=bar.update)
    fab = fabric_of(settings)
    prediction = run.spec.price(sim, fab, "bwd" in settings.passes)
    return simulated_metrics(
        run, kind, metrics, (sim, layout, variant, fab, prediction), inputs, one_device
    )


def simulated_metrics(run: CPRun, kind, metrics, result, inputs, one_device) -> dict[str, Any]:
    """Fill `metrics` with a simulated run's result (Simulation, Layout, variant, Fabric,
    Prediction) and, unless topology.compare_one_device is false, the one-device comparison."""
    s, topo = run.settings, run.settings.topology
    sim, layout, variant, fab, prediction = result
    device = run.on_rank()
    caveat = cpu_caveat(s)
    metrics.update(s.describe())
    metrics.update(run.metrics())
    metrics.update({"simulate": True, "fabric": fab.name})
    metrics.update(run.placement_imbalance(layout, variant, sim.sequence_shards, device))
    metrics.update(run.kv_needed(layout, variant, sim.sequence_shards, device))
    metrics.update(
        {
            "pairs_computed": sim.pairs_computed,
            "pairs_skipped": sim.pairs_skipped,
            "bytes_moved": sim.bytes_moved,
            "predicted_fwd_ms": prediction.fwd_ms,
            "predicted_bwd_ms": (
                None if prediction.fwd_bwd_ms is None else prediction.fwd_bwd_ms - prediction.fwd_ms
            ),
            "predicted_fwd_bwd_ms": prediction.fwd_bwd_ms,
            "rank_compute_ms_min": min(prediction.rank_compute_ms),
            "rank_compute_ms_max": max(prediction.rank_compute_ms),
            "rank_compute_ms": " ".join(f"{ms:.4f}" for ms in prediction.rank_compute_ms),
            "rank_host_ms_max": max(prediction.rank_host_ms, default=0.0),
            "time_imbalance": prediction.time_imbalance,
            "bottleneck": None if caveat else prediction.bottleneck,
            "prediction_refused": caveat,
            "predicted_peak_mem_bytes": sim.peak_mem_bytes,
            "sim_items": sim.items,
            "sim_timed": sim.timed,
            "sim_s": sim.wall_s,
            "planning_ms": sim.extra.get("planning_ms"),
        }
    )
    for name, theirs in prediction.contenders.items():
        metrics[f"predicted_{name}_fwd_ms"] = theirs.fwd_ms
        metrics[f"predicted_{name}_fwd_bwd_ms"] = theirs.fwd_bwd_ms
    if "torch_cp" in s.baselines:
        with timeline.phase("baseline_torch_cp"):
            metrics.update(predicted_torch_cp(run, inputs, variant, fab))
    log.info(
        "simulated %s over %d ranks: %d items, %d timed, %.1f s; predicted fwd %.3f ms, "
        "fwd+bwd %s ms (%s) on %s",
        kind,
        topo.world_size,
        sim.items,
        sim.timed,
        sim.wall_s,
        prediction.fwd_ms,
        "-" if prediction.fwd_bwd_ms is None else f"{prediction.fwd_bwd_ms:.3f}",
        "this CPU's compute: no GPU's" if caveat else f"{prediction.bottleneck}-bound",
        fab.name,
    )
    if topo.compare_one_device:
        with timeline.phase("one_device"):
            single = one_device(run, kind, inputs, device, "bwd" in s.passes)
        metrics.update(_efficiency(single, topo.world_size, None if caveat else prediction))
    return metrics


def predicted_torch_cp(run: CPRun, inputs, variant, fab) -> dict[str, Any]:
    """PyTorch's own flex CP predicted with each of its load balancers that can place the
    variant (attngym.distributed.schemes.torch_cp.BALANCERS), whatever scheme the run simulates:
    its ranks on the balancer's placement, each shard gathered whole and one call per rank over
    all keys, priced as PyTorch's scheme (allgather.simulate_torch_cp).
    predicted_torch_cp_<balancer>_<pass>_ms, the fastest as predicted_torch_cp_<pass>_ms and
    predicted_torch_cp_balancer, and why a balancer could not run
    (predicted_torch_cp_<balancer>_status)."""
    from attngym.distributed.model.simulate import bench_timer, simulate
    from attngym.distributed.model.transfer_model import domain_size
    from attngym.distributed.schemes.allgather import torch_cp_simulation
    from attngym.distributed.schemes.torch_cp import BALANCERS, balancer_layout

    s, topo = run.settings, run.settings.topology
    device = run.on_rank()
    q, k, v, grad_out = inputs
    do_bwd = "bwd" in s.passes
    spec = torch_cp_simulation()
    out: dict[str, Any] = {}
    best: tuple[float, str] | None = None
    for balancer in BALANCERS:
        try:
            layout = balancer_layout(balancer, variant, topo.world_size, s.shape.seq_len, device)
        except ValueError as err:
            out[f"predicted_torch_cp_{balancer}_status"] = f"skipped: {err}"
            continue
        sim = simulate(
            spec, q, k, v, grad_out if do_bwd else None, variant, world_size=topo.world_size,
            layout=layout, options=run.options, scheme_options={"overlap": False},
            timer=bench_timer(device, s.benchmark.warmup, s.benchmark.repeats, topo.cuda_graph),
            domain_size=domain_size(topo.fabric),
        )  # fmt: skip
        theirs = spec.price(sim, fab, do_bwd).contenders["torch_cp"]
        out[f"predicted_torch_cp_{balancer}_status"] = "ok"
        out[f"predicted_torch_cp_{balancer}_fwd_ms"] = theirs.fwd_ms
        out[f"predicted_torch_cp_{balancer}_fwd_bwd_ms"] = theirs.fwd_bwd_ms
        ms = theirs.fwd_bwd_ms if do_bwd else theirs.fwd_ms
        if best is None or ms < best[0]:
            best = (ms, balancer)
    if best is not None:
        fastest = best[1]
        out["predicted_torch_cp_balancer"] = fastest
        out["predicted_torch_cp_fwd_ms"] = out[f"predicted_torch_cp_{fastest}_fwd_ms"]
        out["predicted_torch_cp_fwd_bwd_ms"] = out[f"predicted_torch_cp_{fastest}_fwd_bwd_ms"]
    return out


def _efficiency(single: dict[str, float], world_size: int, prediction) -> dict[str, Any]:
    """single_<pass>_ms and predicted_efficiency<_pass>: (one-device time / P) / predicted time
    (None where the one-device run was skipped, or no prediction is made: None, on a CPU)."""
    metrics: dict[str, Any] = dict.fromkeys(
        ("single_fwd_ms", "predicted_efficiency", "single_fwd_bwd_ms",
         "predicted_efficiency_fwd_bwd")
    )  # fmt: skip
    predicted = (
        {} if prediction is None else {"fwd": prediction.fwd_ms, "fwd_bwd": prediction.fwd_bwd_ms}
    )
    for name, ms in single.items():
        suffix = "" if name == "fwd" else f"_{name}"
        metrics[f"single_{name}_ms"] = ms
        if predicted.get(name):
            metrics[f"predicted_efficiency{suffix}"] = (ms / world_size) / predicted[name]
    return metrics
