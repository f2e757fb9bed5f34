"""Validation against the float64 dense reference: sampled rows, error metrics, their verdict.

Every task validates the same way, so a single-device run and a context-parallel run of one config
report comparable errors under the same names (attngym.metrics) and are judged by the same
tolerances. The functions take tensors and plain numbers, not the run's settings, so they serve a
notebook as well as a task.

Shape legend: B batch, H query heads, G key/value heads, S sequence, D head dim, R sampled rows.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from attngym import reference
from attngym.errors import choice_error
from attngym.variants.base import Variant

log = logging.getLogger(__name__)

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


def sample_rows(seq_len: int, max_rows: int, seed: int, device: torch.device | str) -> torch.Tensor:
    """Sorted query positions to validate: all rows when S <= max_rows, else a seeded sample.

    The first and last rows are always included (masks are most often wrong at the edges), the
    first alone when max_rows is 1.

    Returns:
        (R,) int64 positions, R = min(S, max_rows).
    """
    if seq_len <= max_rows:
        return torch.arange(seq_len, device=device)
    if max_rows == 1:
        return torch.zeros(1, dtype=torch.int64, device=device)
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
    out: torch.Tensor, lse: torch.Tensor | None, ref_out: torch.Tensor, ref_lse: torch.Tensor
) -> dict[str, float | None]:
    """err_out_max_abs, err_out_rel, err_lse_max_abs of (out, lse) against the reference.

    Args:
        out: (B, H, R, D) kernel output on the validated rows; ref_out the same from the oracle.
        lse: (B, H, R) kernel log-sum-exp, or None for a kernel that keeps none (then
            err_lse_max_abs is None); ref_lse the same from the oracle.
    """
    return {
        "err_out_max_abs": max_abs_error(out, ref_out),
        "err_out_rel": rel_error(out, ref_out),
        "err_lse_max_abs": None if lse is None else max_abs_error(lse, ref_lse),
    }


def grad_errors(
    grads: Sequence[torch.Tensor], ref_grads: Sequence[torch.Tensor]
) -> dict[str, float]:
    """err_dq_rel, err_dk_rel, err_dv_rel of (dq, dk, dv) against the reference gradients."""
    names = ("err_dq_rel", "err_dk_rel", "err_dv_rel")
    return {n: rel_error(g, r) for n, g, r in zip(names, grads, ref_grads, strict=True)}


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


def non_finite_values(variant: Variant, out: torch.Tensor, lse: torch.Tensor | None) -> str:
    """What is non-finite in a whole attention result ("" when nothing is): NaN or inf anywhere
    in `out`, NaN or +inf in `lse`, or an lse of -inf on a row the mask does not empty.

    The sampled rows of validate_rows may miss a NaN from one bad tile; this looks at every row.
    An lse of -inf is the right answer for a fully masked row (no key to sum over), so those rows
    are checked against the mask itself, `ROWS_PER_MASK_CHUNK` rows x S keys at a time.

    Args:
        out: (B, H, S, D); lse: (B, H, S) or None (a kernel without one), positions 0..S-1 for
            queries and keys.
    """
    counts = {"out NaN": torch.isnan(out).sum(), "out inf": torch.isinf(out).sum()}
    if lse is not None:
        counts.update({"lse NaN": torch.isnan(lse).sum(), "lse +inf": (lse == math.inf).sum()})
    found = [f"{what} in {int(n)} values" for what, n in counts.items() if int(n)]
    if lse is not None and (not_empty := _unmasked_rows(variant, lse == -math.inf)):
        found.append(f"lse -inf in {not_empty} rows the mask does not empty")
    return "; ".join(found)


def _unmasked_rows(variant: Variant, rows_BHS: torch.Tensor) -> int:
    """How many of the (b, h, q) rows marked in `rows_BHS` the mask does not empty, evaluated
    ROWS_PER_MASK_CHUNK mask entries at a time."""
    marked = rows_BHS.nonzero()  # (N, 3): b, h, q
    if variant.mask_mod is None or marked.numel() == 0:
        return marked.shape[0]
    keys = torch.arange(rows_BHS.shape[-1], device=rows_BHS.device)[None, :]  # (1, S)
    count = 0
    for part in marked.split(max(1, ROWS_PER_MASK_CHUNK // keys.numel())):
        b, h, q = (part[:, i : i + 1] for i in range(3))  # (n, 1) each
        count += int(variant.mask_mod(b, h, q, keys).any(dim=-1).sum())
    return count


# Mask entries evaluated at once when checking the rows whose lse is -inf (16M booleans).
ROWS_PER_MASK_CHUNK = 1 << 24


def validate_rows(
    variant: Variant,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    attend: Callable[
        [torch.Tensor | None],
        tuple[torch.Tensor, torch.Tensor | None, Sequence[torch.Tensor] | None],
    ],
    *,
    do_bwd: bool,
    max_rows: int,
    seed: int,
) -> dict[str, Any]:
    """Errors of one attention call (output, lse and, when do_bwd, dq/dk/dv) on sampled rows
    against the float64 dense reference, and their verdict.

    The rows are `sample_rows(S, max_rows, seed)`, so memory stays
    O(R x S). For the gradients the output gradient is kept on the sampled rows only (`g_masked`,
    zero elsewhere): then dk and dv of the kernel depend on those rows alone and compare exactly
    with the reference's dk, dv for the R-row problem; dq is compared on the sampled rows.

    Args:
        q: (B, H, S, D); k, v: (B, G, S, D); grad_out: (B, H, S, D) — the whole-sequence inputs
            the kernel attended (the reference works on detached float64 copies).
        attend: `attend(g_masked) -> (out, lse, grads)` runs the kernel under test on the whole
            problem and returns out (B, H, S, D), lse (B, H, S) or None (a kernel that keeps no
            lse) and, when `g_masked` (B, H, S, D) is given, the whole-sequence gradients
            (dq, dk, dv) for that output gradient (else None). It is called once, with None
            when not do_bwd. A sharded task gathers its shards inside `attend`.
        do_bwd: also compare gradients.
        max_rows, seed: how many query rows to check at most, and the seed that samples them.

    Returns:
        validated_rows, err_out_max_abs, err_out_rel, err_lse_max_abs, err_dq_rel, err_dk_rel,
        err_dv_rel (None without do_bwd) and `validation` ("ok" or "failed: ...", judge_errors,
        judged at the dtype of `q`: the run's dtype).
    """
    seq_len = q.shape[2]
    rows = sample_rows(seq_len, max_rows, seed, q.device)  # (R,)
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
    non_finite = non_finite_values(variant, out.detach(), None if lse is None else lse.detach())
    lse_rows = None if lse is None else lse.detach()[:, :, rows]
    metrics.update(output_errors(out.detach()[:, :, rows], lse_rows, ref_out.detach(), ref_lse))
    if do_bwd and grads is not None:
        dq, dk, dv = grads
        ref_grads = torch.autograd.grad(ref_out, (q64, k64, v64), g_rows.double())
        metrics.update(grad_errors((dq[:, :, rows], dk, dv), ref_grads))
    else:
        metrics.update({"err_dq_rel": None, "err_dk_rel": None, "err_dv_rel": None})
    metrics["validation"] = (
        f"failed: non-finite {non_finite}"
        if non_finite
        else judge_errors(metrics, str(q.dtype).removeprefix("torch."))
    )
    log.info(
        "validated %d rows: out err %.3g (rel %.3g), lse err %s: %s",
        metrics["validated_rows"],
        metrics["err_out_max_abs"],
        metrics["err_out_rel"],
        "n/a" if lse is None else f"{metrics['err_lse_max_abs']:.3g}",
        metrics["validation"],
    )
    return metrics
