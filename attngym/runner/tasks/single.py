"""One device, the whole sequence: FlexAttention checked, timed and compared with SDPA baselines.

Everything runs in one process on the same inputs, so the ratios between flex and the baselines
are not skewed by different data, allocator state or clocks. The order is fixed:

1. build the variant and the block mask (block size from the config), draw seeded inputs;
2. the first flex call (fwd, and bwd when requested) is timed apart: on CUDA it is compilation;
3. validation on a bounded sample of query rows (with the first and last query blocks always)
   against the float64 dense reference, so memory stays O(rows x S) whatever S is; gradients too
   on CUDA, by feeding the output gradient only on the validated rows (then dk and dv of both
   sides depend on those rows alone);
4. timings of fwd, and on CUDA bwd and fwd+bwd, with peak memory; then one more call of the
   timed kind, held to the validated one (validation.Validated.agrees);
5. baselines that apply, each set up in its own phase (baseline_<name>), then timed together in
   one pass (phase `baselines`: interleaved rounds, phases.time_contenders); those that do not
   apply are recorded with the reason. The varlen kernels (attngym.varlen) read q, k, v packed as
   they take them, and their output is checked against flex's: a disagreement fails the run, as
   torch_cp's does in a CP run. Each ratio to flex carries its 95 % interval (phases.ratio).

Steps 2 and 4 (and the timing in 5) are attngym.runner.tasks.phases at world size 1, the phases the
context-parallel task runs on every rank; what each timed metric means is written there.

On CPU flex runs eagerly and forward only (FlexAttention has no CPU backward): `bwd_status` says
so and the backward metrics are None.

Shape legend: B batch, H query heads, G kv heads, S sequence, D head dim, R validated rows.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from attngym import kernels, reference, registry, timeline, validation, varlen
from attngym.device import sync
from attngym.fileio import atomic_write
from attngym.inputs import make_inputs, torch_dtype
from attngym.metrics import baseline_metric, pass_flops, pass_metrics, speedup_metric
from attngym.runner.config import Settings
from attngym.runner.tasks import phases
from attngym.variants.base import Variant

log = logging.getLogger(__name__)


@registry.register("task", "single")
def run(settings: Settings, run_dir: Path, metrics: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run one configuration on one device.

    Args:
        settings: the checked, resolved run settings (topology.kind == "single").
        run_dir: the run's output folder (profiler files go there).
        metrics: filled in place as the results come, so that a run stopped part-way (SIGINT,
            SIGTERM) still has what it measured; a new dict when None.

    Returns:
        `metrics`: flat metrics named as in attngym.metrics (status is set by the caller).
    """
    metrics = {} if metrics is None else metrics
    if settings.workload.name != "none":  # each batch a run of this task (tasks.workloads)
        from attngym.runner.tasks import workloads

        return workloads.run(settings, run_dir, metrics, run)
    metrics.update(settings.describe())
    job = _prepare(settings, metrics)
    with timeline.phase("first_call"):
        metrics["first_call_s"] = phases.first_call(job.rank, backward=job.do_bwd)
    what = "compile + first call" if job.use_compile else "first eager call"
    log.info("flex %s: %.2f s", what, metrics["first_call_s"])
    with timeline.phase("validation"):
        validated = _validate(job, metrics)
    with timeline.phase("timed"):
        flex = _time_flex(job, metrics)
    if validated is not None:
        with timeline.phase("validation"):
            _check_timed(job, validated, metrics)
    if settings.profiler != "none":
        with timeline.phase("profile"):
            metrics.update(_profile(settings, job.rank.attend, job.rank.device, run_dir))
    times = _time_baselines(job, flex, metrics)
    metrics.update(_best(metrics, flex, times, "best_sdpa", SDPA_FAMILY))
    metrics.update(_best(metrics, flex, times, "best", SDPA_FAMILY + varlen.KERNELS))
    for name in varlen.KERNELS:
        validation.add_failure(metrics, metrics.get(f"{name}_validation"),
                               f"attngym and {name} disagree")  # fmt: skip
    return metrics


@dataclasses.dataclass(kw_only=True)
class OneDevice:
    """The run on one device: its settings, inputs and flex call (`rank.attend`), and the passes
    it times (fwd if asked; bwd and fwd_bwd when a backward runs here)."""

    settings: Settings
    variant: Variant
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    grad_out: torch.Tensor
    sparsity: float
    density: float
    do_bwd: bool
    use_compile: bool
    passes: tuple[str, ...]
    rank: phases.Rank


