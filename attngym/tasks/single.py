"""One device, the whole sequence: FlexAttention checked, timed and compared with SDPA baselines.

Everything runs in one process on the same inputs, so the ratios between flex and the baselines
are not skewed by different data, allocator state or clocks. The order is fixed:

1. build the variant and the block mask (block size from the config), draw seeded inputs;
2. the first flex call (fwd, and bwd when requested) is timed apart: on CUDA it is compilation;
3. validation on a bounded sample of query rows against the float64 dense reference, so memory
   stays O(rows x S) whatever S is; gradients too on CUDA, by feeding the output gradient only on
   the sampled rows (then dk and dv of both sides depend on those rows alone);
4. timings (attngym.bench.time_fn) of fwd, and on CUDA bwd and fwd+bwd, with peak memory;
5. baselines that apply, timed the same way; those that do not are recorded with the reason.

On CPU flex runs eagerly and forward only (FlexAttention has no CPU backward): `bwd_status` says
so and the backward metrics are None.

Shape legend: B batch, H query heads, G kv heads, S sequence, D head dim, R validated rows.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from attngym import kernels, reference, registry, validation
from attngym.config import Settings
from attngym.device import sync
from attngym.fileio import atomic_write
from attngym.inputs import make_inputs, torch_dtype
from attngym.metrics import baseline_metric, pass_flops, pass_metrics, speedup_metric
from attngym.variants.base import Variant

log = logging.getLogger(__name__)

NO_CPU_BWD = "not available: FlexAttention has no CPU backward"


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
    from attngym import bench
    from attngym import device as device_mod

    device = torch.device(settings.device)
    dtype = torch_dtype(settings.dtype)
    shape = settings.shape
    seq_len = shape.seq_len
    variant = settings.variant.to(device)
    metrics = {} if metrics is None else metrics
    metrics.update(settings.describe())

    can_bwd = device.type == "cuda"
    want_bwd = "bwd" in settings.passes
    do_bwd = want_bwd and can_bwd
    metrics["bwd_status"] = "ok" if do_bwd else (NO_CPU_BWD if want_bwd else "not requested")
    q, k, v, grad_out = make_inputs(
        settings.shape, settings.seed, device, dtype, requires_grad=do_bwd
    )

    block_mask = kernels.make_block_mask(
        variant, seq_len, seq_len, block_size=settings.block_size, device=device
    )
    sparsity = float(bench.block_sparsity(block_mask)) if block_mask is not None else 0.0
    metrics["sparsity"] = sparsity
    use_compile = settings.compile and device.type == "cuda"

    def fwd() -> tuple[torch.Tensor, torch.Tensor]:
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

    # 2. The first call, timed apart (compilation on CUDA; the first eager call on CPU).
    start = time.perf_counter()
    out, lse = fwd()
    if do_bwd:
        torch.autograd.grad(out, (q, k, v), grad_out)
    sync(device)
    metrics["compile_s"] = time.perf_counter() - start
    what = "compile + first call" if use_compile else "first eager call"
    log.info("flex %s: %.2f s", what, metrics["compile_s"])

    del out, lse

    # 3. Validation on sampled rows.
    if settings.validate:

        def attend(g_masked: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, Any]:
            out, lse = fwd()
            grads = torch.autograd.grad(out, (q, k, v), g_masked) if g_masked is not None else None
            return out, lse, grads

        metrics.update(
            validation.validate_rows(
                variant,
                q,
                k,
                v,
                grad_out,
                attend,
                do_bwd=do_bwd,
                max_rows=settings.validate_rows,
                seed=settings.seed,
            )
        )
    else:
        metrics["validated_rows"] = 0
        metrics["validation"] = "not run (validate=false)"

    # 4. Timings. peak_mem_bytes is what the flex calls add to what is live before them (the
    # inputs, the L2-flush buffer, anything an earlier run in this process still holds).
    if device.type == "cuda":
        bench.l2_flush_buffer(device)
    sync(device)
    flops = pass_flops(shape, seq_len, sparsity)
    with device_mod.peak_memory(device) as peak:
        flex_ms = _time_passes("flex", fwd, q, k, v, grad_out, settings, device, do_bwd)
    metrics["peak_mem_bytes"] = peak["bytes"]
    metrics.update(pass_metrics(flex_ms, shape, seq_len, sparsity))

    # Profile one call, in the run folder.
    if settings.profiler != "none":
        metrics.update(_profile(settings, fwd, device, run_dir))

    # 5. Baselines on the same inputs (the context-parallel ones belong to CP runs).
    from attngym.config import SINGLE_BASELINES

    for name in (b for b in settings.baselines if b in SINGLE_BASELINES):
        if name in settings.skipped_baselines:  # the memory estimate: it alone would not fit
            fn, reason = None, settings.skipped_baselines[name]
        else:
            fn, reason = _baseline(name, variant, q, k, v, settings, device)
        metrics[f"{name}_status"] = "ok" if fn is not None else f"skipped: {reason}"
        if fn is None:
            log.info("baseline %s skipped: %s", name, reason)
            continue
        failures: dict[str, str] = {}
        times = _time_passes(name, fn, q, k, v, grad_out, settings, device, do_bwd, failures)
        if failures:  # e.g. a forced SDPA backend with a forward but no backward for these inputs
            missing = ", ".join(failures)
            reason = next(iter(failures.values()))
            metrics[f"{name}_status"] = f"skipped: {missing}: {reason}"
            log.info("baseline %s %s skipped: %s", name, missing, reason)
        for p, timing in times.items():
            metrics[baseline_metric(name, p, "ms")] = timing.median_ms
            metrics[baseline_metric(name, p, "tflops")] = bench.tflops(flops[p], timing.median_ms)
            if flex_ms.get(p):
                metrics[speedup_metric(name, p)] = timing.median_ms / flex_ms[p].median_ms
        del fn
    metrics.update(_best_sdpa(metrics, flex_ms))
    return metrics


def _best_sdpa(metrics: dict[str, Any], flex_ms: dict[str, Any]) -> dict[str, Any]:
    """The headline: flex against the fastest SDPA contender that ran, per pass.

    Returns:
        `best_sdpa_<pass>` (the contender's name), `best_sdpa_<pass>_ms` and
        `flex_over_best_sdpa_<pass>` (its time / flex's time; > 1: flex is faster).
    """
    from attngym.config import BASELINES

    out: dict[str, Any] = {}
    for p, timing in flex_ms.items():
        times = {
            name: metrics[baseline_metric(name, p, "ms")]
            for name in BASELINES
            if name.startswith("sdpa") and metrics.get(baseline_metric(name, p, "ms"))
        }
        if not times or timing is None:
            continue
        best = min(times, key=times.get)
        out[f"best_sdpa_{p}"] = best
        out[f"best_sdpa_{p}_ms"] = times[best]
        out[speedup_metric("best_sdpa", p)] = times[best] / timing.median_ms
    return out


def _time_passes(
    label: str,
    fwd: Callable[[], Any],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    settings: Settings,
    device: torch.device,
    do_bwd: bool,
    failures: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Timings of the requested passes: {"fwd": Timing, "bwd": Timing, "fwd_bwd": Timing}.

    With `failures` (a baseline), a pass whose call raises RuntimeError (a backend with no kernel
    for it) is left out of the timings and its reason stored in `failures[pass]`; the other passes
    are still timed. Without it (flex) the error propagates and fails the run.
    """
    from attngym import bench

    def first(result: Any) -> torch.Tensor:
        return result[0] if isinstance(result, tuple) else result

    bench_cfg = settings.benchmark
    timings: dict[str, Any] = {}

    def timed(name: str, fn: Callable[..., Any], setup: Callable[[], Any] | None = None) -> None:
        try:
            timings[name] = bench.time_fn(
                fn,
                warmup=bench_cfg.warmup,
                repeats=bench_cfg.repeats,
                device=device,
                progress=f"{label} {name}",
                setup=setup,
            )
        except RuntimeError as exc:
            if failures is None:
                raise
            failures[name] = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__

    if "fwd" in settings.passes:
        if do_bwd:
            timed("fwd", fwd)
        else:
            with torch.no_grad():
                timed("fwd", fwd)
    if do_bwd:
        # A fresh forward graph per timed backward, built outside the timed region.
        timed(
            "bwd",
            lambda out: torch.autograd.grad(out, (q, k, v), grad_out),
            setup=lambda: first(fwd()),
        )
        timed("fwd_bwd", lambda: torch.autograd.grad(first(fwd()), (q, k, v), grad_out))
    return timings


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
            return None, f"SDPA cannot express {variant.name!r} with is_causal alone"
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
