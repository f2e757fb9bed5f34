"""The single-device task against the float64 reference, and its helpers (tasks/common.py).

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
from attngym.tasks import common, single

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
    from attngym.tasks.common import build_variant

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
    q, k, v, g = common.make_inputs(s, "cpu", torch.float32)
    assert q.shape == (1, 2, 128, 16) and k.shape == v.shape == (1, 1, 128, 16)
    assert g.shape == q.shape and q.std() > 0.5 and not torch.equal(q, g)
    q2, *_ = common.make_inputs(s, "cpu", torch.float32, requires_grad=True)
    assert torch.equal(q, q2.detach()) and q2.requires_grad


def test_sample_rows_bounded_with_edges():
    rows = common.sample_rows(10_000, 64, seed=0, device="cpu")
    assert rows.numel() == 64 and rows[0] == 0 and rows[-1] == 9_999
    assert torch.equal(rows, rows.unique())  # sorted, no repeats
    assert torch.equal(common.sample_rows(32, 64, seed=0, device="cpu"), torch.arange(32))


def test_errors_helpers():
    ref = torch.tensor([[1.0, -math.inf], [2.0, 3.0]])
    out = ref.clone()
    out[1, 0] += 0.5
    assert common.max_abs_error(out, ref) == pytest.approx(0.5)  # -inf vs -inf counts as 0
    assert common.rel_error(torch.ones(4) * 1.1, torch.ones(4)) == pytest.approx(0.1)


def test_build_variant_rejections_name_the_key():
    with pytest.raises(ConfigError) as info:
        common.build_variant({"name": "document", "doc_lengths": [10, 20]}, seq_len=64)
    assert info.value.key == "attention.doc_lengths" and "30" in str(info.value)
    assert common.build_variant({"name": "document", "doc_lengths": [40, 24]}, seq_len=64)
    with pytest.raises(ConfigError) as info:
        common.build_variant({"name": "gemma2", "compose": [{"name": "softcapp", "soft_cap": 1.0}]})
    assert info.value.key == "attention.compose.0.name"
