"""The single-device task against the float64 reference, and the helpers it runs on (inputs,
validation, metrics, the variant spec).

On CPU flex runs eagerly, forward only; its float32 output is compared with the float64 reference
on the validated rows. Tolerance: float32 attention over S <= 256 keys accumulates rounding of
order 1e-6 relative; 1e-4 absolute leaves two orders of margin while any masking bug (an entry
kept or dropped) moves outputs by O(0.1).
"""

from __future__ import annotations

import math

import pytest
import torch

from attngym import reference
from attngym.config import Benchmark, Settings, Shape
from attngym.errors import ConfigError
from attngym.inputs import make_inputs
from attngym.metrics import pass_metrics
from attngym.tasks import single
from attngym.validation import judge_errors, max_abs_error, rel_error, sample_rows, validate_rows
from attngym.variants.spec import build_variant

TOL = 1e-4


def settings(attention, **over):
    base = dict(
        attention=attention,
        shape=Shape(batch=1, heads=2, kv_heads=1, seq_len=128, head_dim=16),
        benchmark=Benchmark(warmup=0, repeats=1),
        device="cpu",
        dtype="float32",
        block_size=(64, 64),
        baselines=("sdpa", "sdpa_dense_mask"),
        validate_rows=48,
        seed=3,
    )
    base.update(over)
    return Settings(**base)


@pytest.mark.parametrize(
    "attention",
    [
        {"name": "causal"},
        {"name": "alibi", "num_heads": 2},
        {"name": "softcap", "soft_cap": 5.0},
        {
            "name": "gemma2",
            "compose": [
                {"name": "sliding_window", "window_size": 32},
                {"name": "softcap", "soft_cap": 5.0},
            ],
        },
    ],
    ids=lambda a: a["name"],
)
def test_single_run_validates_and_times(tmp_path, attention):
    m = single.run(settings(attention), tmp_path)
    assert m["variant"] == attention["name"] and m["device"] == "cpu" and m["kv_heads"] == 1
    assert m["validated_rows"] == 48
    assert m["err_out_max_abs"] < TOL and m["err_lse_max_abs"] < TOL
    assert m["err_out_rel"] < TOL
    assert m["fwd_ms"] > 0 and m["fwd_ms_min"] <= m["fwd_ms"] <= m["fwd_ms_max"]
    assert m["fwd_tflops"] > 0 and m["compile_s"] > 0
    assert m["bwd_status"].startswith("not available") and m["bwd_ms"] is None
    assert m["err_dq_rel"] is None
    assert 0.0 <= m["sparsity"] < 1.0
    if attention["name"] == "causal":
        assert m["sparsity"] == pytest.approx(0.25)  # 2 x 2 blocks of 64: one skipped
        assert m["sdpa_status"] == "ok" and m["sdpa_fwd_ms"] > 0
        assert m["flex_over_sdpa_fwd"] == pytest.approx(m["sdpa_fwd_ms"] / m["fwd_ms"])
    else:
        assert m["sdpa_status"].startswith("skipped")
    additive = attention["name"] in ("causal", "alibi")
    assert (m["sdpa_dense_mask_status"] == "ok") is additive, m["sdpa_dense_mask_status"]


def test_dense_bias_baseline_matches_reference(rng):
    variant = build_variant({"name": "alibi", "num_heads": 2})
    q, k, v = (torch.randn(1, 2, 64, 16, generator=rng) for _ in range(3))
    bias, reason = single.dense_mask_or_bias(
        variant, 1, 2, 64, device=torch.device("cpu"), dtype=torch.float64, max_bytes=2**30
    )
    assert bias is not None, reason
    out = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), attn_mask=bias
    )
    ref, _ = reference.attention(q, k, v, variant.score_mod, variant.mask_mod)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)  # both float64
    none, reason = single.dense_mask_or_bias(
        variant, 1, 2, 64, device=torch.device("cpu"), dtype=torch.float32, max_bytes=1000
    )
    assert none is None and "baseline_max_mask_bytes" in reason


def test_make_inputs_are_seeded_random_and_shaped():
    s = settings({"name": "causal"})
    q, k, v, g = make_inputs(s.shape, s.seed, "cpu", torch.float32)
    assert q.shape == (1, 2, 128, 16) and k.shape == v.shape == (1, 1, 128, 16)
    assert g.shape == q.shape and q.std() > 0.5 and not torch.equal(q, g)
    q2, *_ = make_inputs(s.shape, s.seed, "cpu", torch.float32, requires_grad=True)
    assert torch.equal(q, q2.detach()) and q2.requires_grad


def test_sample_rows_bounded_with_edges():
    rows = sample_rows(10_000, 64, seed=0, device="cpu")
    assert rows.numel() == 64 and rows[0] == 0 and rows[-1] == 9_999
    assert torch.equal(rows, rows.unique())  # sorted, no repeats
    assert torch.equal(sample_rows(32, 64, seed=0, device="cpu"), torch.arange(32))


def test_errors_helpers():
    ref = torch.tensor([[1.0, -math.inf], [2.0, 3.0]])
    out = ref.clone()
    out[1, 0] += 0.5
    assert max_abs_error(out, ref) == pytest.approx(0.5)  # -inf vs -inf counts as 0
    assert rel_error(torch.ones(4) * 1.1, torch.ones(4)) == pytest.approx(0.1)


def test_build_variant_rejections_name_the_key():
    with pytest.raises(ConfigError) as info:
        build_variant({"name": "document", "doc_lengths": [10, 20]}, seq_len=64)
    assert info.value.key == "attention.doc_lengths" and "30" in str(info.value)
    assert build_variant({"name": "document", "doc_lengths": [40, 24]}, seq_len=64)
    with pytest.raises(ConfigError) as info:
        build_variant({"name": "gemma2", "compose": [{"name": "softcapp", "soft_cap": 1.0}]})
    assert info.value.key == "attention.compose.0.name"


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


