"""Helpers every task shares, so single-device and context-parallel runs agree on the details.

A task must build the same variant from the same config, draw the same seeded inputs, validate the
same sampled rows the same way and report errors under the same metric names; otherwise a ring run
and a single-device run of one config could not be compared row by row in a sweep summary. Those
pieces live here and their names are stable: the ring and all-gather tasks import them.

Shape legend: B batch, H query heads, G key/value heads, S sequence, D head dim, R sampled rows.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from attngym import config, reference, variants
from attngym.config import Settings, Shape
from attngym.errors import ConfigError, choice_error, closest
from attngym.variants.base import Variant

log = logging.getLogger(__name__)

# The resolved dtype names of attngym.config.DTYPES (all but "auto") as torch dtypes.
DTYPES = {name: getattr(torch, name) for name in config.DTYPES if name != "auto"}

# Metric names every task reports (values may be None where a quantity does not apply).
METRIC_NAMES = (
    "status",
    "error",
    "variant",
    "topology",
    "world_size",
    "transport",
    "device",
    "dtype",
    "batch",
    "heads",
    "kv_heads",
    "seq_len",
    "head_dim",
    "block_q",
    "block_kv",
    "sparsity",
    "fwd_ms",
    "fwd_ms_min",
    "fwd_ms_max",
    "bwd_ms",
    "fwd_bwd_ms",
    "fwd_tflops",
    "bwd_tflops",
    "fwd_bwd_tflops",
    "compile_s",
    "peak_mem_bytes",
    "err_out_max_abs",
    "err_out_rel",
    "err_lse_max_abs",
    "err_dq_rel",
    "err_dk_rel",
    "err_dv_rel",
    "validated_rows",
    "validation",
    "bwd_status",
)

# The flex_over_<baseline>_<pass> ratios worth a column in results tables (every other ratio is
# in metrics.json): flex against the fastest SDPA, a dense-mask SDPA and flex untuned.
HEADLINE_BASELINES = ("best_sdpa", "sdpa_dense_mask", "flex_default")
HEADLINE_RATIOS = tuple(
    f"flex_over_{b}_{p}" for b in HEADLINE_BASELINES for p in ("fwd", "bwd", "fwd_bwd")
)


# What a context-parallel run adds to a results table: how it scaled and where the time went.
CP_COLUMNS = (
    "layout",
    "efficiency",
    "efficiency_fwd_bwd",
    "single_fwd_ms",
    "single_fwd_bwd_ms",
    "step_compute_ms",
    "step_transfer_ms",
)


def table_columns() -> tuple[str, ...]:
    """Columns of a results table (summary.md, report.html): every METRIC_NAMES entry, the
    context-parallel columns, then the headline ratios, the error last. Tables show those present
    in at least one row."""
    return (*(n for n in METRIC_NAMES if n != "error"), *CP_COLUMNS, *HEADLINE_RATIOS, "error")


# Validation tolerances per dtype, judged against the float64 reference on the validated rows.
# RTOL bounds the norm-wise relative errors (err_out_rel, err_dq_rel, err_dk_rel, err_dv_rel). The
# reference sees the same rounded inputs, so what is measured is the kernel's own rounding: bf16
# keeps 8 significant bits (unit roundoff 2^-8 ~ 4e-3) and flex rounds the probabilities to bf16
# before P @ V and the output once more, which measures ~2e-3 to 5e-3; 2e-2 leaves a 4-5x margin
# while a wrong mask or score_mod (errors of order 1e-1 to 1) still fails. fp16 keeps 11 bits
# (~5e-4 roundoff): 1e-2. fp32 accumulates in fp32 (~1e-7 measured, longer sums on long rows): 1e-4.
# fp64 runs the same arithmetic as the reference: 1e-8.
RTOL = {"bfloat16": 2e-2, "float16": 1e-2, "float32": 1e-4, "float64": 1e-8}
# LSE_ATOL bounds err_lse_max_abs, an absolute error: the lse is a log of a sum of exp(scores),
# of order max score + log S, and is kept in fp32 by flex whatever the input dtype, so the error
# comes from scores computed on 16-bit inputs (1e-2 covers them), or fp32/fp64 rounding.
LSE_ATOL = {"bfloat16": 1e-2, "float16": 1e-2, "float32": 1e-4, "float64": 1e-8}
REL_ERRORS = ("err_out_rel", "err_dq_rel", "err_dk_rel", "err_dv_rel")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a resolved dtype name ("float32", "bfloat16", ...)."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(choice_error("dtype", name, DTYPES)) from None


def build_variant(
    attention: Mapping[str, Any], *, key: str = "attention", seq_len: int | None = None
) -> Variant:
    """The Variant an `attention` config entry describes, composed entries included.

    Args:
        attention: `{"name": NAME, **params}` or `{"name": NAME, "compose": [entry, ...]}`; each
            composed entry is built like a plain one, then masks are AND-ed and score_mods chained
            (attngym.variants.compose); the result is renamed NAME.
        key: dotted config key of `attention`, used in error messages.
        seq_len: when given, the variant must be defined at this length (document lengths, a
            natten canvas).

    Raises:
        ConfigError: unknown variant or parameter, a missing or bad parameter, a seq_len mismatch;
            the key names the offending entry, e.g. `attention.compose.0.window_size`.
    """
    if not isinstance(attention, Mapping) or "name" not in attention:
        raise ConfigError(key, f"needs a 'name' (one of {', '.join(variants.names())})")
    name = attention["name"]
    if "compose" in attention:
        parts = attention["compose"]
        extra = sorted(set(attention) - {"name", "compose"})
        if extra:
            raise ConfigError(f"{key}.{extra[0]}", "a composed attention takes only name, compose")
        if not isinstance(parts, Sequence) or isinstance(parts, str) or not parts:
            raise ConfigError(f"{key}.compose", f"must be a non-empty list, got {parts!r}")
        built = [build_variant(p, key=f"{key}.compose.{i}") for i, p in enumerate(parts)]
        try:
            variant = variants.compose(*built)
        except ValueError as err:
            raise ConfigError(f"{key}.compose", str(err)) from None
        import dataclasses

        variant = dataclasses.replace(variant, name=str(name))
    else:
        if name not in variants.names():
            raise ConfigError(
                f"{key}.name", choice_error("attention variant", name, variants.names())
            )
        params = {k: v for k, v in attention.items() if k != "name"}
        sig = inspect.signature(variants.factory(name))
        for param in params:
            if param not in sig.parameters:
                allowed = ", ".join(sig.parameters) or "none"
                hint = closest(param, sig.parameters)
                suffix = f" (did you mean {hint!r}?)" if hint else ""
                raise ConfigError(
                    f"{key}.{param}",
                    f"{name!r} has no parameter {param!r} (value {params[param]!r}); "
                    f"its parameters: {allowed}{suffix}",
                )
        for param, p in sig.parameters.items():
            if p.default is inspect.Parameter.empty and param not in params:
                raise ConfigError(f"{key}.{param}", f"{name!r} needs this parameter; none given")
        try:
            variant = variants.get(name, **params)
        except (ValueError, TypeError) as err:
            message = str(err)
            bad = next((p for p in params if message.startswith(p)), None)
            raise ConfigError(f"{key}.{bad}" if bad else key, message) from None
    if seq_len is not None and variant.seq_len is not None and variant.seq_len != seq_len:
        what = {"document": "doc_lengths", "natten": "canvas_w"}.get(str(name))
        detail = f"{dict(variant.params)}" if what is None else f"{attention.get(what)!r}"
        hint = {
            "doc_lengths": "the document lengths must sum to shape.seq_len",
            "canvas_w": "canvas_w * canvas_h must equal shape.seq_len",
        }.get(what, "the variant is built for another length")
        raise ConfigError(
            f"{key}.{what}" if what else key,
            f"{detail} describes {variant.seq_len} tokens but shape.seq_len={seq_len}; {hint}",
        )
    return variant


def make_inputs(
    settings: Settings,
    device: torch.device | str,
    dtype: torch.dtype,
    requires_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeded random q, k, v and an output gradient for the whole sequence.

    The same settings give the same tensors on every rank and every topology (drawn in float32
    on the CPU from `settings.seed`, then moved and cast), so a sharded run can be checked against
    the unsharded one.

    Returns:
        q: (B, H, S, D); k, v: (B, G, S, D); grad_out: (B, H, S, D) — all in `dtype` on `device`;
        q, k, v require grad when `requires_grad`.
    """
    s = settings.shape
    kv_heads = s.kv_heads or s.heads
    gen = torch.Generator().manual_seed(settings.seed)
    shapes = [
        (s.batch, s.heads, s.seq_len, s.head_dim),
        (s.batch, kv_heads, s.seq_len, s.head_dim),
        (s.batch, kv_heads, s.seq_len, s.head_dim),
        (s.batch, s.heads, s.seq_len, s.head_dim),
    ]
    out = [torch.randn(shape, generator=gen).to(device=device, dtype=dtype) for shape in shapes]
    q, k, v, grad_out = out
    if requires_grad:
        for t in (q, k, v):
            t.requires_grad_(True)
    return q, k, v, grad_out


