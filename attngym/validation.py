"""Validation against the float64 dense reference: the validated rows, error metrics, their verdict.

Every task validates the same way, so a single-device run and a context-parallel run of one config
report comparable errors under the same names (attngym.metrics) and are judged by the same
tolerances. The functions take tensors and plain numbers, not the run's settings, so they serve a
notebook as well as a task.

Which rows: a seeded sample, and always the rows where kernels and schemes go wrong, which a
sample of a long sequence would miss: each shard's first and last query blocks (a halo, a kv
offset, a diagonal block) and both edges of every piece of a layout (`sample_rows`).

How each row is judged: beside the norm over all validated rows (`err_out_rel`, where one wrong
row among hundreds is diluted below the tolerance), every row on its own (`err_out_row_rel`)
against its own scale, sqrt(sum_j p_j^2 |v_j|^2): the size of the terms a kernel rounds (so a
correct row's error over it is the dtype's rounding whatever the row's length), and the size of a
row of these inputs, so a wrong row is of order 1 over it. A row's own norm is no denominator: at
small head_dim it can be near zero by chance (a few random values cancelling), where a correct
row's error over it is 10 to 1000 times the rounding.

A call after validation is held to the validated one (`Validated.agrees`): the timed calls run
the kernel again and again, and a cache or a stale buffer can make them differ from the call
that was checked.

Shape legend: B batch, H query heads, G key/value heads, S sequence, D head dim, R validated rows.
"""

from __future__ import annotations

import dataclasses
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
# ROW_RTOL bounds err_out_row_rel (and err_timed_out_rel): the worst validated row's error over
# the row's own scale (module docstring). Measured on correct CPU flex calls (eager: fp32 scores
# and probabilities, the output rounded to the dtype) against the float64 reference, over 10
# variants (causal, windows, documents, prefix, softcap, ALiBi, relative position, gemma2, sinks),
# S 1024 and 4096, head_dim 1 to 64, ~700 rows x 4 heads each: the worst row was 5e-3 in bf16 (a
# row's norm-wise error there is ~2.3e-3), 6.6e-4 in fp16, 1.6e-6 in fp32 (1.3e-4 for relative
# position at S=4096: scores of +-S rounded in fp32) and 5e-13 in fp64; a wrong row (a row
# copied over its neighbour, a row a mask or scheme shifts) is of order 1. On a GPU flex also
# rounds the probabilities to bf16 before P @ V: a correct bf16 run's err_out_max_abs is 0.0057
# at S=8192 causal, under the CPU's 0.008, so its rows are of the CPU's order. The bounds leave
# a margin of 10 or more over each: bf16 5e-2, fp16 1e-2, fp32 1e-3 (8x over relative position,
# whose norm-wise error already fails at S=16384), fp64 1e-8 (as its RTOL).
ROW_RTOL = {"bfloat16": 5e-2, "float16": 1e-2, "float32": 1e-3, "float64": 1e-8}
REL_ERRORS = ("err_out_rel", "err_dq_rel", "err_dk_rel", "err_dv_rel")
ROW_ERRORS = ("err_out_row_rel", "err_timed_out_rel")


def sample_rows(
    seq_len: int,
    max_rows: int,
    seed: int,
    device: torch.device | str,
    *,
    shards: Sequence[Sequence[tuple[int, int]]] | None = None,
    block: int = 0,
) -> torch.Tensor:
    """Sorted query positions to validate: all rows when S <= max_rows, else a seeded sample of
    max_rows rows with, always, the rows where a kernel or a scheme goes wrong first.

    Always included: the first and last row of the sequence, both edges of every piece of
    `shards` (a rank's chunks: a layout's boundaries, a halo's first row) and each shard's first
    and last `block` rows (its first and last query blocks, in its own row order).

    Args:
        shards: each rank's (global offset, length) chunks, in shard order (a Layout's
            placement); None: one shard of the whole sequence.
        block: the query block size (block_size[0]); 0: no whole blocks.

    Returns:
        (R,) int64 positions, R >= min(S, max_rows).
    """
    if seq_len <= max_rows:
        return torch.arange(seq_len, device=device)
    shards = [[(0, seq_len)]] if shards is None else shards
    always = [torch.tensor([0, seq_len - 1])]
    for chunks in shards:
        positions = torch.cat([torch.arange(o, o + n) for o, n in chunks if n > 0])
        always += [positions[:block], positions[-block:] if block else positions[:0]]
        always += [torch.tensor([o, o + n - 1]) for o, n in chunks if n > 0]
    gen = torch.Generator().manual_seed(seed + 1)
    inner = torch.randperm(seq_len - 2, generator=gen)[: max(max_rows - 2, 0)] + 1
    return torch.cat([*always, inner]).unique().to(device)  # unique: sorted


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