def _reference_kernel(variant, q, k, v):
    """`attend` for validate_rows with the float32 dense reference as the kernel under test."""

    def attend(g_masked):
        out, lse = reference.attention(q, k, v, variant.score_mod, variant.mask_mod)
        grads = torch.autograd.grad(out, (q, k, v), g_masked) if g_masked is not None else None
        return out, lse, grads

    return attend


def test_validate_rows_accepts_a_right_kernel_with_gradients():
    s = settings({"name": "causal"})
    variant = build_variant(s.attention)
    q, k, v, g = make_inputs(s.shape, s.seed, "cpu", torch.float32, requires_grad=True)
    m = validate_rows(
        variant, q, k, v, g, _reference_kernel(variant, q, k, v), do_bwd=True, max_rows=48, seed=3
    )
    assert m["validation"] == "ok" and m["validated_rows"] == 48
    # g_masked: dk, dv of the whole problem match the 48-row reference to float32 rounding.
    for name in ("err_out_rel", "err_dq_rel", "err_dk_rel", "err_dv_rel"):
        assert m[name] < 1e-5, (name, m[name])


def test_validate_rows_fails_a_wrong_kernel():
    s = settings({"name": "causal"})
    variant = build_variant(s.attention)
    full = build_variant({"name": "full"})
    q, k, v, g = make_inputs(s.shape, s.seed, "cpu", torch.float32, requires_grad=True)
    attend = _reference_kernel(full, q, k, v)
    m = validate_rows(variant, q, k, v, g, attend, do_bwd=True, max_rows=48, seed=3)
    assert m["validation"].startswith("failed: err_out_rel=") and "(float32)" in m["validation"]
    assert m["err_out_rel"] > 0.1 and m["err_dk_rel"] > 0.1  # the numbers are kept


def test_pass_metrics_from_timings():
    from attngym.bench import Timing, attention_flops

    shape = Shape(batch=1, heads=2, seq_len=128, head_dim=16)
    m = pass_metrics({"fwd": Timing.from_times([1.0, 2.0, 4.0])}, shape, 128, 0.25)
    flops = attention_flops(1, 2, 128, 128, 16, sparsity=0.25)
    assert m["fwd_ms"] == 2.0 and m["fwd_ms_min"] == 1.0 and m["fwd_ms_max"] == 4.0
    assert m["fwd_tflops"] == pytest.approx(flops / 2e-3 / 1e12)
    assert m["bwd_ms"] is None and m["fwd_bwd_tflops"] is None


class _NoBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("No available kernel for the backward")


def test_baseline_pass_without_backward_is_recorded_not_fatal():
    s = settings({"name": "causal"})
    q, k, v, g = make_inputs(s.shape, s.seed, "cpu", torch.float32, requires_grad=True)
    args = (q, k, v, g, s, torch.device("cpu"), True)
    failures: dict[str, str] = {}
    times = single._time_passes("sdpa_x", lambda: _NoBackward.apply(q), *args, failures)
    assert set(times) == {"fwd"} and times["fwd"].median_ms > 0
    assert failures == {
        "bwd": "No available kernel for the backward",
        "fwd_bwd": "No available kernel for the backward",
    }
    with pytest.raises(RuntimeError, match="No available kernel"):  # flex: the run fails
        single._time_passes("flex", lambda: _NoBackward.apply(q), *args)


def test_unknown_variant_parameter_suggests_the_closest():
    with pytest.raises(ConfigError) as info:
        build_variant({"name": "sliding_window", "window_siz": 3})
    assert info.value.key == "attention.window_siz"
    assert str(info.value).endswith("(did you mean 'window_size'?)")
    assert build_variant({"name": "sliding_window", "window_size": 3}).name


@pytest.mark.gpu
def test_peak_memory_excludes_validation_and_flush_buffer(tmp_path):
    from attngym import bench

    s = settings({"name": "causal"}, device="cuda", dtype="bfloat16", baselines=(), compile=False)
    m = single.run(s, tmp_path)
    assert m["validation"] == "ok"
    # Inputs and flex's buffers at this size are a few MiB; the 256 MiB flush buffer is not counted.
    assert 0 < m["peak_mem_bytes"] < bench.L2_FLUSH_BYTES // 4
    assert bench.l2_flush_buffer("cuda") is bench.l2_flush_buffer("cuda")  # allocated once


@pytest.mark.parametrize(
    ("over", "runs"),
    [
        ({}, False),  # flex itself is the default: nothing to compare
        ({"block_size": (64, 64)}, True),
        ({"block_size": (128, 128), "kernel_options": {"USE_TMA": True}}, True),
        ({"block_size": (128, 128), "compile_mode": "max-autotune-no-cudagraphs"}, True),
    ],
)
def test_flex_default_baseline_runs_when_flex_is_not_the_default(over, runs):
    s = settings({"name": "causal"}, **({"block_size": (128, 128)} | over))
    variant = build_variant(s.attention, seq_len=s.shape.seq_len)
    q, k, v, _ = make_inputs(s.shape, s.seed, "cpu", torch.float32)
    fn, reason = single._baseline("flex_default", variant, q, k, v, s, torch.device("cpu"))
    assert (fn is not None) == runs, reason
    if runs:
        out, _ = fn()
        expected, _ = reference.attention(q, k, v, variant.score_mod, variant.mask_mod)
        torch.testing.assert_close(out, expected.to(out.dtype), atol=1e-4, rtol=1e-4)