def sample_rows(seq_len: int, max_rows: int, seed: int, device: torch.device | str) -> torch.Tensor:
    """Sorted query positions to validate: all rows when S <= max_rows, else a seeded sample.

    The first and last rows are always included (masks are most often wrong at the edges).

    Returns:
        (R,) int64 positions, R = min(S, max_rows).
    """
    if seq_len <= max_rows:
        return torch.arange(seq_len, device=device)
    gen = torch.Generator().manual_seed(seed + 1)
    inner = torch.randperm(seq_len - 2, generator=gen)[: max(max_rows - 2, 0)] + 1
    rows = torch.cat([torch.tensor([0, seq_len - 1]), inner]).sort().values
    return rows.to(device)


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64 (0 when both are zero)."""
    a, e = actual.double(), expected.double()
    denom = e.norm().item()
    diff = (a - e).norm().item()
    return diff / denom if denom > 0 else diff


def max_abs_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest |actual - expected|; entries where both are -inf (empty rows' lse) count as 0."""
    a, e = actual.double(), expected.double()
    both_inf = torch.isinf(a) & torch.isinf(e) & (torch.sign(a) == torch.sign(e))
    diff = torch.where(both_inf, torch.zeros_like(a), (a - e).abs())
    diff = torch.nan_to_num(diff, nan=math.inf)
    return float(diff.max().item()) if diff.numel() else 0.0