def row_error(actual: torch.Tensor, expected: torch.Tensor, scale: torch.Tensor) -> float:
    """The worst row's ||actual - expected|| over its `scale` (a row of scale 0, a fully masked
    one, by its error alone); NaN anywhere counts as inf.

    Args:
        actual, expected: (B, H, R, D); scale: (B, H, R), `row_scales`.
    """
    diff = (actual.double() - expected.double()).norm(dim=-1)  # (B, H, R)
    per_row = torch.where(scale > 0, diff / scale.clamp_min(1e-300), diff)
    per_row = torch.nan_to_num(per_row, nan=math.inf)
    return float(per_row.max().item()) if per_row.numel() else 0.0


def row_scales(
    variant: Variant,
    q64: torch.Tensor,
    k64: torch.Tensor,
    v64: torch.Tensor,
    rows: torch.Tensor,
    lse64: torch.Tensor,
) -> torch.Tensor:
    """Each row's scale, sqrt(sum_j p_j^2 |v_j|^2) (module docstring), 0 for an empty row.

    sum_j p_j^2 w_j is the reference's attention over w_j = |v_j|^2 with every score doubled
    (its probabilities are p_j^2 / sum p^2), times exp(lse2 - 2 lse): one more reference call
    with a one-wide value, on the same rows.

    Args:
        q64: (B, H, R, D) the validated rows; k64, v64: (B, G, S, D); rows: (R,) their
            positions; lse64: (B, H, R) the reference's lse of those rows.

    Returns:
        (B, H, R) float64.
    """
    mod = variant.score_mod

    def doubled(score, b, h, q_idx, kv_idx):
        return 2 * (score if mod is None else mod(score, b, h, q_idx, kv_idx))

    with torch.no_grad():
        w = v64.detach().square().sum(-1, keepdim=True)  # (B, G, S, 1)
        sums, lse2 = reference.attention(
            q64.detach(), k64.detach(), w, doubled, variant.mask_mod, q_positions=rows
        )
    empty = torch.isneginf(lse64.detach())
    squared = sums.squeeze(-1) * torch.exp(torch.where(empty, 0.0, lse2 - 2 * lse64.detach()))
    return torch.where(empty, 0.0, squared).clamp_min(0).sqrt()


