"""`topology=auto` (attngym.distributed.auto): simulate the candidates, price them, pick one.

Each candidate scheme and layout is simulated once on this device (cp_simulate.simulated: the
same ranks, plans and kernels a `topology.simulate=true` run of it times), and again with each
option set its simulation names as another way to run it (Simulation.extra "alternatives": the
all-gather's overlap), and priced on the run's fabric for each transport; the fastest predicted
is the pick. The run records

    auto_pick, auto_pick_ms        the pick (scheme/layout/transport) and its predicted time
    auto_runner_up, auto_runner_up_ms   the next fastest
    auto_why                       one line: the pick's time, what bounds it, the margin
    auto_candidates, auto_s        how many candidates were priced, the choice's wall time
    auto_simulated, auto_planned   simulations done of those planned (written as they go, with
    auto_best_so_far               the best so far: an interrupted choice keeps what it had)

and auto.json in the run folder holds every candidate's prediction (and why a scheme was left
out: its rules refused the run, e.g. Ulysses with more ranks than heads).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

from attngym import registry
from attngym.config import AUTO, Settings
from attngym.errors import ConfigError

log = logging.getLogger(__name__)

# Fabrics measured per transport: both are priced while the ranks fit in one NVLink domain.
MEASURED = {"h200_nvlink": ("copy_engine", "nccl"), "hgx_h200": ("copy_engine", "nccl")}


def choose(settings: Settings, run_dir: Path | None, metrics: dict[str, Any]):
    """The pick for this run: (its settings, its simulation (Simulation, Layout, variant,
    Fabric, Prediction), the simulated inputs); the choice goes into `metrics` and auto.json.

    Raises:
        ConfigError(topology.options.candidates): no candidate accepts the run.
    """
    from attngym.distributed.auto import CANDIDATES, PICK
    from attngym.distributed.layout import LAYOUTS
    from attngym.tasks.cp_setup import rank_device
    from attngym.tasks.cp_simulate import cpu_caveat, fabric_of, simulated, simulation_inputs

    start = time.perf_counter()
    topo = settings.topology
    if (caveat := cpu_caveat(settings)) is not None:
        log.warning("topology=auto: %s", caveat)
    opts = registry.get("topology", "auto").option_values(topo.options)
    device = rank_device(settings)
    inputs = simulation_inputs(settings, device)
    do_bwd = "bwd" in settings.passes
    wanted = opts["layouts"] or LAYOUTS if topo.layout == PICK else (topo.layout,)
    planned = [
        (name, layout, own)
        for name in opts["candidates"] or CANDIDATES
        for layout in wanted
        if registry.get("topology", name).takes_layout(layout)
        for own in _option_sets(name, settings)
    ]
    rows, left_out, results = [], {}, {}
    with ChoiceProgress(len(planned), metrics) as progress:
        while planned:
            name, layout, own = planned.pop(0)
            spec = registry.get("topology", name)
            label = "/".join([name, layout, *(f"{k}={v}" for k, v in own.items())])
            candidate = _candidate(settings, name, layout, topo.transport, own)
            progress.simulating(label)
            try:
                result = simulated(candidate, spec, inputs, device)
            except ConfigError as err:  # this scheme's rules refuse the run
                left_out[label] = str(err)
                progress.simulated()
                continue
            alternatives = [{**own, **alt} for alt in result[0].extra.get("alternatives", ())]
            planned[:0] = [(name, layout, alt) for alt in alternatives]
            progress.grow(len(alternatives))
            for transport in _transports(settings, opts["transports"]):
                fab = fabric_of(candidate, transport)
                prediction = spec.price(result[0], fab, do_bwd)
                ms = prediction.fwd_bwd_ms if do_bwd else prediction.fwd_ms
                rows.append((ms, label, transport, prediction, fab, (name, layout, own)))
                results[label, transport] = (*result, fab, prediction)
                progress.priced(f"{label} over {transport}", ms)
            progress.simulated()
    rows.sort(key=lambda row: row[0])
    best, second = rows[0], rows[1] if len(rows) > 1 else None
    pick = f"{best[1]}/{best[2]}"
    metrics.update(
        {
            "auto_pick": pick,
            "auto_pick_ms": best[0],
            "auto_runner_up": None if second is None else f"{second[1]}/{second[2]}",
            "auto_runner_up_ms": None if second is None else second[0],
            "auto_why": _why(best, second, bound=caveat is None),
            "prediction_refused": caveat,
            "auto_s": time.perf_counter() - start,
        }
    )
    log.info("topology=auto picked %s: %s", pick, metrics["auto_why"])
    if run_dir is not None:
        table = [
            {"scheme": n, "layout": lay, "options": own, "transport": tr, "predicted_ms": ms,
             "bottleneck": None if caveat else p.bottleneck, "time_imbalance": p.time_imbalance,
             "fabric": f.name}
            for ms, _, tr, p, f, (n, lay, own) in rows
        ]  # fmt: skip
        (Path(run_dir) / "auto.json").write_text(
            json.dumps({"pick": pick, "candidates": table, "left_out": left_out}, indent=1)
        )
    _, label, transport, _, _, (name, layout, own) = best
    picked = _candidate(settings, name, layout, transport, own)
    picked.topology.simulate = topo.simulate
    return picked, results[label, transport], inputs


class ChoiceProgress:
    """auto's progress, apart from how it prices: candidate i of N (N grows by the alternatives
    a simulation names), the best so far and the time left, on a bar or a log line each
    (attngym.progress), and in `metrics` as it goes (auto_simulated of auto_planned,
    auto_candidates, auto_best_so_far), so an interrupted run's metrics.json keeps what it had."""

    def __init__(self, planned: int, metrics: dict[str, Any]):
        from attngym.progress import Progress

        self.metrics = metrics
        self.best: tuple[float, str] | None = None
        self.bar = Progress(planned, "topology=auto candidates", line_per_step=True)
        metrics.update(auto_planned=planned, auto_simulated=0, auto_candidates=0)

    def simulating(self, label: str) -> None:
        self.bar.running(label)

    def grow(self, more: int) -> None:
        self.bar.grow(more)
        self.metrics["auto_planned"] += more

    def priced(self, label: str, ms: float) -> None:
        self.metrics["auto_candidates"] += 1
        if self.best is None or ms < self.best[0]:
            self.best = (ms, label)
            self.metrics["auto_best_so_far"] = f"{label}: {ms:.3f} ms predicted"
            self.bar.note(f"best so far {label} {ms:.3f} ms")

    def simulated(self) -> None:
        self.metrics["auto_simulated"] += 1
        self.bar.running("")
        self.bar.update()

    def __enter__(self) -> ChoiceProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.close()


