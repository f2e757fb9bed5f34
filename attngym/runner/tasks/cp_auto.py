"""`topology=auto` (attngym.distributed.schemes.auto): price the candidates, time the few that could
win, pick one, and keep the answer.

Each candidate scheme and layout, with and without CUDA graphs where graphs can run, is first
simulated with the model (simulate.ModelTimer: a few items of each kind timed on this device,
the rest priced from their blocks) and priced on the run's fabric for each transport (with
graphs as without where every rank is bound by its device, `_device_bound`); again with each
option set its simulation names as another way to run it (Simulation.extra "alternatives": the
all-gather's overlap). The model's best of each way of running a scheme (its options) within
SHORTLIST_MARGIN of its best (topology.options.shortlist of them at most; 0: every candidate),
each with its twin run the other way, are then simulated with every item timed, as a
`topology.simulate=true` run of them is, sharing what they have in common, and so is any other
priced CONFIRM_MARGIN under the fastest timed one, its price scaled by its way's timed over
modelled time (`_confirm`); the fastest timed is the pick. On a workload every candidate is
priced on PROBES batches, those that could win are timed on the typical one and each one's
prices scaled by its timed over modelled time there, and those within REACH of the best are
priced on the other batches.
The answer is kept in a table in the cache folder keyed by the question (`question`: the
variant and its code, shape, P, fabric, transport, device), so asking again takes it from there
(topology.options.reuse=false asks afresh). The run records

    auto_pick, auto_pick_ms        the pick (scheme/layout/transport[/cuda_graph]), its time
    auto_runner_up, auto_runner_up_ms   the next fastest
    auto_why                       one line: the pick's time, what bounds it, the margin
    auto_candidates, auto_s        how many candidates were priced, the choice's wall time
    auto_timed                     how many of them were simulated with every item timed
    auto_cached                    when the answer came from the table: when it was asked
    auto_simulated, auto_planned   simulations done of those planned (written as they go, with
    auto_best_so_far               the best so far: an interrupted choice keeps what it had)

and auto.json in the run folder holds every candidate's prediction (the model's and, for those
timed, the timed one) and why a scheme was left out (its rules refused the run, e.g. Ulysses
with more ranks than heads).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any

from attngym import registry
from attngym.errors import ConfigError
from attngym.runner.config import AUTO, Settings
from attngym.runner.tasks.cp_setup import CPRun

log = logging.getLogger(__name__)

# Candidates the model prices this close to its best are timed first; any it prices under the
# fastest timed one are timed after them (`_confirm`), as its error differs from one scheme to
# another.
SHORTLIST_MARGIN = 0.15
# An untimed candidate the model prices this much under the fastest timed one is timed too: a
# pick within it of every candidate is a tie.
CONFIRM_MARGIN = 0.05
# On a workload every candidate is priced on PROBES batches and those that could win are timed
# on one of them; then only those whose price over the probes (scaled by the timing where there
# is one) is within REACH times the best's are priced on the others (_within_reach).
PROBES = 3
REACH = 1.25
# The answers asked before, in the cache folder (attngym.compile_cache.root).
ANSWERS = "auto_answers.json"


@dataclasses.dataclass
class Priced:
    """A candidate priced over one transport: the model's time, then the timed one (None until
    its simulation has timed every item)."""

    scheme: str
    layout: str
    own: dict[str, Any]
    cuda_graph: bool
    transport: str
    model_ms: float
    result: tuple | None = None  # (Simulation, Layout, variant, Fabric, Prediction)
    timed_ms: float | None = None
    twin_of: dict[str, Any] | None = None
    """The options of the call this row runs another way (Simulation.extra "alternatives":
    the all-gather's overlap flipped), None for the way its scheme takes by itself."""

    @property
    def label(self) -> str:
        parts = [self.scheme, self.layout, *(f"{k}={v}" for k, v in self.own.items())]
        return "/".join(parts + ["cuda_graph"] * self.cuda_graph)

    @property
    def ms(self) -> float:
        return self.model_ms if self.timed_ms is None else self.timed_ms

    @property
    def candidate(self) -> tuple:
        return self.scheme, self.layout, json.dumps(self.own, sort_keys=True), self.cuda_graph

    @property
    def way(self) -> tuple:
        """The scheme and its options: rows the model errs on alike (the same kinds of item)."""
        return self.scheme, json.dumps(self.own, sort_keys=True)

    @property
    def call(self) -> tuple:
        """The scheme, layout and options it runs by itself: a row and its twins share it."""
        own = self.own if self.twin_of is None else self.twin_of
        return self.scheme, self.layout, json.dumps(own, sort_keys=True)

    def twins(self, other: Priced) -> bool:
        """Whether `other` is this call run the other way its scheme names (twin_of)."""
        same = (self.call, self.cuda_graph) == (other.call, other.cuda_graph)
        return same and self.own != other.own


def choose(settings: Settings, run_dir: Path | None, metrics: dict[str, Any]):
    """The pick for this run: (its settings, its simulation (Simulation, Layout, variant,
    Fabric, Prediction) or None where the answer came from the table, the simulated inputs or
    None); the choice goes into `metrics` and auto.json.

    Raises:
        ConfigError(topology.options.candidates): no candidate accepts the run.
    """
    from attngym.runner.tasks.cp_simulate import cpu_caveat

    start = time.perf_counter()
    caveat = cpu_caveat(settings)
    run = CPRun.of(settings)
    run.check()  # options.layouts against the variant, before any input is drawn
    opts = run.scheme_options
    key, asked, answer = _asked(settings, opts, metrics)
    if caveat is not None and not (answer and settings.topology.simulate):  # else its run says it
        log.warning("topology=auto: %s", caveat)
    if answer is not None:
        return _given(settings, answer, metrics, start, run_dir), None, None
    rows, left_out, inputs = _priced(run, metrics)
    best = rows[0]
    second, second_ms = _runner_up(best, rows)
    timed = {r.candidate for r in rows if r.timed_ms is not None}
    metrics.update(
        {
            "auto_pick": f"{best.label}/{best.transport}",
            "auto_pick_ms": best.ms,
            "auto_runner_up": None if second is None else f"{second.label}/{second.transport}",
            "auto_runner_up_ms": second_ms,
            "auto_why": _why(best, second, second_ms, bound=caveat is None),
            "auto_timed": len(timed),
            "auto_cached": None,
            "prediction_refused": caveat,
        }
    )
    metrics["auto_s"] = time.perf_counter() - start
    log.info("topology=auto picked %s: %s", metrics["auto_pick"], metrics["auto_why"])
    table = {
        "pick": metrics["auto_pick"],
        "candidates": [
            {"scheme": r.scheme, "layout": r.layout, "options": r.own,
             "cuda_graph": r.cuda_graph, "transport": r.transport, "predicted_ms": r.ms,
             "model_ms": r.model_ms, "timed_ms": r.timed_ms,
             "bottleneck": None if caveat or r.result is None else r.result[4].bottleneck,
             "time_imbalance": None if r.result is None else r.result[4].time_imbalance}
            for r in rows
        ],
        "left_out": left_out,
    }  # fmt: skip
    _write_table(run_dir, table)
    pick = (best.scheme, best.layout, best.transport, best.own, best.cuda_graph)
    kept = [
        "auto_pick", "auto_pick_ms", "auto_runner_up", "auto_runner_up_ms", "auto_why",
        "auto_timed", "auto_candidates", "prediction_refused",
    ]  # fmt: skip
    _keep_answer(key, asked, pick, {k: metrics.get(k) for k in kept}, table)
    return _picked(settings, *pick), best.result, inputs


def _priced(run: CPRun, metrics: dict[str, Any]):
    """Every candidate priced by the model, then the shortlist timed: (the rows, fastest
    first; the schemes left out and why; the simulated inputs)."""
    settings, opts = run.settings, run.scheme_options
    pricing = Pricing(run)
    with ChoiceProgress(pricing.planned_count(settings), metrics) as progress:
        rows, left_out = pricing.modelled(settings, progress)
        pricing.timed(settings, _shortlist(rows, opts["shortlist"]), rows, progress)
        _confirm(rows, lambda row: pricing.timed(settings, [row], rows, progress),
                 cost=_scaled_by_way(rows))  # fmt: skip
    timed = [r for r in rows if r.timed_ms is not None]
    rows = sorted(timed, key=lambda r: r.ms) + sorted(
        (r for r in rows if r.timed_ms is None), key=lambda r: r.ms
    )
    return rows, left_out, pricing.inputs


class Pricing:
    """What pricing candidates on this device shares, from one run's settings to the next of
    the same shape (a workload's batches): the inputs, the model's fit and the timings taken.
    `run`: the auto run (its options are auto's)."""

    def __init__(self, run: CPRun):
        from attngym.distributed.model.simulate import ModelTimer, bench_timer
        from attngym.runner.tasks.cp_simulate import simulation_inputs

        settings, opts = run.settings, run.scheme_options
        self.opts, bench = opts, settings.benchmark
        self.device = run.on_rank()
        self.inputs = simulation_inputs(settings, self.device)
        self.graphs = _graph_choices(settings, opts)
        model = ModelTimer(bench_timer(self.device, bench.warmup, bench.repeats))
        self.models = {False: model, True: model.with_graphs()}
        self.seen: dict[bool, dict] = {False: model.measured, True: {}}

    def planned(self, settings: Settings) -> list[tuple[str, str, dict[str, Any]]]:
        from attngym.distributed.placement.layout import PICKED_LAYOUTS, applies
        from attngym.distributed.schemes.auto import PICK
        from attngym.distributed.schemes.topologies import TOPOLOGIES

        pickable = [name for name, spec in TOPOLOGIES.items() if spec.pickable]  # table order

        layout = settings.topology.layout
        wanted = self.opts["layouts"] or PICKED_LAYOUTS if layout == PICK else (layout,)
        if wanted is PICKED_LAYOUTS:  # those that can place this variant (documents: its lengths)
            wanted = [each for each in wanted if applies(each, settings.variant)]
        return [
            (name, layout, own)
            for name in self.opts["candidates"] or pickable
            for layout in wanted
            if registry.get("topology", name).takes_layout(layout)
            for own in registry.get("topology", name).options_to_try(
                settings.topology, settings.shape
            )
        ]

    def planned_count(self, settings: Settings) -> int:
        return len(self.planned(settings)) * len(self.graphs)

    def price(self, settings: Settings, row_of, result, graph) -> list[Priced]:
        """A simulated candidate priced over each transport."""
        from attngym.runner.tasks.cp_simulate import fabric_of

        made = []
        for transport in _transports(settings, self.opts["transports"]):
            name, layout, own = row_of
            fab = fabric_of(_candidate(settings, name, layout, transport, graph, own), transport)
            prediction = registry.get("topology", name).price(
                result[0], fab, "bwd" in settings.passes
            )
            ms = prediction.fwd_bwd_ms if "bwd" in settings.passes else prediction.fwd_ms
            made.append(Priced(*row_of, graph, transport, ms, (*result, fab, prediction)))
        return made

    def modelled(self, settings: Settings, progress: ChoiceProgress, only: set | None = None):
        """Every candidate simulated with the model and priced: (rows, left out and why).
        `only`: the calls (Priced.call) to simulate, None for all."""
        from attngym.runner.tasks.cp_simulate import simulated

        planned, rows, left_out = self.planned(settings), [], {}
        twin_of: dict[tuple, dict[str, Any]] = {}  # an alternative's (name, layout, own): own's
        while planned:
            name, layout, own = planned.pop(0)
            twin = twin_of.get((name, layout, json.dumps(own, sort_keys=True)))
            call = (name, layout, json.dumps(own if twin is None else twin, sort_keys=True))
            if only is not None and call not in only:
                progress.grow(-len(self.graphs))  # its alternatives were never planned
                continue
            plain: list[Priced] = []  # this candidate's rows without graphs
            for graph in self.graphs:
                if graph and plain and all(map(_device_bound, plain)):
                    rows += [dataclasses.replace(r, cuda_graph=True) for r in plain]
                    progress.grow(-1)  # priced without simulating
                    continue
                candidate = _candidate(settings, name, layout, settings.topology.transport,
                                       graph, own)  # fmt: skip
                label = Priced(name, layout, own, graph, "", 0.0).label
                progress.simulating(f"{label} (model)")
                try:
                    result = simulated(CPRun.of(candidate), self.inputs, self.device,
                                       timer=self.models[graph])  # fmt: skip
                except ConfigError as err:  # this scheme's rules refuse the run
                    left_out[label] = str(err)
                    progress.simulated()
                    continue
                except RuntimeError as err:  # CUDA refusing to capture the call
                    if not graph or "captur" not in str(err):
                        raise
                    left_out[label] = f"cannot be captured as a CUDA graph: {err}"
                    progress.simulated()
                    continue
                if not graph and twin is None:
                    alternatives = [{**own, **a} for a in result[0].extra.get("alternatives", ())]
                    planned[:0] = [(name, layout, alt) for alt in alternatives]
                    twin_of.update({(name, layout, json.dumps(a, sort_keys=True)): own
                                    for a in alternatives})  # fmt: skip
                    progress.grow(len(alternatives) * len(self.graphs))
                for row in self.price(settings, (name, layout, own), result, graph):
                    row.twin_of = twin
                    rows.append(row)
                    if not graph:
                        plain.append(row)
                    progress.priced(f"{row.label} over {row.transport}", row.ms)
                progress.simulated()
        if not rows:
            raise ConfigError(
                "topology.options.candidates",
                "no candidate accepts this run: "
                + "; ".join(f"{k}: {v}" for k, v in left_out.items()),
            )
        return rows, left_out

    def timed(self, settings: Settings, shortlist, rows, progress: ChoiceProgress) -> None:
        """The shortlisted candidates simulated with every item timed; their rows (in `rows`)
        get the timed result and time."""
        from attngym.distributed.model.simulate import bench_timer
        from attngym.runner.tasks.cp_simulate import simulated

        bench = settings.benchmark
        for row in shortlist:
            name, layout, own, graph = row.scheme, row.layout, row.own, row.cuda_graph
            candidate = _candidate(settings, name, layout, settings.topology.transport, graph,
                                   own)  # fmt: skip
            progress.timing(f"{row.label} (timed)")
            timer = bench_timer(self.device, bench.warmup, bench.repeats, graph)
            result = simulated(CPRun.of(candidate), self.inputs, self.device, timer=timer,
                               seen=self.seen[graph])  # fmt: skip
            for timed in self.price(settings, (name, layout, own), result, graph):
                same = next(r for r in rows if (r.candidate, r.transport)
                            == (timed.candidate, timed.transport))  # fmt: skip
                same.result, same.timed_ms = timed.result, timed.model_ms
                progress.priced(f"{same.label} over {same.transport}, timed", same.ms, again=True)
            progress.simulated()


def choose_for_workload(settings: Settings, run_dir: Path | None, metrics: dict[str, Any]):
    """One pick for a whole workload, as a job fixes its scheme at launch: every candidate
    priced by the model on the probe batches (_probes), those that could win there timed on
    the typical probe and every price of theirs scaled by it (_WorkloadPrices), those within
    reach of the best on the probes (_within_reach) priced on the other batches (the model's
    fit and timings shared by the batches), any that could still win over the whole workload
    timed too, the pick the least total time; `auto_dynamic_gain` is what picking per
    batch would save against it, net of the planning each switch of scheme costs (the new
    pick's placement on that batch), with `auto_dynamic_switches` and `auto_dynamic_cost_ms`.
    The settings with the pick; the answer is kept as `choose` keeps one."""
    from attngym.runner.config import workload_batches
    from attngym.runner.tasks.cp_simulate import cpu_caveat
    from attngym.runner.tasks.workloads import batch_settings

    start = time.perf_counter()
    run = CPRun.of(settings)
    run.check()  # options.layouts against the variant, before any input is drawn
    opts = run.scheme_options
    key, asked, answer = _asked(settings, opts, metrics)
    if answer is not None:
        return _given(settings, answer, metrics, start, run_dir)
    data = {"workload": dataclasses.asdict(settings.workload),
            "shape": {"seq_len": settings.shape.seq_len}}  # fmt: skip
    lengths = workload_batches(data)
    batches = [batch_settings(settings, docs, i) for i, docs in enumerate(lengths)]
    pricing = Pricing(run)  # what it shares is the same for every batch
    n = len(batches)
    per_batch: list[dict[tuple, Priced]] = [{} for _ in range(n)]
    probes = _probes(lengths)
    prices = _WorkloadPrices(per_batch)
    kept = None  # after the probes, where batches are left: the calls still in
    with ChoiceProgress(pricing.planned_count(batches[0]) * n, metrics) as progress:
        for i in [*probes, *(i for i in range(n) if i not in probes)]:
            rows, _ = pricing.modelled(batches[i], progress, only=kept)
            per_batch[i] = {(r.candidate, r.transport): r for r in rows}
            if kept is None and len(probes) < n and all(per_batch[j] for j in probes):
                on_probes = _every(per_batch, probes)
                prices.time_those_that_could_win(
                    pricing, batches, on_probes, progress, opts["shortlist"], over=probes
                )
                kept = _within_reach([per_batch[j] for j in probes], prices.ratios())
        every = _every(per_batch, range(n))
        if kept is None:  # every batch a probe: the shortlist over them all
            prices.time_those_that_could_win(pricing, batches, every, progress, opts["shortlist"])
        else:  # the shortlist was timed on a probe: any other that could win over the workload
            prices.confirm(pricing, batches, every, progress)
    cost, total, at, ratios = prices.cost, prices.total, prices.at, prices.ratios()
    totals = sorted(every, key=total)
    static_ms = total(totals[0])
    # Per batch, the best of those priced on every batch (the table's): a probe's pruned ones
    # and an option offered on some batches only (the overlap, where a batch reads other ranks)
    # have no price over the workload.
    best = [per_batch[i][min(every, key=lambda k, i=i: cost(i, k))] for i in range(n)]
    switches = [b for i, b in enumerate(best) if i and b.candidate != best[i - 1].candidate]
    cost_ms = sum(b.result[0].extra.get("planning_ms", 0.0) for b in switches)
    dynamic_ms = sum(cost(i, (b.candidate, b.transport)) for i, b in enumerate(best)) + cost_ms
    pick, second = per_batch[0][totals[0]], per_batch[0][totals[1]] if len(totals) > 1 else None
    timed = {r.candidate for r in per_batch[at].values() if r.timed_ms is not None}
    metrics.update(
        {
            "auto_pick": f"{pick.label}/{pick.transport}",
            "auto_pick_ms": static_ms / n,
            "auto_runner_up": None if second is None else f"{second.label}/{second.transport}",
            "auto_runner_up_ms": None if second is None else total(totals[1]) / n,
            "auto_why": f"the least predicted time over the workload's {n} batches, "
            f"{static_ms / n:.3f} ms a batch (the model's, scaled by the timed over modelled "
            f"time on batch {at} of each way of the {len(timed)} candidates timed there)",
            "auto_timed": len(timed),
            "auto_cached": None,
            "auto_dynamic_gain": 1 - dynamic_ms / static_ms if static_ms else None,
            "auto_dynamic_switches": len(switches),
            "auto_dynamic_cost_ms": cost_ms,
            "prediction_refused": cpu_caveat(settings),
        }
    )  # fmt: skip
    metrics["auto_s"] = time.perf_counter() - start
    log.info("topology=auto picked %s for the workload: %s; picking per batch would save %.1f %%",
             metrics["auto_pick"], metrics["auto_why"],
             100 * (metrics["auto_dynamic_gain"] or 0.0))  # fmt: skip
    table = {
        "pick": metrics["auto_pick"],
        "candidates": [
            {"scheme": r.scheme, "layout": r.layout, "options": r.own,
             "cuda_graph": r.cuda_graph, "transport": r.transport,
             "predicted_ms": total(k) / n,
             "model_ms": sum(rows[k].model_ms for rows in per_batch) / n,
             "timed_over_model": ratios.get(k), "batches_ms": [cost(i, k) for i in range(n)]}
            for k in totals for r in (per_batch[0][k],)
        ],
        "timed_on_batch": at,
        "per_batch_best": [f"{b.label}/{b.transport}" for b in best],
        "probe_batches": probes,
        "left_after_probes": sorted({f"{r.label}/{r.transport}" for j in probes
                                     for r in per_batch[j].values()
                                     if kept is not None and r.call not in kept}),
    }  # fmt: skip
    _write_table(run_dir, table)
    chosen = (pick.scheme, pick.layout, pick.transport, pick.own, pick.cuda_graph)
    kept = [k for k in metrics if k.startswith("auto_") and k not in ("auto_s", "auto_cached")]
    _keep_answer(key, asked, chosen, {k: metrics[k] for k in kept}, table)
    return _picked(settings, *chosen)


def _probes(lengths: list[tuple[int, ...]]) -> list[int]:
    """The batches every candidate is priced on (PROBES of them): the least, the median and the
    most causal work (the sum of squared document lengths), a workload's range."""
    order = sorted(range(len(lengths)), key=lambda i: sum(n * n for n in lengths[i]))
    if len(order) <= PROBES:
        return order
    return sorted({order[0], order[len(order) // 2], order[-1]})


def _every(per_batch: list[dict[tuple, Priced]], batches) -> list[tuple]:
    """The (candidate, transport) keys priced on every one of `batches`; ConfigError if none."""
    first, *rest = (per_batch[i] for i in batches)
    every = [k for k in first if all(k in rows for rows in rest)]
    if not every:
        raise ConfigError("topology.options.candidates",
                          "no candidate accepts every batch of the workload")  # fmt: skip
    return every


def _within_reach(probed: list[dict[tuple, Priced]], factor: dict[tuple, float]) -> set[tuple]:
    """The calls (Priced.call) that stay in after the probe batches: those with a row whose
    price over the probes (the model's, times the timed over modelled time `factor` has for
    it: _WorkloadPrices.ratios) is at most REACH times the best's, with their twins. The
    timing took out each timed way's error (0.62-1.42 on an H100); what is left is its change
    from batch to batch (the all-gather 1.29-1.50 over 16 batches, Ulysses 0.94-1.06) and the
    error of the ways left untimed, each priced above the best timed one (_confirm), which
    timed at least 0.94 of the model's price on the GPU (Ulysses, the hybrid, the ring, the
    plain all-gather) but for the all-gather's overlap (0.62-0.92 before its parts were priced
    apart), timed with its twin: REACH leaves out what that could not bring back."""
    totals: dict[tuple, float] = {}
    for k in probed[0]:
        if all(k in rows for rows in probed):
            totals[k] = sum(rows[k].model_ms for rows in probed) * factor.get(k, 1.0)
    if not totals:
        return {r.call for rows in probed for r in rows.values()}
    best = min(totals.values())
    return {probed[0][k].call for k, total in totals.items() if total <= best * REACH}


@dataclasses.dataclass
class _WorkloadPrices:
    """Each candidate's price on each batch of a workload (`per_batch`: (candidate, transport)
    -> Priced): timed where it was, else the model's, scaled by its timed over modelled time
    on batch `at` (_ratio: its own, else its way's)."""

    per_batch: list[dict[tuple, Priced]]
    at: int | None = None
    # ratios() until the next timing (_time)
    _ratios: dict[tuple, float] | None = dataclasses.field(default=None, init=False, repr=False)

    def ratios(self) -> dict[tuple, float]:
        """The timed over modelled time of each candidate with one on batch `at` (_ratio)."""
        if self._ratios is None:
            typical = [] if self.at is None else list(self.per_batch[self.at].values())
            made = {(r.candidate, r.transport): _ratio(typical, r) for r in typical}
            self._ratios = {k: ratio for k, ratio in made.items() if ratio is not None}
        return self._ratios

    def cost(self, i: int, k: tuple) -> float:
        row = self.per_batch[i][k]
        return (
            row.timed_ms if row.timed_ms is not None else row.model_ms * self.ratios().get(k, 1.0)
        )

    def total(self, k: tuple, over=None) -> float:
        """`k`'s price summed over the batches `over` (default: all)."""
        return sum(self.cost(i, k) for i in range(len(self.per_batch)) if over is None or i in over)

    def time_those_that_could_win(
        self, pricing, batches, every, progress, most: int, over=None
    ) -> None:
        """The model's error differs from scheme to scheme, little from batch to batch: the
        candidates that could win over the batches `over` (default: all; the model's shortlist
        over their totals, then every one priced under the fastest timed, `confirm`) are timed
        on one typical batch, the median of those batches' best prices."""
        over = range(len(self.per_batch)) if over is None else over
        best = {i: min(r.model_ms for r in self.per_batch[i].values()) for i in over}
        self.at = sorted(best, key=best.__getitem__)[len(best) // 2]
        typical = self.per_batch[self.at]
        by_total = [dataclasses.replace(typical[k], model_ms=self.total(k, over)) for k in every]
        for row in _shortlist(by_total, most):
            self._time(pricing, batches, row, progress)
        self.confirm(pricing, batches, every, progress, over)

    def confirm(self, pricing, batches, every, progress, over=None) -> None:
        """Every candidate whose total over `over` (default: all), scaled where timed, is
        under the fastest timed one's is timed on the typical batch (margin 0: the pick is the
        least total, and it must be a timed one)."""
        typical = self.per_batch[self.at]
        _confirm(
            [typical[k] for k in every],
            lambda row: self._time(pricing, batches, row, progress),
            cost=lambda r: self.total((r.candidate, r.transport), over),
            margin=0.0,
        )

    def _time(self, pricing, batches, row: Priced, progress) -> None:
        typical = self.per_batch[self.at]
        pricing.timed(batches[self.at], [typical[row.candidate, row.transport]],
                      list(typical.values()), progress)  # fmt: skip
        self._ratios = None


def _device_bound(row: Priced) -> bool:
    """Whether CUDA graphs would leave this candidate's price as it is, so that its price
    without them is its price with them: every rank's device timeline at least its host's time
    and at least the host's time with graphs (one replay an item, bounded by every item of the
    simulation's). Graphs change only the host's time (simulate.ModelTimer.with_graphs)."""
    from attngym.distributed.model.simulate import GRAPH_REPLAY_MS

    sim, prediction = row.result[0], row.result[4]
    with_graphs = sim.items * GRAPH_REPLAY_MS
    return bool(prediction.rank_device_ms) and all(
        device >= max(host, with_graphs)
        for device, host in zip(prediction.rank_device_ms, prediction.rank_host_ms, strict=True)
    )


def _shortlist(rows: list[Priced], most: int) -> list[Priced]:
    """The candidates to time (each one's fastest transport): the model's best of each way of
    running a scheme (Priced.way) within SHORTLIST_MARGIN of its best, `most` of them at most
    (0: every candidate), each with its twin (Priced.twins). One of a way is enough: its
    layouts and graphs share its error, which the confirmation scales by (_scaled_by_way); a
    twin is not, as the model ranks the two ways of one call wrongly (on an H100, the
    overlapped all-gather timed 0.66-0.91 times its price on a window, the plain one 1.13-1.14
    times on documents: the model had put the slower of the two first on both)."""
    fastest: dict[tuple, Priced] = {}
    for row in sorted(rows, key=lambda r: r.model_ms):
        fastest.setdefault(row.candidate, row)
    ordered = list(fastest.values())
    if most == 0:
        return ordered
    bound = ordered[0].model_ms * (1 + SHORTLIST_MARGIN)
    ways: dict[tuple, Priced] = {}
    for row in ordered:
        if row.model_ms <= bound:
            ways.setdefault(row.way, row)
    chosen = list(ways.values())[:most]
    for row in list(chosen):
        chosen += [t for t in ordered if row.twins(t) and all(t is not c for c in chosen)]
    return chosen


def _ratio(rows: list[Priced], row: Priced) -> float | None:
    """The timed over modelled time to scale `row`'s model price by: its own where it was
    timed, else the mean of its way's timed `rows` (its layouts and graphs share the way's
    error), None where none of its way was."""
    if row.timed_ms is not None and row.model_ms > 0:
        return row.timed_ms / row.model_ms
    ratios = [r.timed_ms / r.model_ms for r in rows
              if r.way == row.way and r.timed_ms is not None and r.model_ms > 0]  # fmt: skip
    return sum(ratios) / len(ratios) if ratios else None


def _scaled_by_way(rows: list[Priced]):
    """A row's price for _confirm: its timing, else the model's scaled by its way's (_ratio;
    1 where none of its way was timed)."""

    def cost(row: Priced) -> float:
        if row.timed_ms is not None:
            return row.timed_ms
        return row.model_ms * (_ratio(rows, row) or 1.0)

    return cost


def _confirm(
    rows: list[Priced], time_one, cost=lambda row: row.ms, margin: float = CONFIRM_MARGIN
) -> None:
    """Time candidates until none left untimed costs `margin` less than the fastest timed one
    (`cost`: default the timed time, else the model's), the cheapest first (`time_one(row)`
    times every transport of its candidate). The model's error differs from one scheme to
    another (on a workload of packed documents the all-gather timed 1.29-1.50 times its
    price, Ulysses 0.94-1.06 times), so a shortlist by the model alone can leave out the
    fastest."""
    done: set[tuple] = set()
    while True:
        timed = [cost(r) for r in rows if r.timed_ms is not None]
        left = [r for r in rows if r.timed_ms is None and r.candidate not in done]
        if not timed or not left:
            return
        cheapest = min(left, key=cost)
        if cost(cheapest) >= min(timed) * (1 - margin):
            return
        done.add(cheapest.candidate)
        time_one(cheapest)


def _graph_choices(settings: Settings, opts: dict[str, Any]) -> tuple[bool, ...]:
    """With and without CUDA graphs where graphs can run (CUDA, and a transport on the device:
    not gloo's host copies between real ranks); topology.cuda_graph=true asks for graphs only;
    topology.options.cuda_graphs narrows it."""
    topo = settings.topology
    if topo.cuda_graph:
        return (True,)
    can = settings.device == "cuda" and (topo.simulate or topo.transport != "gloo")
    wanted = tuple(opts["cuda_graphs"]) or (False, True)
    return tuple(g for g in wanted if can or not g) or (False,)


def question(settings: Settings, metrics: dict[str, Any]) -> dict[str, Any]:
    """What an answer of auto depends on: the variant (its config entry and the fingerprint of
    the user's code it names), shape, dtype, passes, kernels, the topology's keys, attngym's
    and torch's versions and this device."""
    import torch

    import attngym
    from attngym.device import device_info

    topo = settings.topology
    return {
        "attention": settings.attention,
        "workload": dataclasses.asdict(settings.workload),
        "code": metrics.get("code_fingerprint"),
        "shape": dataclasses.asdict(settings.shape),
        "dtype": settings.dtype,
        "passes": list(settings.passes),
        "block_size": list(settings.block_size),
        "kernel_options": settings.kernel_options,
        "compile": [settings.compile, settings.compile_mode],
        "topology": {
            "world_size": topo.world_size, "transport": topo.transport, "layout": topo.layout,
            "options": {k: v for k, v in topo.options.items() if k != "reuse"},
            "simulate": topo.simulate, "fabric": topo.fabric, "gbps": topo.fabric_gbps,
            "latency_us": topo.fabric_latency_us, "cuda_graph": topo.cuda_graph,
        },
        "versions": [attngym.__version__, torch.__version__],
        "device": {k: v for k, v in device_info(settings.device).items()
                   if k in ("name", "capability", "count", "cuda")},
    }  # fmt: skip


def _asked(settings: Settings, opts: dict[str, Any], metrics: dict[str, Any]):
    """(the question's key, the question, its kept answer or None: none with
    topology.options.reuse=false)."""
    asked = question(settings, metrics)
    key = hashlib.sha256(json.dumps(asked, sort_keys=True).encode()).hexdigest()[:16]
    return key, asked, _answers().get(key) if opts["reuse"] else None


def _given(settings, answer, metrics, start: float, run_dir: Path | None) -> Settings:
    """The settings with a kept answer's pick; its metrics and table are the run's, said."""
    metrics.update(answer["metrics"], auto_cached=answer["asked"])
    metrics["auto_s"] = time.perf_counter() - start
    log.info("topology=auto picked %s: the answer asked on %s, kept in %s (%s)",
             answer["metrics"]["auto_pick"], answer["asked"], _answers_path(),
             answer["metrics"]["auto_why"])  # fmt: skip
    _write_table(run_dir, answer["table"])
    return _picked(settings, *answer["pick"])


def _answers_path() -> Path:
    from attngym import compile_cache

    return compile_cache.root() / ANSWERS


def _answers() -> dict[str, Any]:
    """The table of answers asked before ({} where there is none or it cannot be read)."""
    try:
        table = json.loads(_answers_path().read_text())
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}


def _keep_answer(key: str, asked: dict, pick: tuple, metrics: dict, table: dict) -> None:
    """Add this answer to the table (atomically: a run reading it sees the old or the new)."""
    from attngym.fileio import atomic_write

    answers = _answers()
    answers[key] = {
        "asked": datetime.datetime.now().isoformat(timespec="seconds"),
        "question": asked,
        "pick": list(pick),
        "metrics": metrics,
        "table": table,
    }
    try:
        _answers_path().parent.mkdir(parents=True, exist_ok=True)
        atomic_write(_answers_path(), json.dumps(answers, indent=1, default=str))
    except OSError as err:  # a cache that cannot be written costs the next run its time only
        log.warning("topology=auto: the answer is not kept (%s)", err)


def _write_table(run_dir: Path | None, table: dict[str, Any]) -> None:
    if run_dir is not None:
        (Path(run_dir) / "auto.json").write_text(json.dumps(table, indent=1))


def _picked(settings, name, layout, transport, own, cuda_graph) -> Settings:
    """The run's settings with the pick, as the run itself takes them."""
    picked = _candidate(settings, name, layout, transport, cuda_graph, own)
    picked.topology.simulate = settings.topology.simulate
    return picked


class ChoiceProgress:
    """auto's progress, apart from how it prices: candidate i of N (N grows by the alternatives
    a simulation names), the best so far and the time left, on a bar or a log line each
    (attngym.progress), and in `metrics` as it goes (auto_simulated of auto_planned,
    auto_candidates, auto_best_so_far), so an interrupted run's metrics.json keeps what it had."""

    def __init__(self, planned: int, metrics: dict[str, Any]):
        from attngym.progress import Progress

        self.metrics = metrics
        self.best: tuple[float, str] | None = None
        self.timing_started = False
        self.bar = Progress(planned, "topology=auto candidates", line_per_step=True)
        metrics.update(auto_planned=planned, auto_simulated=0, auto_candidates=0)

    def simulating(self, label: str) -> None:
        self.bar.running(label)

    def timing(self, label: str) -> None:
        """A candidate simulated again with every item timed: one more step; the best so far
        is then the best timed."""
        if not self.timing_started:
            self.timing_started, self.best = True, None
        self.grow(1)
        self.bar.running(label)

    def grow(self, more: int) -> None:
        self.bar.grow(more)
        self.metrics["auto_planned"] += more

    def priced(self, label: str, ms: float, *, again: bool = False) -> None:
        """A candidate priced; `again`: one priced before, now timed (counted once)."""
        self.metrics["auto_candidates"] += not again
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


def _candidate(settings: Settings, name, layout, transport, cuda_graph, own) -> Settings:
    """The run's settings with topology `name`, `layout`, `transport`, `cuda_graph` and its own
    options `own` (the rest at their defaults: hybrid's groups, the fabric's domain), simulated."""
    topo = dataclasses.replace(
        settings.topology, kind=name, layout=layout, transport=transport, options=dict(own),
        cuda_graph=cuda_graph, simulate=True,
    )  # fmt: skip
    return dataclasses.replace(settings, topology=topo)


def _transports(settings: Settings, given) -> tuple[str, ...]:
    """The transports to price: on real ranks only those that can run there (gloo on CPUs, the
    copy engine where ranks share a GPU); else `given`; else on a fabric measured per transport
    both measured ones while the ranks fit in one NVLink domain (NCCL beyond); else the run's."""
    from attngym.distributed.model.transfer_model import MEASURED_FABRICS, spans_domains

    topo = settings.topology
    if not topo.simulate and settings.device == "cpu":
        return ("gloo",)
    if not topo.simulate and topo.world_size > _gpus():  # ranks share GPUs: no NCCL group
        return ("copy_engine",)
    if given:
        return tuple(given)
    if topo.transport != AUTO or topo.fabric not in MEASURED_FABRICS:
        return (topo.transport,)
    if spans_domains(topo.fabric, topo.world_size):
        return ("nccl",)
    return MEASURED_FABRICS[topo.fabric]


def _runner_up(best: Priced, rows: list[Priced]) -> tuple[Priced | None, float | None]:
    """The next candidate after the pick (`rows`: timed first, fastest first) and its time in
    the pick's currency: its timing where it was timed, else the model's price scaled by the
    pick's timed over modelled time (what slowed the pick's timing, a busy machine, slows
    the others alike); never a timing beside a model's price."""
    second = next((r for r in rows if r.candidate != best.candidate), None)
    if second is None:
        return None, None
    if second.timed_ms is not None or best.timed_ms is None or best.model_ms <= 0:
        return second, second.ms
    return second, second.model_ms / best.model_ms * best.timed_ms  # equal prices: equal times


def _why(best: Priced, second: Priced | None, second_ms: float | None, *, bound: bool) -> str:
    """The pick's time, what bounds it (not on a CPU: `cpu_caveat`) and its margin."""
    prediction, fab = best.result[4], best.result[3]
    what = (
        f"{prediction.bottleneck}-bound, time imbalance {prediction.time_imbalance:.2f}"
        if bound
        else "this CPU's compute: a ranking of these candidates, no GPU's prediction"
    )
    line = f"{best.label} over {best.transport}: {best.ms:.3f} ms predicted on {fab.name} ({what})"
    if second is None:
        return f"{line}; the only candidate"
    margin = second_ms / best.ms - 1 if best.ms > 0 else 0.0
    if margin < 0:  # left untimed by _confirm: the model's price is no reason to time it
        return (
            f"{line}; {second.label} over {second.transport}, not timed, is priced {-margin:.1%} "
            f"below it: within the model's error ({CONFIRM_MARGIN:.0%}), a tie"
        )
    return f"{line}; {margin:.1%} faster than {second.label} over {second.transport}"


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()