def _prepare(settings: Settings, metrics: dict[str, Any]) -> OneDevice:
    """Seeded inputs, the variant and its block mask on the device, the flex call; reports
    bwd_status and sparsity."""

    device = torch.device(settings.device)
    shape = settings.shape
    variant = settings.variant.to(device)
    want_bwd = "bwd" in settings.passes
    do_bwd = want_bwd and device.type == "cuda"  # FlexAttention has no CPU backward
    metrics["bwd_status"] = phases.bwd_status(want_bwd, do_bwd)
    with timeline.phase("inputs"):
        q, k, v, grad_out = make_inputs(
            shape, settings.seed, device, torch_dtype(settings.dtype), requires_grad=do_bwd
        )
    with timeline.phase("block_mask"):
        start = time.perf_counter()
        block_mask = kernels.make_block_mask(
            variant, shape.seq_len, shape.seq_len, block_size=settings.block_size, device=device
        )
        sync(device)
        metrics["block_mask_ms"] = 1e3 * (time.perf_counter() - start)
    metrics.update(phases.mask_work(variant.mask_mod, block_mask, shape.batch, shape.heads))
    sparsity, density = metrics["sparsity"], metrics["mask_density"]
    use_compile = settings.compile and device.type == "cuda"

    def flex() -> tuple[torch.Tensor, torch.Tensor]:
        return kernels.attend_chunk(
            q,
            k,
            v,
            variant,
            backend="flex",
            block_mask=block_mask,
            kernel_options=settings.kernel_options,
            compile=use_compile,
            compile_mode=settings.compile_mode,
        )

    rank = phases.Rank(
        attend=flex,
        leaves=(q, k, v),
        grad_out=grad_out,
        device=device,
        warmup=settings.benchmark.warmup,
        repeats=settings.benchmark.repeats,
        budget_ms=settings.benchmark.budget_ms,
        label="flex",
    )
    passes = (("fwd",) if "fwd" in settings.passes else ()) + (
        phases.BACKWARD_PASSES if do_bwd else ()
    )
    return OneDevice(
        settings=settings,
        variant=variant,
        q=q,
        k=k,
        v=v,
        grad_out=grad_out,
        sparsity=sparsity,
        density=density,
        do_bwd=do_bwd,
        use_compile=use_compile,
        passes=passes,
        rank=rank,
    )


def _validate(job: OneDevice, metrics: dict[str, Any]) -> validation.Validated | None:
    """The validated rows against the float64 reference (validation.validate_rows), into
    `metrics`; the Validated call (None when validate=false)."""
    s = job.settings
    if not s.validate:
        metrics.update(validated_rows=0, validation="not run (validate=false)")
        return None

    def attend(g_masked: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, Any]:
        with torch.set_grad_enabled(job.do_bwd):  # the grad mode compiled for: no recompile
            out, lse = job.rank.attend()
        grads = job.rank.grads(out, g_masked) if g_masked is not None else None
        return out, lse, grads

    rows = validation.sample_rows(
        s.shape.seq_len, s.validate_rows, s.seed, job.q.device, block=s.block_size[0]
    )
    found, validated = validation.validate_rows(
        job.variant,
        job.q,
        job.k,
        job.v,
        job.grad_out,
        attend,
        do_bwd=job.do_bwd,
        rows=rows,
        rows_at_once=s.validate_rows,
    )
    metrics.update(found)
    return validated


def _check_timed(job: OneDevice, validated: validation.Validated, metrics: dict) -> None:
    """One more call as the timed ones are made (their grad mode), after them, held to the
    validated call: a kernel whose result changes with the calls before it fails here."""
    with torch.set_grad_enabled(job.do_bwd):
        out = phases.first(job.rank.attend())
    metrics.update(validated.agrees(out))
    validated.fold(metrics)


def _time_flex(job: OneDevice, metrics: dict[str, Any]) -> dict[str, Any]:
    """flex's timed passes with peak_mem_bytes around them; their metrics. Returns the timings."""
    s = job.settings
    with phases.peak_memory(job.rank, metrics, "peak_mem_bytes"):
        flex = phases.time_passes(job.rank, job.passes)
    metrics.update(pass_metrics(flex, s.shape, s.shape.seq_len, job.sparsity))
    metrics.update(
        phases.limits(job.rank, flex, _kept_flops(job), dtype=s.dtype,
                      tokens=s.shape.batch * s.shape.seq_len)
    )  # fmt: skip
    metrics["flash"] = _flash(s, metrics.get("kernel_path_fwd"))
    return flex


