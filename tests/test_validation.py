"""Validation against the float64 dense reference: sampled rows, error metrics, the verdict per
dtype, and validate_rows judging a right and a wrong kernel."""

from __future__ import annotations

import math

import pytest
import torch

from attngym import reference
from attngym.inputs import make_inputs
from attngym.runner.config import Shape
from attngym.validation import (
    judge_errors,
    max_abs_error,
    non_finite_values,
    rel_error,
    sample_rows,
    validate_rows,
)
from attngym.variants.base import Variant
from attngym.variants.spec import build_variant

SHAPE = Shape(batch=1, heads=2, kv_heads=1, seq_len=128, head_dim=16)


def test_sample_rows_bounded_with_edges():
    rows = sample_rows(10_000, 64, seed=0, device="cpu")
    assert rows.numel() == 64 and rows[0] == 0 and rows[-1] == 9_999
    assert torch.equal(rows, rows.unique())  # sorted, no repeats
    assert torch.equal(sample_rows(32, 64, seed=0, device="cpu"), torch.arange(32))
    assert sample_rows(10_000, 1, seed=0, device="cpu").tolist() == [0, 9_999]  # edges always


def test_errors_helpers():
    ref = torch.tensor([[1.0, -math.inf], [2.0, 3.0]])
    out = ref.clone()
    out[1, 0] += 0.5
    assert max_abs_error(out, ref) == pytest.approx(0.5)  # -inf vs -inf counts as 0
    assert rel_error(torch.ones(4) * 1.1, torch.ones(4)) == pytest.approx(0.1)


def test_judge_errors_per_dtype():
    # bf16 keeps 8 significant bits: 5e-3 is ordinary rounding, 0.31 a wrong kernel.
    ok = {"err_out_rel": 5e-3, "err_lse_max_abs": 1e-3, "err_dq_rel": None}
    assert judge_errors(ok, "bfloat16") == "ok"
    bad = judge_errors({**ok, "err_out_rel": 0.31}, "bfloat16")
    assert bad == "failed: err_out_rel=0.31 > 0.02 (bfloat16)"
    # The same 5e-3 is far too much for float32; lse is judged with its absolute tolerance.
    verdict = judge_errors({**ok, "err_lse_max_abs": 1e-3}, "float32")
    assert verdict.startswith("failed: err_out_rel=0.005 > 0.0001; err_lse_max_abs=0.001 > ")
    assert judge_errors({"err_dv_rel": math.nan}, "float64").startswith("failed")
    assert judge_errors({"err_dv_rel": 1e-9}, "float64") == "ok"


def _rows(max_rows, seed):
    """validate_rows' rows: a sample of `max_rows` (with the sequence's edges), no whole blocks."""
    return {
        "rows": sample_rows(SHAPE.seq_len, max_rows, seed, "cpu"),
        "rows_at_once": max_rows,
    }


def _reference_kernel(variant, q, k, v):
    """`attend` for validate_rows with the float32 dense reference as the kernel under test."""

    def attend(g_masked):
        out, lse = reference.attention(q, k, v, variant.score_mod, variant.mask_mod)
        grads = torch.autograd.grad(out, (q, k, v), g_masked) if g_masked is not None else None
        return out, lse, grads

    return attend


def test_validate_rows_accepts_a_right_kernel_with_gradients():
    variant = build_variant({"name": "causal"})
    q, k, v, g = make_inputs(SHAPE, 3, "cpu", torch.float32, requires_grad=True)
    m, _ = validate_rows(
        variant, q, k, v, g, _reference_kernel(variant, q, k, v), do_bwd=True, **_rows(48, 3)
    )
    assert m["validation"] == "ok" and m["validated_rows"] == 48
    # g_masked: dk, dv of the whole problem match the 48-row reference to float32 rounding.
    for name in ("err_out_rel", "err_dq_rel", "err_dk_rel", "err_dv_rel"):
        assert m[name] < 1e-5, (name, m[name])


def test_validate_rows_fails_a_wrong_kernel():
    variant = build_variant({"name": "causal"})
    full = build_variant({"name": "full"})
    q, k, v, g = make_inputs(SHAPE, 3, "cpu", torch.float32, requires_grad=True)
    attend = _reference_kernel(full, q, k, v)
    m, _ = validate_rows(variant, q, k, v, g, attend, do_bwd=True, **_rows(48, 3))
    assert m["validation"].startswith("failed: err_out_rel=") and "(float32)" in m["validation"]
    assert m["err_out_rel"] > 0.1 and m["err_dk_rel"] > 0.1  # the numbers are kept


def _late_causal(b, h, q_idx, kv_idx):
    """Causal, with the first 4 query rows masked entirely (their lse is -inf, out 0)."""
    return (q_idx >= 4) & (kv_idx <= q_idx)


def test_validate_rows_accepts_an_lse_of_minus_inf_on_fully_masked_rows():
    variant = Variant(name="late_causal", mask_mod=_late_causal)
    q, k, v, g = make_inputs(SHAPE, 3, "cpu", torch.float32)
    attend = _reference_kernel(variant, q, k, v)
    assert torch.isneginf(attend(None)[1][:, :, :4]).all()  # the premise: 4 empty rows
    m, _ = validate_rows(variant, q, k, v, g, attend, do_bwd=False, **_rows(8, 3))
    assert m["validation"] == "ok"
    assert non_finite_values(variant, *attend(None)[:2]) == ""


@pytest.mark.parametrize(
    "spoil, found",
    [
        (lambda out, lse: out[0, 1, 77].fill_(math.nan), "out NaN in 16 values"),
        (lambda out, lse: out[0, 0, 90, 3].fill_(math.inf), "out inf in 1 values"),
        (lambda out, lse: lse[0, 0, 60].fill_(math.nan), "lse NaN in 1 values"),
        (lambda out, lse: lse[0, 1, 61].fill_(math.inf), "lse +inf in 1 values"),
        (lambda out, lse: lse[0, 1, 62:64].fill_(-math.inf), "lse -inf in 2 rows the mask does"),
    ],
)
def test_validate_rows_fails_non_finite_values_on_rows_it_does_not_sample(spoil, found):
    variant = Variant(name="late_causal", mask_mod=_late_causal)
    q, k, v, g = make_inputs(SHAPE, 3, "cpu", torch.float32)
    rows = sample_rows(SHAPE.seq_len, 8, seed=3, device="cpu").tolist()
    assert not {60, 61, 62, 63, 77, 90} & set(rows)  # the spoilt rows are not sampled

    def attend(g_masked):
        out, lse = reference.attention(q, k, v, None, variant.mask_mod)
        spoil(out, lse)
        return out, lse, None

    m, _ = validate_rows(variant, q, k, v, g, attend, do_bwd=False, **_rows(8, 3))
    assert m["validation"].startswith(f"failed: non-finite {found}")
    assert m["err_out_rel"] < 1e-5  # the sampled rows alone look right
