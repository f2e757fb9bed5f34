"""The metric table: every name a run reports, with its label, unit and meaning, in one place.

A single-device run and a context-parallel run of one config must land in the same columns of a
sweep summary, so each metric is one `Metric` row of `METRICS` and everything that shows metrics
reads it: the tasks (which fill them), metrics.json, the results table printed at the end of a run
(attngym.results), summary.md and the printed sweep table (attngym.runner.tracking.sweep), the
columns of report.html and the W&B summary. `format_value` says how a value reads in every table,
from the metric's unit. `import attngym.metrics` pulls in no torch: the sweep summary reads metric
names in processes that never attend.

A row's name is a key (`fwd_ms`) or a family of keys, a pattern with placeholders in angle
brackets (`<baseline>_<pass>_ms`): see PLACEHOLDERS. Adding a metric is one row here (in the
order tables show it) and the task that writes it; tests/test_metrics.py runs the real tasks and
fails on any key without a row.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any, Literal

# The timed passes and the attention passes each is made of.
PASS_PARTS = {"fwd": ("fwd",), "bwd": ("bwd",), "fwd_bwd": ("fwd", "bwd")}
PASSES = tuple(PASS_PARTS)

# The flex_over_<baseline>_<pass> ratios worth a column in results tables (every other ratio is
# in metrics.json): flex against the fastest contender (SDPA's and the varlen kernels), the
# fastest SDPA, a dense-mask SDPA and flex untuned.
HEADLINE_BASELINES = ("best", "best_sdpa", "sdpa_dense_mask", "flex_default")

# The numbers of a workload's batch rows that a workload run aggregates
# (attngym.runner.tasks.workloads), each as <name>_<stat> over the batches.
WORKLOAD_AGGREGATES = (
    "block_mask_ms", "fwd_ms", "bwd_ms", "fwd_bwd_ms", "fwd_tflops", "fwd_bwd_tflops",
    "fwd_kept_tflops", "fwd_bwd_kept_tflops", "flex_over_best_fwd", "flex_over_best_fwd_bwd",
    "efficiency", "efficiency_fwd_bwd", "load_time_imbalance", "time_imbalance", "bytes_moved",
    "bytes_needed", "planning_ms", "predicted_fwd_bwd_ms", "predicted_efficiency_fwd_bwd",
    "attngym_over_torch_cp_fwd_bwd",
)  # fmt: skip
WORKLOAD_STATS = ("mean", "p50", "p95", "max")

# What a placeholder of a row's name stands for: a regular expression, and the values a table
# column is made for (None: any name matching, no column of its own).
PLACEHOLDERS: dict[str, tuple[str, tuple[str, ...] | None]] = {
    "pass": ("fwd_bwd|fwd|bwd", PASSES),
    "headline": ("|".join(HEADLINE_BASELINES), HEADLINE_BASELINES),
    "baseline": ("[a-z][a-z0-9_]*?", None),  # a name of attngym.runner.config.BASELINES
    "NAME": ("[A-Za-z0-9_]+", None),  # a flex_attention kernel option
    "phase": ("[a-z][a-z0-9_]*", None),  # a phase of attngym.timeline.PHASES, or baseline_<name>
    "aggregated": ("|".join(sorted(WORKLOAD_AGGREGATES, key=len, reverse=True)), None),
    # PyTorch's load balancers torch_cp runs (attngym.distributed.schemes.torch_cp.BALANCERS; a test
    # holds them equal)
    "balancer": ("head_tail|per_document_head_tail|ptrr", None),
    "stat": ("|".join(WORKLOAD_STATS), None),
}

# What every `<ratio>_ci95` row means (ci95_metric).
CI_SUFFIX = "_ci95"
CI_MEANING = (
    "the ratio's 95 % interval [lo, hi]: a bootstrap over both sides' timed calls "
    "(attngym.bench.ratio_ci95); null with fewer than 5 calls a side. Holding 1: a tie"
)
EFFICIENCY_CI_MEANING = (
    "the efficiency's 95 % interval [lo, hi]: the interval of one device's time over the CP "
    "time (as for a speed ratio's _ci95), over world_size"
)

# Units format_value reads: "bytes" (MiB, GiB), "TFLOP/s" (one decimal); the others label.
# Where a metric shows in the table printed at the end of a run: in every run's, in a
# context-parallel run's, or not at all (metrics.json, summaries and W&B have every metric).
Shown = Literal["run", "cp", ""]


@dataclasses.dataclass(frozen=True)
class Metric:
    """One row of the metric table.

    Attributes:
        name: the metrics.json key, or a pattern of keys (`<baseline>_<pass>_ms`).
        label: how a person-facing table names it; placeholders as in `name` (`{pass}` reads
            fwd+bwd for fwd_bwd).
        unit: what its numbers count ("" for text, names and plain counts).
        meaning: what it measures, in a sentence (report.html shows it over the column).
        shown: where the printed results table of a run shows it (see Shown).
        column: whether summary.md and report.html give it a column (summary.csv has every key).
    """

    name: str
    label: str
    unit: str
    meaning: str
    shown: Shown = ""
    column: bool = True

    @functools.cached_property
    def pattern(self) -> re.Pattern[str]:
        """The keys this row names, as a regular expression."""
        parts = re.split(r"<(\w+)>", self.name)
        regex = "".join(
            f"(?P<{p}>{PLACEHOLDERS[p][0]})" if i % 2 else re.escape(p) for i, p in enumerate(parts)
        )
        return re.compile(f"^{regex}$")

    @property
    def is_family(self) -> bool:
        return "<" in self.name

    def names(self) -> tuple[str, ...]:
        """The keys of its columns: the name itself, or a family over its placeholders' column
        values (none for a family with an open placeholder such as <baseline>)."""
        if not self.is_family:
            return (self.name,)
        keys = [""]
        for i, part in enumerate(re.split(r"<(\w+)>", self.name)):
            values = (part,) if i % 2 == 0 else PLACEHOLDERS[part][1]
            if values is None:
                return ()
            keys = [k + v for k in keys for v in values]
        return tuple(keys)


M = Metric
# In the order tables show them; exact names are found before families (`bwd_status` is no
# `<baseline>_status`). The error is always a table's last column (it is long).
METRICS: tuple[Metric, ...] = (
    # How the run ended (the run layer writes these around the task's metrics).
    M("status", "status", "", "ok, failed or interrupted: how the run ended"),
    M("error", "error", "", "why the run failed or stopped (empty when ok)"),
    M("overrides", "overrides", "", "the run's command-line overrides, as typed", column=False),
    M(
        "complete",
        "complete",
        "",
        "true once every file of the run is written: a resumed sweep runs a job again without it",
        column=False,
    ),
    # What ran (Settings.describe).
    M("variant", "variant", "", "the attention variant", shown="run"),
    M(
        "topology",
        "topology",
        "",
        "single, or the context-parallel algorithm (ring, allgather, ulysses, hybrid)",
        shown="cp",
    ),
    M("world_size", "ranks", "", "ranks the sequence is split over (1: single)", shown="cp"),
    M("transport", "transport", "", "how shards move between ranks", shown="cp"),
    M("layout", "layout", "", "where each rank's rows of the sequence live", shown="cp"),
    M("scheme", "scheme", "", "topology=custom: your scheme's import path", column=False),
    M(
        "callbacks_read",
        "callbacks read",
        "",
        "how each of your callback paths was read: the mask_mod or score_mod itself, or a factory "
        "and the call made (its parameter names decide; setting its *_args calls it as one)",
        column=False,
    ),
    M("attngym_version", "attngym", "", "the attngym version that ran the job", column=False),
    M(
        "code_sources",
        "code sources",
        "",
        "the source file and sha256 of every module your import paths name (callbacks, scheme, "
        "balancer): a resumed sweep runs a job again when one changed",
        column=False,
    ),
    M(
        "code_fingerprint",
        "code fingerprint",
        "",
        "one digest of attngym_version and code_sources",
        column=False,
    ),
    M("a2a_size", "all-to-all group", "", "hybrid: ranks of one all-to-all group", column=False),
    M("across", "across groups", "", "hybrid: the algorithm between groups", column=False),
    M(
        "overlap",
        "overlap",
        "",
        "allgather: own keys attended while the rows read from other shards arrive",
        column=False,
    ),
    M(
        "fold",
        "fold",
        "",
        "allgather: the batch and heads folded into the call's rows, costliest first",
        column=False,
    ),
    M(
        "pipeline",
        "pipeline",
        "",
        "ulysses: the exchanges in rounds of the layout's pieces, each beside the round before",
        column=False,
    ),
    M("device", "device", "", "cpu or cuda", shown="run"),
    M("device_name", "device name", "", "the GPU's name, or the CPU model"),
    M("capability", "capability", "", "the GPU's compute capability (none on a CPU)", column=False),
    M("torch", "torch", "", "the PyTorch version", column=False),
    M("dtype", "dtype", "", "the dtype of q, k, v", shown="run"),
    M("batch", "batch", "", "B"),
    M("heads", "heads", "", "H, query heads"),
    M("kv_heads", "kv heads", "", "G, key/value heads (GQA: fewer than heads)"),
    M("seq_len", "seq_len", "tokens", "S, the whole sequence (all ranks together)", shown="run"),
    M("head_dim", "head dim", "", "D"),
    M("block_q", "block q", "tokens", "the block mask's query block size"),
    M("block_kv", "block kv", "tokens", "the block mask's key/value block size"),
    M(
        "kernel_options.<NAME>",
        "kernel option {NAME}",
        "",
        "a flex_attention kernel option the run passed",
        column=False,
    ),
    M(
        "sparsity",
        "block sparsity",
        "fraction",
        "fraction of (q block, kv block) pairs the block mask skips",
        shown="run",
    ),
    # Timings of flex (attngym.bench.time_fn): warm-up calls, then the median of the timed calls.
    M(
        "fwd_ms",
        "fwd (ms)",
        "ms",
        "forward time, median over the timed calls (as many as fill benchmark.budget_ms, at "
        "least benchmark.repeats); with autograd recording when the run "
        "times a backward (as training runs it), under no_grad otherwise (tasks.phases)",
        shown="run",
    ),
    M("fwd_ms_min", "fwd min (ms)", "ms", "the fastest forward of the repeats"),
    M("fwd_ms_max", "fwd max (ms)", "ms", "the slowest forward of the repeats"),
    M("bwd_ms", "bwd (ms)", "ms", "backward alone, median", shown="run"),
    M("fwd_bwd_ms", "fwd+bwd (ms)", "ms", "forward and backward, median", shown="run"),
    M(
        "fwd_tflops",
        "fwd TFLOP/s",
        "TFLOP/s",
        "achieved forward TFLOP/s: useful FLOPs (masked blocks excluded) over fwd_ms",
        shown="run",
    ),
    M("bwd_tflops", "bwd TFLOP/s", "TFLOP/s", "achieved backward TFLOP/s"),
    M("fwd_bwd_tflops", "fwd+bwd TFLOP/s", "TFLOP/s", "achieved fwd+bwd TFLOP/s", shown="run"),
    M(
        "block_mask_ms",
        "block mask (ms)",
        "ms",
        "building the run's block mask on its device, once (a workload: each batch's)",
    ),
    # A workload (workload=documents, attngym.runner.tasks.workloads): batches of packed documents,
    # each a row of batches.csv; on such a run the plain timings above are their mean.
    M("workload", "workload", "", "none (one batch) or documents (batches of packed documents)"),
    M("workload_distribution", "lengths from", "", "how document lengths are drawn"),
    M(
        "planning_ms",
        "planning (ms)",
        "ms",
        "context parallelism: placing the sequence on the ranks (a balanced layout plans from "
        "the block mask, documents from the documents' lengths), once per run or batch",
    ),
    M("workload_batches", "batches", "", "batches in the workload", shown="run"),
    M("workload_batches_done", "batches done", "", "batches run so far", column=False),
    M(
        "tokens_per_s",
        "tokens/s",
        "tokens/s",
        "the workload's tokens (batches x B x S) over its summed fwd+bwd (else fwd) time",
        shown="run",
    ),
    M(
        "<pass>_kept_tflops",
        "{pass} kept TFLOP/s",
        "TFLOP/s",
        "the FLOPs the mask keeps over the pass's time (a batch row's; unlike <pass>_tflops, "
        "partial blocks' masked entries are not credited)",
        column=False,
    ),
    M(
        "<aggregated>_<stat>",
        "{aggregated} {stat}",
        "",
        "a batch row's number over the workload's batches: mean, median, 95th percentile, max",
        column=False,
    ),
    # How near the device's limit, and what it cost (tasks.phases.limits).
    M(
        "mask_density",
        "mask density",
        "fraction",
        "fraction of the (q, kv) entries, over every batch and head, that the mask keeps (exact): "
        "the FLOPs the mask needs",
    ),
    M(
        "mask_density_rows",
        "density rows",
        "fraction",
        "the share of rows of blocks whose partial blocks mask_density evaluated: 1 is exact; "
        "below, the partial blocks of every k-th row stood for the others (a mask too large to "
        "evaluate whole)",
        column=False,
    ),
    M(
        "flops_spent_over_kept",
        "FLOPs spent / kept",
        "ratio",
        "FLOPs the kernel computes (its full and partial blocks) over those the mask keeps: "
        "the block mask's waste",
    ),
    M(
        "peak_tflops",
        "peak TFLOP/s",
        "TFLOP/s",
        "the device's peak dense bf16/fp16 TFLOP/s (attngym.peak: a datasheet, or a matmul probe)",
    ),
    M("peak_source", "peak from", "", "the datasheet or the probe peak_tflops comes from"),
    M(
        "<pass>_peak_fraction",
        "{pass} of peak",
        "fraction",
        "the FLOPs the mask keeps over the pass's time, over peak_tflops",
        shown="run",
    ),
    M(
        "<pass>_joules",
        "{pass} (J)",
        "J",
        "energy of one call: the average power between steps of NVML's energy counter (polled by a "
        "thread) over a loop of about 0.4 s, times the loop's time per call",
    ),
    M("<pass>_watts", "{pass} (W)", "W", "average power over those calls"),
    M("<pass>_joules_per_token", "{pass} (J/token)", "J", "<pass>_joules over batch x seq_len"),
    M("energy_source", "energy from", "", "the counter the joules come from"),
    M(
        "kernel_path_fwd",
        "fwd kernel",
        "",
        "the kernel family the forward ran (triton, flash, triton decode, or eager: no fused "
        "kernel) and its kernel, read from a profiled call",
    ),
    M("kernel_path_bwd", "bwd kernel", "", "the same for the backward"),
    M(
        "flash",
        "FLASH",
        "",
        "ran, possible (no FLASH rule refuses this run), or refused: the first rule it breaks",
    ),
    M(
        "not_measured",
        "not measured",
        "",
        "what of the fraction of peak, the energy and the kernel path this device cannot give, "
        "and why",
    ),
    M(
        "first_call_s",
        "first call (s)",
        "s",
        "the first call, timed apart: compilation on CUDA, Dynamo's tracing of eager flex on CPU",
        shown="run",
    ),
    # Where the run's wall time went (attngym.timeline).
    M(
        "wall_s",
        "wall time (s)",
        "s",
        "the job from its start (the first job of a process: the process's start) to its last file",
    ),
    M(
        "pictures_kept",
        "pictures kept",
        "",
        "heatmap.png and block_mask.png copied from the cache folder, drawn by an earlier run of "
        "the same mask, shape and block size (attngym.runner.pictures)",
        column=False,
    ),
    M(
        "phase_<phase>_s",
        "{phase} (s)",
        "s",
        "seconds of one phase of the run (attngym.timeline.PHASES; other: what no phase covers)",
        column=False,
    ),
    M(
        "compile_total_s",
        "torch.compile (s)",
        "s",
        "seconds torch.compile (Dynamo) spent in the run, in any phase (a lazy backward's too)",
        column=False,
    ),
    M(
        "compiles",
        "compiles",
        "graphs",
        "graphs Dynamo built, recompiles included (eager flex on CPU is traced too, backend eager)",
    ),
    M(
        "recompiles",
        "recompiles",
        "graphs",
        "graphs built again for a function compiled before in this process (reasons in the log)",
    ),
    M(
        "compile_cache",
        "compile cache",
        "",
        "the folder torch.compile's caches are kept in (attngym.compile_cache)",
        column=False,
    ),
    M(
        "compile_cache_hits",
        "compile cache hits",
        "",
        "Inductor FX-graph and AOTAutograd cache hits (attngym.compile_cache)",
        column=False,
    ),
    M(
        "compile_cache_misses",
        "compile cache misses",
        "",
        "Inductor FX-graph and AOTAutograd cache misses",
        column=False,
    ),
    M(
        "bytecode_kept",
        "bytecode kept",
        "",
        "Python keeps torch's compiled bytecode for the next run (false: PYTHONDONTWRITEBYTECODE "
        "is set and none is kept, so every run compiles torch's sources again)",
        column=False,
    ),
    M(
        "peak_mem_bytes",
        "peak memory",
        "bytes",
        "peak memory the timed flex calls add (CUDA: the caching allocator's; CPU: the "
        "process's resident set); context parallel: the largest rank's",
    ),
    # Validation against the float64 dense reference, on the validated rows.
    M("err_out_max_abs", "max |out - ref|", "", "output vs the reference", shown="run"),
    M("err_out_rel", "rel err out", "", "output vs the reference, relative"),
    M(
        "err_out_row_rel",
        "worst row err out",
        "",
        "the worst validated row's output error over the row's own scale (attngym.validation)",
        shown="run",
    ),
    M(
        "err_timed_out_rel",
        "timed call vs validated",
        "",
        "a call after the timed passes against the validated call, worst row over its scale",
    ),
    M("err_lse_max_abs", "max |lse - ref|", "", "log-sum-exp vs the reference", shown="run"),
    M("err_dq_rel", "rel err dq", "", "dq vs the reference (when a backward ran)", shown="run"),
    M("err_dk_rel", "rel err dk", "", "dk vs the reference"),
    M("err_dv_rel", "rel err dv", "", "dv vs the reference"),
    M("validated_rows", "validated rows", "rows", "query rows checked against the reference"),
    M(
        "validation",
        "validation",
        "",
        "ok, failed: <the error over its tolerance>, or not run",
        shown="run",
    ),
    M(
        "bwd_status",
        "bwd",
        "",
        "ok, not available: <reason> (flex has no CPU backward), or not requested",
        shown="run",
    ),
    # Context parallelism (attngym.runner.tasks.context_parallel).
    M(
        "load_imbalance",
        "block imbalance",
        "ratio",
        "max over mean of the non-empty blocks each rank attends",
        shown="cp",
    ),
    M(
        "load_time_imbalance",
        "predicted time imbalance",
        "ratio",
        "max over mean of each rank's compute time as the placement's cost model predicts it "
        "for this scheme (partial blocks dearer than full ones; a pairwise scheme per pair kernel)",
    ),
    M(
        "efficiency",
        "efficiency",
        "ratio",
        "(single_fwd_ms / world_size) / fwd_ms: 1 is perfect scaling",
        shown="cp",
    ),
    M(
        "efficiency_fwd_bwd",
        "efficiency fwd+bwd",
        "ratio",
        "efficiency of forward and backward",
        shown="cp",
    ),
    M(
        "efficiency_ci95",
        "efficiency 95% interval",
        "ratio",
        EFFICIENCY_CI_MEANING,
        column=False,
    ),
    M(
        "efficiency_fwd_bwd_ci95",
        "efficiency fwd+bwd 95% interval",
        "ratio",
        EFFICIENCY_CI_MEANING,
        column=False,
    ),
    M(
        "single_fwd_ms",
        "one device fwd (ms)",
        "ms",
        "the whole problem on one device, same kernel, same run",
        shown="cp",
    ),
    M(
        "single_fwd_bwd_ms",
        "one device fwd+bwd (ms)",
        "ms",
        "fwd+bwd of the whole problem on one device",
        shown="cp",
    ),
    M("step_compute_ms", "step compute (ms)", "ms", "rank 0's median step compute"),
    M(
        "step_transfer_ms",
        "step transfer (ms)",
        "ms",
        "one step's K/V transfer alone (0 on one rank; none where no one step is timed)",
    ),
    M(
        "bytes_moved",
        "bytes moved",
        "bytes",
        "in one forward, the most any rank sends (null: a scheme of yours that counts none)",
        column=False,
    ),
    M(
        "bytes_needed",
        "bytes needed",
        "bytes",
        "in one forward, the most K/V bytes any rank's queries read from other ranks' shards "
        "(whole blocks of the mask): bytes_moved above it is traffic the mask does not read",
        column=False,
    ),
    M(
        "pairs_computed",
        "pairs computed",
        "pairs",
        "chunk pairs attended, summed over ranks (null: a scheme of yours that counts none)",
        column=False,
    ),
    M(
        "pairs_skipped",
        "pairs skipped",
        "pairs",
        "chunk pairs the mask empties, summed over ranks",
        column=False,
    ),
    # Simulated ranks (topology.simulate=true, attngym.runner.tasks.cp_simulate): a prediction.
    M("simulate", "simulated", "", "true: the ranks were simulated on one device", shown="cp"),
    M("fabric", "fabric", "", "simulate: the links transfers are priced on", shown="cp"),
    M(
        "predicted_<pass>_ms",
        "predicted {pass} (ms)",
        "ms",
        "simulate: the slowest rank's compute and transfers on the fabric, overlapped as the "
        "topology does",
        shown="cp",
    ),
    M(
        "predicted_efficiency",
        "predicted efficiency",
        "ratio",
        "simulate: (single_fwd_ms / world_size) / predicted_fwd_ms",
        shown="cp",
    ),
    M(
        "predicted_efficiency_fwd_bwd",
        "predicted efficiency fwd+bwd",
        "ratio",
        "simulate: as predicted_efficiency, forward and backward",
        shown="cp",
    ),
    M(
        "bottleneck",
        "bottleneck",
        "",
        "simulate: host (a rank's host issues its kernels more slowly than its device runs "
        "them), else compute, transfer or imbalance, whichever keeps the call above balanced "
        "compute (none on a CPU: prediction_refused)",
        shown="cp",
    ),
    M(
        "prediction_refused",
        "no GPU prediction",
        "",
        "simulate or auto on a CPU: why no scaling is predicted (a CPU's compute on a GPU "
        "fabric), and what to run instead",
        shown="cp",
    ),
    M(
        "time_imbalance",
        "time imbalance",
        "ratio",
        "simulate: max over mean of the ranks' compute time (fwd+bwd with a backward)",
        shown="cp",
    ),
    M("rank_compute_ms_min", "least rank compute (ms)", "ms", "simulate: the lightest rank"),
    M("rank_compute_ms_max", "most rank compute (ms)", "ms", "simulate: the heaviest rank"),
    M(
        "rank_compute_ms",
        "each rank's compute (ms)",
        "",
        "simulate: every rank's compute alone in ms, rank 0 first, separated by spaces (which "
        "ranks a placement overloads)",
    ),
    M(
        "rank_host_ms_max",
        "most rank host time (ms)",
        "ms",
        "simulate: the most any rank's host takes to issue its compute (the rank takes at least "
        "that)",
    ),
    M(
        "predicted_peak_mem_bytes",
        "predicted peak memory",
        "bytes",
        "simulate: a rank's timed compute peak plus its transfer buffers, the largest rank",
    ),
    M(
        "predicted_torch_cp_<pass>_ms",
        "predicted torch_cp {pass} (ms)",
        "ms",
        "simulate: PyTorch's scheme (whole K/V shards gathered, one call per rank) on the "
        "placement of its fastest load balancer",
    ),
    M(
        "predicted_torch_cp_balancer",
        "predicted torch_cp balancer",
        "",
        "simulate: PyTorch's load balancer predicted fastest",
    ),
    M(
        "predicted_torch_cp_<balancer>_<pass>_ms",
        "predicted torch_cp {balancer} {pass} (ms)",
        "ms",
        "simulate: PyTorch's scheme on that balancer's placement",
        column=False,
    ),
    M(
        "predicted_torch_cp_<balancer>_status",
        "predicted torch_cp {balancer}",
        "",
        "ok or skipped: why that balancer cannot place this variant",
        column=False,
    ),
    M(
        "auto_pick",
        "auto pick",
        "",
        "topology=auto: the scheme/layout/transport the model ran",
        shown="cp",
    ),
    M("auto_pick_ms", "auto pick predicted (ms)", "ms", "topology=auto: the pick's predicted time"),
    M("auto_runner_up", "auto runner-up", "", "topology=auto: the next fastest candidate"),
    M(
        "auto_runner_up_ms",
        "auto runner-up (ms)",
        "ms",
        "topology=auto: its predicted time, as the pick's (an untimed one's model price scaled "
        "by the pick's timed over modelled time)",
    ),
    M("auto_why", "auto why", "", "topology=auto: the pick's time, bound and margin", column=False),
    M("auto_candidates", "auto candidates", "", "topology=auto: candidates priced", column=False),
    M(
        "auto_simulated",
        "auto simulated",
        "",
        "topology=auto: candidates simulated so far (an interrupted choice keeps the count)",
        column=False,
    ),
    M(
        "auto_planned",
        "auto planned",
        "",
        "topology=auto: candidates to simulate (grows by the alternatives a simulation names)",
        column=False,
    ),
    M(
        "auto_best_so_far",
        "auto best so far",
        "",
        "topology=auto: the fastest candidate priced so far and its predicted time",
        column=False,
    ),
    M(
        "auto_measured_over_predicted",
        "auto measured / predicted",
        "ratio",
        "topology=auto on real ranks: the pick's measured time over its predicted time",
    ),
    M("auto_s", "auto choice (s)", "s", "topology=auto: wall time of the choice"),
    M(
        "auto_timed",
        "auto timed",
        "",
        "topology=auto: candidates simulated with every item timed (the rest priced by the "
        "model; on a workload, timed on one typical batch)",
        column=False,
    ),
    M(
        "auto_dynamic_gain",
        "auto per-batch gain",
        "ratio",
        "topology=auto on a workload: what a pick per batch would save against the one pick, "
        "net of the planning its switches cost (the model's prices, scaled for those timed)",
    ),
    M(
        "auto_dynamic_switches",
        "auto switches",
        "",
        "topology=auto on a workload: batches where a pick per batch would change scheme",
        column=False,
    ),
    M(
        "auto_dynamic_cost_ms",
        "auto switching (ms)",
        "ms",
        "topology=auto on a workload: the planning those switches cost",
        column=False,
    ),
    M(
        "auto_cached",
        "auto answer kept",
        "",
        "topology=auto: when the answer given was asked (null: asked by this run)",
        column=False,
    ),
    M("sim_s", "simulation (s)", "s", "simulate: wall time of the simulated ranks"),
    M("sim_items", "items", "", "simulate: items of work over ranks and passes", column=False),
    M("sim_timed", "items timed", "", "simulate: distinct items timed", column=False),
    # PyTorch's own flex context parallelism, the torch_cp baseline, on the same shards.
    M("torch_cp_<pass>_ms", "torch_cp {pass} (ms)", "ms", "torch_cp's time, median"),
    M(
        "attngym_over_torch_cp_<pass>",
        "attngym speed-up vs torch_cp {pass}",
        "ratio",
        "torch_cp time / attngym time (> 1: attngym is faster)",
        shown="cp",
    ),
    M(
        "attngym_over_torch_cp_<pass>_ci95",
        "attngym speed-up vs torch_cp {pass} 95% interval",
        "ratio",
        CI_MEANING,
        column=False,
    ),
    M(
        "torch_cp_peak_mem_bytes",
        "torch_cp peak memory",
        "bytes",
        "as peak_mem_bytes, for torch_cp",
    ),
    M("torch_cp_status", "torch_cp", "", "ok or skipped: <reason>", shown="cp"),
    M(
        "torch_cp_balancer",
        "torch_cp balancer",
        "",
        "the fastest of PyTorch's load balancers, whose times torch_cp_<pass>_ms are",
        shown="cp",
    ),
    M(
        "torch_cp_<balancer>_<pass>_ms",
        "torch_cp {balancer} {pass} (ms)",
        "ms",
        "torch_cp with that load balancer, its shards resharded into its placement",
        column=False,
    ),
    M(
        "torch_cp_<balancer>_status",
        "torch_cp {balancer}",
        "",
        "ok or skipped: why that balancer cannot place this variant",
        column=False,
    ),
    M("torch_cp_bwd_status", "torch_cp bwd", "", "as bwd_status, for torch_cp", column=False),
    M(
        "torch_cp_err_out_rel",
        "torch_cp rel err out",
        "",
        "torch_cp's output against attngym's on the validated rows",
        column=False,
    ),
    M(
        "torch_cp_err_out_max_abs",
        "torch_cp max |out - attngym|",
        "",
        "as above, max abs",
        column=False,
    ),
    M(
        "torch_cp_validation",
        "torch_cp validation",
        "",
        "ok, or failed beyond twice the dtype's tolerance (which fails the run)",
        column=False,
    ),
    # Baselines: every contender in one process on the same inputs (the `baselines` key).
    M(
        "flex_over_<headline>_<pass>",
        "flex speed-up vs {headline} {pass}",
        "ratio",
        "baseline time / flex time (> 1: flex is faster)",
        shown="run",
    ),
    M(
        "flex_over_<headline>_<pass>_ci95",
        "flex speed-up vs {headline} {pass} 95% interval",
        "ratio",
        CI_MEANING,
        column=False,
    ),
    M(
        "best_<pass>",
        "best contender {pass}",
        "",
        "the fastest contender a user would pick instead that ran and agreed with flex: SDPA's "
        "and FlashAttention's varlen kernels",
        column=False,
    ),
    M("best_<pass>_ms", "best contender {pass} (ms)", "ms", "its time, median", column=False),
    M(
        "best_sdpa_<pass>",
        "best SDPA {pass}",
        "",
        "the fastest SDPA contender that ran",
        column=False,
    ),
    M("best_sdpa_<pass>_ms", "best SDPA {pass} (ms)", "ms", "its time, median", column=False),
    M("<baseline>_status", "{baseline}", "", "ok or skipped: <reason>", column=False),
    M(
        "<baseline>_err_out_rel",
        "{baseline} rel err out",
        "",
        "a varlen kernel's output against flex's on the validated rows",
        column=False,
    ),
    M(
        "<baseline>_validation",
        "{baseline} validation",
        "",
        "ok, or failed beyond twice the dtype's tolerance (which fails the run)",
        column=False,
    ),
    M(
        "<baseline>_<pass>_ms",
        "{baseline} {pass} (ms)",
        "ms",
        "the baseline's time, median",
        column=False,
    ),
    M(
        "<baseline>_<pass>_tflops",
        "{baseline} {pass} TFLOP/s",
        "TFLOP/s",
        "its achieved TFLOP/s",
        column=False,
    ),
    M(
        "<baseline>_<pass>_peak_fraction",
        "{baseline} {pass} of peak",
        "fraction",
        "the FLOPs the mask keeps over its time, over peak_tflops (as flex's)",
        column=False,
    ),
    M(
        "flex_over_<baseline>_<pass>",
        "flex speed-up vs {baseline} {pass}",
        "ratio",
        "baseline time / flex time (> 1: flex is faster)",
        column=False,
    ),
    M(
        "flex_over_<baseline>_<pass>_ci95",
        "flex speed-up vs {baseline} {pass} 95% interval",
        "ratio",
        CI_MEANING,
        column=False,
    ),
)
del M

_BY_NAME = {m.name: m for m in METRICS if not m.is_family}
_FAMILIES = tuple(m for m in METRICS if m.is_family)


def metric_of(key: str) -> Metric | None:
    """The table's row of a metrics.json key (an exact name first, then the first family that
    matches), or None for a key the table does not know."""
    found = _BY_NAME.get(key)
    if found is not None:
        return found
    return next((m for m in _FAMILIES if m.pattern.match(key)), None)


def unknown_keys(keys: Iterable[str]) -> list[str]:
    """The keys the table has no row for (a metric a task writes needs one: add it to METRICS)."""
    return [k for k in keys if metric_of(k) is None]


def label(key: str) -> str:
    """How a person-facing table names `key` (`flex_over_sdpa_fwd_bwd`: "flex speed-up vs sdpa
    fwd+bwd"); the key itself when the table does not know it."""
    row = metric_of(key)
    if row is None:
        return key
    if not row.is_family:
        return row.label
    parts = row.pattern.match(key).groupdict()  # type: ignore[union-attr]
    if "pass" in parts:
        parts["pass"] = parts["pass"].replace("fwd_bwd", "fwd+bwd")
    return row.label.format(**parts)


def describe(key: str) -> str:
    """One line on `key` for a table's header tooltip: its label, unit and meaning."""
    row = metric_of(key)
    if row is None:
        return key
    unit = f" [{row.unit}]" if row.unit else ""
    return f"{label(key)}{unit}: {row.meaning}"


def table_columns() -> tuple[str, ...]:
    """Columns of a results table (summary.md, report.html): the table's column rows in order,
    families over their placeholders' values, the error last. Tables show those present in at
    least one row."""
    names = [n for m in METRICS if m.column for n in m.names()]
    names.remove("error")
    return (*names, "error")


def baseline_metric(baseline: str, pass_name: str, what: str) -> str:
    """`<baseline>_<pass>_<what>`, e.g. sdpa_fwd_ms, sdpa_dense_mask_fwd_tflops."""
    return f"{baseline}_{pass_name}_{what}"


def speedup_metric(baseline: str, pass_name: str) -> str:
    """`flex_over_<baseline>_<pass>`: baseline time / flex time (> 1: flex is faster)."""
    return f"flex_over_{baseline}_{pass_name}"


def pass_flops(shape: Any, seq_len: int, sparsity: float) -> dict[str, float]:
    """Useful FLOPs of each pass ("fwd", "bwd", "fwd_bwd") for the whole problem.

    Args:
        shape: the run's shape, anything with batch, heads and head_dim
        (attngym.runner.config.Shape).
        seq_len: S for both q and kv.
        sparsity: fraction of blocks the block mask skips (their FLOPs are not counted).
    """
    from attngym import bench

    return {
        p: bench.attention_flops(
            shape.batch,
            shape.heads,
            seq_len,
            seq_len,
            shape.head_dim,
            sparsity=sparsity,
            passes=parts,
        )
        for p, parts in PASS_PARTS.items()
    }


def pass_metrics(
    timings: Mapping[str, Any], shape: Any, seq_len: int, sparsity: float
) -> dict[str, Any]:
    """fwd_ms, fwd_ms_min, fwd_ms_max, bwd_ms, fwd_bwd_ms and <pass>_tflops from timings.

    Args:
        timings: {"fwd": Timing, "bwd": Timing, "fwd_bwd": Timing} (attngym.bench.time_fn
            results); a missing pass gives None metrics.
        shape, seq_len, sparsity: as in pass_flops.
    """
    from attngym import bench

    flops = pass_flops(shape, seq_len, sparsity)
    metrics: dict[str, Any] = {}
    for p in PASS_PARTS:
        timing = timings.get(p)
        metrics[f"{p}_ms"] = timing.median_ms if timing else None
        metrics[f"{p}_tflops"] = bench.tflops(flops[p], timing.median_ms) if timing else None
    fwd = timings.get("fwd")
    metrics["fwd_ms_min"] = fwd.min_ms if fwd else None
    metrics["fwd_ms_max"] = fwd.max_ms if fwd else None
    return metrics


# Control characters: text a user typed (a label, an override) or an error carries them, and
# an ESC sequence would recolour or move a terminal's cursor; a newline would break a table row.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """`text` safe for a terminal and a table row: tabs and line breaks become spaces, other
    control characters their escapes (ESC reads `\\x1b`)."""
    return _CONTROL.sub(lambda m: " " if m[0] in "\t\n\r" else repr(m[0])[1:-1], text)


def error_line(text: str, width: int = 300) -> str:
    """What a terminal shows of a long error (a compiler's can hold pages of its IR): the first
    line, printable, cut to `width`; the whole stays in summary.csv and the job's log."""
    return shortened(printable(text.strip().split("\n", 1)[0]), width)


def shortened(text: str, width: int) -> str:
    """`text` cut to `width` characters, ending in "..." where it was cut."""
    return text if len(text) <= width else text[: max(width - 3, 0)] + "..."


def markdown_cell(text: str) -> str:
    """`text` inside one cell of a Markdown table (summary.md, results.md): printable, and a
    `|` escaped so that it does not open another column."""
    return printable(text).replace("|", "\\|")


def format_value(column: str, value: Any) -> str:
    """A metric as a person reads it, by its unit in the table: bytes in MiB/GiB, TFLOP/s to one
    decimal (from 0.1 up), other floats to 3 significant figures; None is empty; text
    `printable`. summary.csv keeps the raw numbers."""
    if value is None:
        return ""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return printable(str(value))
    row = metric_of(column)
    unit = row.unit if row is not None else ""
    if unit == "bytes":
        from attngym.estimate import format_bytes

        return format_bytes(value)
    if unit == "TFLOP/s" and abs(value) >= 0.1:
        return f"{value:.1f}"  # below 0.1 (a CPU), 3 significant figures say more than 0.0
    if isinstance(value, float):
        if value == 0.0 or not math.isfinite(value):
            return f"{value:g}"
        digits = max(0, 2 - math.floor(math.log10(abs(value))))  # 3 significant, no exponent
        return f"{value:.{digits}f}" if abs(value) >= 1e-3 else f"{value:.2e}"
    return str(value)


def ci95_metric(ratio: str) -> str:
    """`<ratio>_ci95`: the 95 % interval [lo, hi] of a speed ratio (CI_MEANING)."""
    return ratio + CI_SUFFIX


def is_tie(interval: Any) -> bool:
    """Whether a ratio's interval (`<ratio>_ci95`: [lo, hi], or its text in summary.csv) holds
    1: neither side is faster. False where there is no interval."""
    if isinstance(interval, str):
        import json

        try:
            interval = json.loads(interval)
        except ValueError:
            return False
    if not isinstance(interval, list | tuple) or len(interval) != 2:
        return False
    lo, hi = interval
    return isinstance(lo, int | float) and isinstance(hi, int | float) and lo <= 1.0 <= hi


def format_cell(column: str, row: Mapping[str, Any]) -> str:
    """A table's cell of `column` in `row`: format_value, and " (tie)" after a speed ratio
    whose interval (`<column>_ci95` in the row) holds 1 (an efficiency's holding 1 is no tie)."""
    text = format_value(column, row.get(column))
    interval = metric_of(ci95_metric(column))
    speed_ratio = interval is not None and interval.meaning == CI_MEANING
    if text and speed_ratio and is_tie(row.get(ci95_metric(column))):
        text += " (tie)"
    return text