def _flash(settings: Settings, kernel_path: str | None) -> str:
    """ran (the forward's kernels were FLASH's), refused: the first FLASH rule the run breaks,
    or possible: none does."""
    from attngym.runner.config import flash_refusal

    if kernel_path is not None and kernel_path.startswith("flash"):
        return "ran"
    why = flash_refusal(settings)
    if why is not None:
        return f"refused: {why}"
    return "possible: no FLASH rule refuses it (kernel_options.BACKEND=FLASH block_size=flash)"


def _kept_flops(job: OneDevice) -> dict[str, float]:
    """Per pass, the FLOPs the mask keeps (what every `*_peak_fraction` counts)."""
    return pass_flops(job.settings.shape, job.settings.shape.seq_len, 1.0 - job.density)


def _time_baselines(
    job: OneDevice, flex: dict[str, Any], metrics: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    """The baselines that apply, on the same inputs and passes as flex (the context-parallel ones
    belong to CP runs): each set up in its own phase, then all timed together in one pass
    (phases.time_contenders); <name>_status, <name>_<pass>_ms, _tflops and _peak_fraction (on the
    FLOPs the mask keeps, as flex's), flex_over_<name>_<pass> and its _ci95. Returns
    {name: {pass: Timing}}."""
    from attngym import bench
    from attngym.runner.config import SINGLE_BASELINES

    s = job.settings
    flops = {"spent": pass_flops(s.shape, s.shape.seq_len, job.sparsity), "kept": _kept_flops(job)}
    contenders: dict[str, Contender] = {}
    for name in (b for b in s.baselines if b in SINGLE_BASELINES):
        with timeline.phase(f"baseline_{name}"):
            contender = _contender(name, job, metrics)
        if contender is not None:
            contenders[name] = contender
    failures: dict[str, dict[str, str]] = {}
    with timeline.phase("baselines"):
        times = phases.time_contenders(
            {name: (c.rank or job.rank, c.call) for name, c in contenders.items()},
            job.passes,
            failures,
        )
    for name, failed in failures.items():  # e.g. a forced SDPA backend with no backward here
        missing, reason = ", ".join(failed), next(iter(failed.values()))
        metrics[f"{name}_status"] = f"skipped: {missing}: {reason}"
        log.info("baseline %s %s skipped: %s", name, missing, reason)
    for name, by_pass in times.items():
        for p, timing in by_pass.items():
            metrics[baseline_metric(name, p, "ms")] = timing.median_ms
            metrics[baseline_metric(name, p, "tflops")] = bench.tflops(
                flops["spent"][p], timing.median_ms
            )
            metrics[baseline_metric(name, p, "peak_fraction")] = bench.peak_fraction(
                flops["kept"][p], timing.median_ms, metrics.get("peak_tflops")
            )
            if flex.get(p):
                metrics.update(phases.ratio(speedup_metric(name, p), timing, flex[p]))
    return times


@dataclasses.dataclass(kw_only=True)
class Contender:
    """A baseline's call, and where it differs from flex's: its own leaves and output gradient
    (`rank`: a varlen kernel reads q, k, v packed as (T, H, D), made once outside the timing),
    and how its output reads as flex's (B, H, S, D) to be checked against it (`unpack`)."""

    call: Callable[[], Any]
    rank: phases.Rank | None = None
    unpack: Callable[[torch.Tensor], torch.Tensor] | None = None


def _contender(name: str, job: OneDevice, metrics: dict[str, Any]) -> Contender | None:
    """One baseline ready to time, its output checked against flex's where it reads q, k, v its
    own way; or None, recorded as skipped with the reason."""
    s = job.settings
    if name in s.skipped_baselines:  # the memory estimate: it alone would not fit
        contender, reason = None, s.skipped_baselines[name]
    elif name in varlen.KERNELS:
        contender, reason = _varlen(name, job)
    else:
        fn, reason = _baseline(name, job.variant, job.q, job.k, job.v, s, job.rank.device)
        contender = None if fn is None else Contender(call=fn)
    metrics[f"{name}_status"] = "ok" if contender is not None else f"skipped: {reason}"
    if contender is None:
        log.info("baseline %s skipped: %s", name, reason)
        return None
    if contender.unpack is not None:
        metrics.update(_agreement(name, job, contender))
    return contender


def _varlen(name: str, job: OneDevice) -> tuple[Contender | None, str]:
    """A varlen kernel on the run's q, k, v packed as it reads them (attngym.varlen), with its
    own leaves and output gradient so the timed calls hold no packing; or (None, why not)."""
    q, k, v = job.q, job.k, job.v
    why = varlen.refusal(name, job.variant, q.device, q.dtype, gqa=k.shape[1] != q.shape[1])
    if why is not None:
        return None, why
    batch = q.shape[0]
    leaves = tuple(varlen.pack(t.detach()).requires_grad_(job.do_bwd) for t in (q, k, v))
    call = varlen.call(name, job.variant, *leaves, batch)
    rank = dataclasses.replace(
        job.rank, attend=call, leaves=leaves, grad_out=varlen.pack(job.grad_out)
    )
    return Contender(call=call, rank=rank, unpack=lambda out: varlen.unpack(out, batch)), ""


def _agreement(name: str, job: OneDevice, contender: Contender) -> dict[str, Any]:
    """The contender's output against flex's on the validated rows, judged as torch_cp's is: two
    kernels each within RTOL of the float64 truth agree within about 2 x RTOL; a wrong mask,
    window or packing gives errors of order 1e-1 to 1."""
    s = job.settings
    if not s.validate:
        return {f"{name}_validation": "not run (validate=false)"}
    with torch.no_grad():
        theirs = contender.unpack(phases.first(contender.call()))
        ours = phases.first(job.rank.attend())
    rows = validation.sample_rows(s.shape.seq_len, s.validate_rows, s.seed, theirs.device)
    theirs, ours = theirs[:, :, rows], ours[:, :, rows]
    limit = 2 * validation.RTOL[s.dtype]
    err = validation.rel_error(theirs, ours)
    verdict = "ok" if err <= limit else f"failed: {name}_err_out_rel={err:.3g} > {limit:g}"
    return {
        f"{name}_err_out_rel": err,
        f"{name}_validation": verdict if verdict == "ok" else f"{verdict} ({s.dtype})",
    }


# The contenders `best_sdpa` chooses from; `best` also from the varlen kernels.
SDPA_FAMILY = ("sdpa", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "sdpa_dense_mask")


def _best(
    metrics: dict[str, Any],
    flex_ms: dict[str, Any],
    times: dict[str, dict[str, Any]],
    headline: str,
    among: tuple[str, ...],
) -> dict[str, Any]:
    """A headline: flex against the fastest of `among` that ran (and agreed with flex), per pass.

    Args:
        times: the baselines' {name: {pass: Timing}}, whose timed calls give the interval.

    Returns:
        `<headline>_<pass>` (the contender's name), `<headline>_<pass>_ms` and
        `flex_over_<headline>_<pass>` (its time / flex's time; > 1: flex is faster) with its
        `_ci95`.
    """
    out: dict[str, Any] = {}
    for p, timing in flex_ms.items():
        ran = {
            name: metrics[baseline_metric(name, p, "ms")]
            for name in among
            if metrics.get(baseline_metric(name, p, "ms"))
            and not str(metrics.get(f"{name}_validation", "")).startswith("failed")
        }
        if not ran or timing is None:
            continue
        best = min(ran, key=ran.get)
        out[f"{headline}_{p}"] = best
        out[f"{headline}_{p}_ms"] = ran[best]
        out.update(phases.ratio(speedup_metric(headline, p), times[best][p], timing))
    return out


def _baseline(
    name: str,
    variant: Variant,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    settings: Settings,
    device: torch.device,
) -> tuple[Callable[[], torch.Tensor] | None, str]:
    """The baseline's forward closure on these inputs, or (None, why it does not apply)."""
    import torch.nn.functional as F

    gqa = k.shape[1] != q.shape[1]
    if name == "sdpa" or name in SDPA_BACKENDS:
        if variant.sdpa is None:
            return None, f"no SDPA form of {variant.name!r} (is_causal only)"
        if name != "sdpa" and device.type != "cuda":
            return None, f"{name} is a CUDA backend"
        is_causal = variant.sdpa == "causal"

        def sdpa() -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=gqa)

        if name == "sdpa":
            return sdpa, ""
        return _forced_backend(name, sdpa, q)
    if name == "flex_default":
        if (
            tuple(settings.block_size) == (128, 128)
            and not settings.kernel_options
            and settings.compile_mode == "default"
        ):
            return None, "flex already runs with the default block size, options and compile mode"
        default_mask = kernels.make_block_mask(
            variant, q.shape[2], k.shape[2], block_size=(128, 128), device=device
        )
        use_compile = settings.compile and device.type == "cuda"
        return (
            lambda: kernels.attend_chunk(
                q, k, v, variant, backend="flex", block_mask=default_mask, compile=use_compile
            ),
            "",
        )
    if name == "sdpa_dense_mask":
        mask, reason = dense_mask_or_bias(
            variant,
            q.shape[0],
            q.shape[1],
            q.shape[2],
            device=device,
            dtype=q.dtype,
            max_bytes=settings.baseline_max_mask_bytes,
        )
        if mask is None:
            return None, reason
        return (
            lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa),
            "",
        )
    raise ValueError(f"unknown baseline {name!r}")