def _candidate(settings: Settings, name: str, layout: str, transport: str, own) -> Settings:
    """The run's settings with topology `name`, `layout`, `transport` and its own options `own`
    (the rest at their defaults: hybrid's groups, the fabric's NVLink domain), simulated."""
    topo = dataclasses.replace(
        settings.topology, kind=name, layout=layout, transport=transport, options=dict(own),
        simulate=True,
    )  # fmt: skip
    return dataclasses.replace(settings, topology=topo)


def _option_sets(name: str, settings: Settings) -> list[dict[str, Any]]:
    """The own options tried for scheme `name`: on a fabric without NVLink domains to fix
    hybrid's groups, every group size dividing the ranks and the heads (2 .. P/2) with each
    across scheme; else the defaults."""
    from attngym.distributed.transfer_model import domain_size

    topo = settings.topology
    if name != "hybrid" or domain_size(topo.fabric) is not None:
        return [{}]
    P, heads = topo.world_size, settings.shape.heads
    sizes = [a for a in range(2, P) if P % a == 0 and heads % a == 0]
    return [{"a2a_size": a, "across": across} for a in sizes for across in ("ring", "allgather")]


def _transports(settings: Settings, given) -> tuple[str, ...]:
    """The transports to price: on real ranks only those that can run there (gloo on CPUs, the
    copy engine where ranks share a GPU); else `given`; else on a fabric measured per transport
    both measured ones while the ranks fit in one NVLink domain (NCCL beyond); else the run's."""
    from attngym.distributed.transfer_model import spans_domains

    topo = settings.topology
    if not topo.simulate and settings.device == "cpu":
        return ("gloo",)
    if not topo.simulate and topo.world_size > _gpus():  # ranks share GPUs: no NCCL group
        return ("copy_engine",)
    if given:
        return tuple(given)
    if topo.transport != AUTO or topo.fabric not in MEASURED:
        return (topo.transport,)
    return ("nccl",) if spans_domains(topo.fabric, topo.world_size) else MEASURED[topo.fabric]


def _why(best, second, *, bound: bool) -> str:
    """The pick's time, what bounds it (not on a CPU: `cpu_caveat`) and its margin."""
    ms, label, transport, prediction, fab, _ = best
    what = (
        f"{prediction.bottleneck}-bound, time imbalance {prediction.time_imbalance:.2f}"
        if bound
        else "this CPU's compute: a ranking of these candidates, no GPU's prediction"
    )
    line = f"{label} over {transport}: {ms:.3f} ms predicted on {fab.name} ({what})"
    if second is None:
        return f"{line}; the only candidate"
    margin = second[0] / ms - 1 if ms > 0 else 0.0
    return f"{line}; {margin:.1%} faster than {second[1]} over {second[2]}"


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()