def output_errors(
    out: torch.Tensor,
    lse: torch.Tensor | None,
    ref_out: torch.Tensor,
    ref_lse: torch.Tensor,
    scale: torch.Tensor,
) -> dict[str, float | None]:
    """err_out_max_abs, err_out_rel, err_out_row_rel, err_lse_max_abs of (out, lse) against the
    reference.

    Args:
        out: (B, H, R, D) kernel output on the validated rows; ref_out the same from the oracle.
        lse: (B, H, R) kernel log-sum-exp, or None for a kernel that keeps none (then
            err_lse_max_abs is None); ref_lse the same from the oracle.
        scale: (B, H, R) the rows' scales (`row_scales`).
    """
    return {
        "err_out_max_abs": max_abs_error(out, ref_out),
        "err_out_rel": rel_error(out, ref_out),
        "err_out_row_rel": row_error(out, ref_out, scale),
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

    Relative errors (REL_ERRORS) are judged against RTOL[dtype], a row's own (ROW_ERRORS) against
    ROW_RTOL[dtype], err_lse_max_abs against LSE_ATOL[dtype]; metrics that are None (gradients
    not computed) are not judged; NaN fails.

    Returns:
        e.g. "ok", or "failed: err_out_rel=0.31 > 0.02 (bfloat16)" (every violation, "; "-joined).
    """
    if dtype not in RTOL:
        raise ValueError(choice_error("dtype", dtype, RTOL))
    limits = {name: RTOL[dtype] for name in REL_ERRORS}
    limits.update(dict.fromkeys(ROW_ERRORS, ROW_RTOL[dtype]))
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


@dataclasses.dataclass(frozen=True)
class Validated:
    """What a validated call leaves for checking a later call of the same kernel: its output on
    the validated rows, their scales, and the run's dtype. Rank 0's, on its CPU."""

    rows: torch.Tensor  # (R,)
    out: torch.Tensor  # (B, H, R, D), detached
    scale: torch.Tensor  # (B, H, R)
    dtype: str

    def agrees(self, out: torch.Tensor) -> dict[str, float]:
        """err_timed_out_rel: a later call's whole output `out` (B, H, S, D) against the
        validated one, row by row (row_error). The same kernel on the same inputs gives the same
        rows (0); a difference is a kernel whose result depends on how often it ran."""
        err = row_error(out.detach().to(self.out.device)[:, :, self.rows], self.out, self.scale)
        return {"err_timed_out_rel": err}

    def fold(self, metrics: dict[str, Any]) -> None:
        """err_timed_out_rel over ROW_RTOL fails metrics["validation"] (add_failure)."""
        err = metrics.get("err_timed_out_rel")
        add_failure(
            metrics,
            judge_errors({"err_timed_out_rel": err}, self.dtype),
            "a timed call's output is not the validated call's",
        )


def add_failure(metrics: dict[str, Any], verdict: Any, what: str) -> None:
    """Fold another check's verdict ("ok", "failed: ...", or None: not run) into
    metrics["validation"]: a failed one fails the run's validation, `what` says which check."""
    if not (isinstance(verdict, str) and verdict.startswith("failed")):
        return
    failure = f"{what}: {verdict.removeprefix('failed: ')}"
    own = metrics.get("validation")
    failed = isinstance(own, str) and own.startswith("failed")
    metrics["validation"] = f"{own}; {failure}" if failed else f"failed: {failure}"


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
    rows: torch.Tensor,
    rows_at_once: int,
) -> tuple[dict[str, Any], Validated]:
    """Errors of one attention call (output, lse and, when do_bwd, dq/dk/dv) on the validated
    rows against the float64 dense reference, and their verdict.

    The reference works `rows_at_once` rows at a time, so its memory stays O(rows_at_once x S)
    however many rows are validated (the always-included ones of `sample_rows` come on top of the
    sample). For the gradients the output gradient is kept on the validated rows only
    (`g_masked`, zero elsewhere): then dk and dv of the kernel depend on those rows alone and
    compare exactly with the sum of the reference's dk, dv over its row groups; dq is compared
    on the validated rows.

    Args:
        q: (B, H, S, D); k, v: (B, G, S, D); grad_out: (B, H, S, D) — the whole-sequence inputs
            the kernel attended (the reference works on detached float64 copies).
        attend: `attend(g_masked) -> (out, lse, grads)` runs the kernel under test on the whole
            problem and returns out (B, H, S, D), lse (B, H, S) or None (a kernel that keeps no
            lse) and, when `g_masked` (B, H, S, D) is given, the whole-sequence gradients
            (dq, dk, dv) for that output gradient (else None). It is called once, with None
            when not do_bwd. A sharded task gathers its shards inside `attend`.
        do_bwd: also compare gradients.
        rows: (R,) the positions to validate (`sample_rows`), on q's device.
        rows_at_once: the reference's rows per call (validate_rows), at least 1.

    Returns:
        The metrics: validated_rows, err_out_max_abs, err_out_rel, err_out_row_rel,
        err_lse_max_abs, err_dq_rel, err_dk_rel, err_dv_rel (None without do_bwd) and
        `validation` ("ok" or "failed: ...", judge_errors, judged at the dtype of `q`: the
        run's dtype); and the Validated call, for checking a later one.
    """
    dtype = str(q.dtype).removeprefix("torch.")
    metrics: dict[str, Any] = {"validated_rows": int(rows.numel())}
    k64 = k.detach().double().requires_grad_(do_bwd)  # (B, G, S, D)
    v64 = v.detach().double().requires_grad_(do_bwd)
    refs = []  # per row group: (out, lse, scale, dq), float64
    dk64, dv64 = torch.zeros_like(k64), torch.zeros_like(v64)
    for part in rows.split(max(1, rows_at_once)):
        q64 = q.detach()[:, :, part].double().requires_grad_(do_bwd)  # (B, H, r, D)
        ref_out, ref_lse = reference.attention(
            q64, k64, v64, variant.score_mod, variant.mask_mod, q_positions=part,
            dtype=torch.float64,
        )  # fmt: skip
        dq = None
        if do_bwd:
            g64 = grad_out.detach()[:, :, part].double()
            dq, dk, dv = torch.autograd.grad(ref_out, (q64, k64, v64), g64)
            dk64 += dk
            dv64 += dv
        scale = row_scales(variant, q64, k64, v64, part, ref_lse)
        refs.append((ref_out.detach(), ref_lse.detach(), scale, dq))
        del q64, ref_out, ref_lse
    ref_out, ref_lse, scale = (torch.cat([r[i] for r in refs], dim=2) for i in range(3))
    g_masked = None
    if do_bwd:
        g_masked = torch.zeros_like(grad_out)
        g_masked[:, :, rows] = grad_out.detach()[:, :, rows]
    out, lse, grads = attend(g_masked)
    non_finite = non_finite_values(variant, out.detach(), None if lse is None else lse.detach())
    out_rows = out.detach()[:, :, rows]
    lse_rows = None if lse is None else lse.detach()[:, :, rows]
    metrics.update(output_errors(out_rows, lse_rows, ref_out, ref_lse, scale))
    if do_bwd and grads is not None:
        dq, dk, dv = grads
        ref_dq = torch.cat([r[3] for r in refs], dim=2)
        metrics.update(grad_errors((dq[:, :, rows], dk, dv), (ref_dq, dk64, dv64)))
    else:
        metrics.update({"err_dq_rel": None, "err_dk_rel": None, "err_dv_rel": None})
    metrics["validation"] = (
        f"failed: non-finite {non_finite}" if non_finite else judge_errors(metrics, dtype)
    )
    log.info(
        "validated %d rows: out %.3g (rel %.3g, row %.3g), lse %s: %s",
        metrics["validated_rows"],
        metrics["err_out_max_abs"],
        metrics["err_out_rel"],
        metrics["err_out_row_rel"],
        "n/a" if lse is None else f"{metrics['err_lse_max_abs']:.3g}",
        metrics["validation"],
    )
    return metrics, Validated(rows=rows, out=out_rows.clone(), scale=scale, dtype=dtype)