SDPA_BACKENDS = {
    "sdpa_cudnn": "CUDNN_ATTENTION",
    "sdpa_flash": "FLASH_ATTENTION",
    "sdpa_efficient": "EFFICIENT_ATTENTION",
}


def _forced_backend(
    name: str, sdpa: Callable[[], torch.Tensor], q: torch.Tensor
) -> tuple[Callable[[], torch.Tensor] | None, str]:
    """`sdpa` forced onto one SDPA backend, or (None, why) when that backend refuses the inputs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, SDPA_BACKENDS[name])

    def forced() -> torch.Tensor:
        with sdpa_kernel(backend):
            return sdpa()

    try:
        with torch.no_grad():
            forced()
    except RuntimeError as exc:  # "No available kernel": the backend does not take these inputs
        return None, f"{SDPA_BACKENDS[name]} does not run here ({str(exc).splitlines()[0][:120]})"
    return forced, ""


def dense_mask_or_bias(
    variant: Variant,
    batch: int,
    heads: int,
    seq_len: int,
    *,
    device: torch.device,
    dtype: torch.dtype,
    max_bytes: int,
) -> tuple[torch.Tensor | None, str]:
    """The variant as an SDPA `attn_mask`: a bool mask, or a float bias when its score_mod adds
    a term independent of the score (ALiBi, relative position), or (None, reason).

    The additive test evaluates the score_mod on two random score tiles at sampled positions:
    an additive mod gives the same `mod(s) - s` on both.

    Returns:
        mask: (1, 1, S, S) bool or (B or 1, H or 1, S, S) in `dtype`; or None and the reason.
    """
    if variant.score_mod is None and variant.mask_mod is None:
        return None, "nothing to mask (the same as sdpa)"
    itemsize = 1 if variant.score_mod is None else torch.finfo(dtype).bits // 8 * heads
    need = seq_len * seq_len * itemsize
    if need > max_bytes:
        return None, (
            f"a dense mask needs {need / 2**20:.0f} MiB > baseline_max_mask_bytes "
            f"({max_bytes / 2**20:.0f} MiB)"
        )
    positions = torch.arange(seq_len, device=device)
    keep = reference.dense_mask(variant.mask_mod, batch, heads, positions, positions)
    if variant.score_mod is None:
        return keep, ""
    if not _is_additive(variant, batch, heads, seq_len, device):
        return None, "its score_mod is not an additive bias, so SDPA cannot express it"
    b, h, q_idx, kv_idx = reference.index_grids(batch, heads, positions, positions)
    zero = torch.zeros((), device=device, dtype=torch.float32)
    bias = variant.score_mod(zero, b, h, q_idx, kv_idx).to(torch.float32)
    bias = bias.masked_fill(~keep, float("-inf"))
    return bias.to(dtype), ""


def _is_additive(variant: Variant, batch: int, heads: int, seq_len: int, device) -> bool:
    gen = torch.Generator().manual_seed(0)
    pos = torch.randperm(seq_len, generator=gen)[:64].to(device)
    b, h, q_idx, kv_idx = reference.index_grids(batch, heads, pos, pos)
    shape = (batch, heads, pos.numel(), pos.numel())
    s1 = torch.randn(shape, generator=gen).to(device)
    s2 = 3.0 * torch.randn(shape, generator=gen).to(device)
    d1 = variant.score_mod(s1, b, h, q_idx, kv_idx) - s1
    d2 = variant.score_mod(s2, b, h, q_idx, kv_idx) - s2
    return bool(torch.allclose(d1, d2, rtol=1e-4, atol=1e-4))


def _profile(
    settings: Settings, fwd: Callable[[], Any], device: torch.device, run_dir: Path
) -> dict[str, Any]:
    """Profile one forward call with the configured profiler; its results go to profile.json."""
    profiler = registry.build("profiler", settings.profiler, run_dir=Path(run_dir))
    with profiler as result, torch.no_grad():
        fwd()
        sync(device)
    result = dict(result or {})
    path = atomic_write(Path(run_dir) / "profile.json", json.dumps(result, indent=2, default=str))
    log.info("profiler %s: results in %s", settings.profiler, path)
    return {"profiler": settings.profiler}