def output_errors(
    out: torch.Tensor, lse: torch.Tensor, ref_out: torch.Tensor, ref_lse: torch.Tensor
) -> dict[str, float]:
    """err_out_max_abs, err_out_rel, err_lse_max_abs of (out, lse) against the reference.

    Args:
        out: (B, H, R, D) kernel output on the validated rows; ref_out the same from the oracle.
        lse: (B, H, R) kernel log-sum-exp; ref_lse the same from the oracle.
    """
    return {
        "err_out_max_abs": max_abs_error(out, ref_out),
        "err_out_rel": rel_error(out, ref_out),
        "err_lse_max_abs": max_abs_error(lse, ref_lse),
    }


def grad_errors(
    grads: Sequence[torch.Tensor], ref_grads: Sequence[torch.Tensor]
) -> dict[str, float]:
    """err_dq_rel, err_dk_rel, err_dv_rel of (dq, dk, dv) against the reference gradients."""
    names = ("err_dq_rel", "err_dk_rel", "err_dv_rel")
    return {n: rel_error(g, r) for n, g, r in zip(names, grads, ref_grads, strict=True)}


def base_metrics(settings: Settings) -> dict[str, Any]:
    """The metrics that describe the configuration (variant, shape, topology, dtype, blocks,
    kernel options as `kernel_options.<NAME>`, and the device: gpu, capability, torch)."""
    from attngym.device import device_info

    s = settings.shape
    info = device_info(settings.device)
    options = {f"kernel_options.{k}": v for k, v in sorted(settings.kernel_options.items())}
    return {
        "variant": str(settings.attention.get("name")),
        "topology": settings.topology.kind,
        "world_size": settings.topology.world_size,
        "transport": settings.topology.transport,
        "layout": settings.topology.layout if settings.topology.kind != "single" else None,
        "device": settings.device,
        "dtype": settings.dtype,
        "batch": s.batch,
        "heads": s.heads,
        "kv_heads": s.kv_heads or s.heads,
        "seq_len": s.seq_len,
        "head_dim": s.head_dim,
        "block_q": settings.block_size[0],
        "block_kv": settings.block_size[1],
        **options,
        "gpu": info["name"],
        "capability": info["capability"],
        "torch": info["torch"],
    }


def baseline_metric(baseline: str, pass_name: str, what: str) -> str:
    """`<baseline>_<pass>_<what>`, e.g. sdpa_fwd_ms, sdpa_dense_mask_fwd_tflops."""
    return f"{baseline}_{pass_name}_{what}"


def speedup_metric(baseline: str, pass_name: str) -> str:
    """`flex_over_<baseline>_<pass>`: baseline time / flex time (> 1: flex is faster)."""
    return f"flex_over_{baseline}_{pass_name}"


def sync(device: torch.device | str) -> None:
    """Wait for the device's queued work (a no-op on CPU), so host timers and peaks are honest."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def judge_errors(metrics: Mapping[str, Any], dtype: str) -> str:
    """The validation verdict of error metrics: "ok" or "failed: <what> (<dtype>)".

    Relative errors (REL_ERRORS) are judged against RTOL[dtype], err_lse_max_abs against
    LSE_ATOL[dtype]; metrics that are None (gradients not computed) are not judged; NaN fails.

    Returns:
        e.g. "ok", or "failed: err_out_rel=0.31 > 0.02 (bfloat16)" (every violation, "; "-joined).
    """
    if dtype not in RTOL:
        raise ValueError(choice_error("dtype", dtype, RTOL))
    limits = {name: RTOL[dtype] for name in REL_ERRORS}
    limits["err_lse_max_abs"] = LSE_ATOL[dtype]
    bad = [
        f"{name}={value:.3g} > {limit:g}"
        for name, limit in limits.items()
        if (value := metrics.get(name)) is not None and not value <= limit
    ]
    return f"failed: {'; '.join(bad)} ({dtype})" if bad else "ok"


def validate_rows(
    settings: Settings,
    variant: Variant,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    attend: Callable[
        [torch.Tensor | None],
        tuple[torch.Tensor, torch.Tensor, Sequence[torch.Tensor] | None],
    ],
    *,
    do_bwd: bool,
) -> dict[str, Any]:
    """Errors of one attention call (output, lse and, when do_bwd, dq/dk/dv) on sampled rows
    against the float64 dense reference, and their verdict.

    The rows are `sample_rows(S, settings.validate_rows, settings.seed)`, so memory stays
    O(R x S). For the gradients the output gradient is kept on the sampled rows only (`g_masked`,
    zero elsewhere): then dk and dv of the kernel depend on those rows alone and compare exactly
    with the reference's dk, dv for the R-row problem; dq is compared on the sampled rows.

    Args:
        q: (B, H, S, D); k, v: (B, G, S, D); grad_out: (B, H, S, D) — the whole-sequence inputs
            the kernel attended (the reference works on detached float64 copies).
        attend: `attend(g_masked) -> (out, lse, grads)` runs the kernel under test on the whole
            problem and returns out (B, H, S, D), lse (B, H, S) and, when `g_masked` (B, H, S, D)
            is given, the whole-sequence gradients (dq, dk, dv) for that output gradient
            (else None). It is called once, with None when not do_bwd. A sharded task gathers
            its shards inside `attend`.
        do_bwd: also compare gradients.

    Returns:
        validated_rows, err_out_max_abs, err_out_rel, err_lse_max_abs, err_dq_rel, err_dk_rel,
        err_dv_rel (None without do_bwd) and `validation` ("ok" or "failed: ...", judge_errors).
    """
    seq_len = q.shape[2]
    rows = sample_rows(seq_len, settings.validate_rows, settings.seed, q.device)  # (R,)
    metrics: dict[str, Any] = {"validated_rows": int(rows.numel())}
    q64 = q.detach()[:, :, rows].double().requires_grad_(do_bwd)  # (B, H, R, D)
    k64 = k.detach().double().requires_grad_(do_bwd)  # (B, G, S, D)
    v64 = v.detach().double().requires_grad_(do_bwd)
    ref_out, ref_lse = reference.attention(
        q64, k64, v64, variant.score_mod, variant.mask_mod, q_positions=rows, dtype=torch.float64
    )  # (B, H, R, D), (B, H, R)
    g_masked = None
    if do_bwd:
        g_rows = grad_out.detach()[:, :, rows]  # (B, H, R, D)
        g_masked = torch.zeros_like(grad_out)
        g_masked[:, :, rows] = g_rows
    out, lse, grads = attend(g_masked)
    metrics.update(
        output_errors(out.detach()[:, :, rows], lse.detach()[:, :, rows], ref_out.detach(), ref_lse)
    )
    if do_bwd and grads is not None:
        dq, dk, dv = grads
        ref_grads = torch.autograd.grad(ref_out, (q64, k64, v64), g_rows.double())
        metrics.update(grad_errors((dq[:, :, rows], dk, dv), ref_grads))
    else:
        metrics.update({"err_dq_rel": None, "err_dk_rel": None, "err_dv_rel": None})
    metrics["validation"] = judge_errors(metrics, settings.dtype)
    log.info(
        "validated %d rows: out max abs err %.3g, rel %.3g; lse max abs err %.3g; %s",
        metrics["validated_rows"],
        metrics["err_out_max_abs"],
        metrics["err_out_rel"],
        metrics["err_lse_max_abs"],
        metrics["validation"],
    )
    return metrics


PASS_PARTS = {"fwd": ("fwd",), "bwd": ("bwd",), "fwd_bwd": ("fwd", "bwd")}


def pass_flops(shape: Shape, seq_len: int, sparsity: float) -> dict[str, float]:
    """Useful FLOPs of each pass ("fwd", "bwd", "fwd_bwd") for the whole problem.

    Args:
        shape: the run's shape (batch, heads, head_dim); seq_len: S for both q and kv.
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
    timings: Mapping[str, Any], shape: Shape, seq_len: int, sparsity: float
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
