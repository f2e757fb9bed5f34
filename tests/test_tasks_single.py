"""The single-device task against the float64 reference.

On CPU flex runs eagerly, forward only; its float32 output is compared with the float64 reference
on the validated rows. Tolerance: float32 attention over S <= 256 keys accumulates rounding of
order 1e-6 relative; 1e-4 absolute leaves two orders of margin while any masking bug (an entry
kept or dropped) moves outputs by O(0.1).
"""

from __future__ import annotations

import pytest
import torch

from attngym import reference
from attngym.inputs import make_inputs
from attngym.runner.config import Benchmark, Settings, Shape
from attngym.runner.tasks import phases, single
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
    assert m["validated_rows"] == 128  # the first and last query blocks of 64: every row
    assert m["err_out_max_abs"] < TOL and m["err_lse_max_abs"] < TOL
    assert m["err_timed_out_rel"] == 0.0  # the calls after validation give the same rows
    assert m["err_out_rel"] < TOL
    assert m["fwd_ms"] > 0 and m["fwd_ms_min"] <= m["fwd_ms"] <= m["fwd_ms_max"]
    assert m["fwd_tflops"] > 0 and m["first_call_s"] > 0
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
    rank = phases.Rank(
        attend=lambda: _NoBackward.apply(q),
        leaves=(q, k, v),
        grad_out=g,
        device=torch.device("cpu"),
        warmup=0,
        repeats=1,
    )
    passes = ("fwd", "bwd", "fwd_bwd")
    failures: dict[str, str] = {}
    times = phases.time_passes(rank, passes, label="sdpa_x", failures=failures)
    assert set(times) == {"fwd"} and times["fwd"].median_ms > 0
    assert failures == {
        "bwd": "No available kernel for the backward",
        "fwd_bwd": "No available kernel for the backward",
    }
    with pytest.raises(RuntimeError, match="No available kernel"):  # flex: the run fails
        phases.time_passes(rank, passes)


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


def test_a_baseline_the_estimate_skips_is_recorded_with_its_reason(tmp_path):
    why = "needs ~9 GiB with the run's tensors, 8 GiB available"
    skipped = {"sdpa_dense_mask": why}
    m = single.run(settings({"name": "causal"}, skipped_baselines=skipped), tmp_path)
    assert m["sdpa_dense_mask_status"] == f"skipped: {why}"
    assert m.get("sdpa_dense_mask_fwd_ms") is None  # not attempted
    assert m["sdpa_status"] == "ok"  # the others still run


class _CountedBackward(torch.autograd.Function):
    """x * 2 that counts its backward calls."""

    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        _CountedBackward.calls += 1
        return grad * 2


def _recording_rank(seen: list, **over):
    x = torch.randn(4, 3, requires_grad=True)

    def call():
        seen.append(torch.is_grad_enabled())
        return _CountedBackward.apply(x)

    fields = dict(
        attend=call,
        leaves=(x,),
        grad_out=torch.ones(4, 3),
        device=torch.device("cpu"),
        warmup=1,
        repeats=2,
    )
    return phases.Rank(**(fields | over))


def test_fwd_records_autograd_exactly_when_the_run_times_a_backward():
    """fwd_ms's one meaning (phases' docstring): the forward as training runs it when a backward
    is timed too, under no_grad when the run is forward only."""
    seen: list[bool] = []
    rank = _recording_rank(seen)
    forward_only = phases.time_passes(rank, ("fwd",))
    assert set(forward_only) == {"fwd"} and seen == [False] * 3  # warmup + repeats
    seen.clear()
    before = _CountedBackward.calls
    both = phases.time_passes(rank, ("fwd", "bwd", "fwd_bwd"))
    assert set(both) == {"fwd", "bwd", "fwd_bwd"}
    assert seen == [True] * 9  # fwd, the bwd's fresh graphs, fwd_bwd: 3 calls each
    assert _CountedBackward.calls - before == 6  # bwd and fwd_bwd: 3 backwards each


def test_first_call_runs_the_backward_only_when_one_is_timed():
    seen: list[bool] = []
    rank = _recording_rank(seen)
    before = _CountedBackward.calls
    assert phases.first_call(rank, backward=False) > 0
    assert seen == [False] and _CountedBackward.calls == before
    assert phases.first_call(rank, backward=True) > 0
    assert seen == [False, True] and _CountedBackward.calls == before + 1


def test_peak_memory_is_reduced_over_the_ranks():
    """peak_mem_bytes is the largest rank's: the block's own peak goes through max_over_ranks,
    the identity at world size 1."""
    asked: list[int] = []

    def max_over_ranks(value: int) -> int:
        asked.append(value)
        return 12345

    into: dict = {}
    with phases.peak_memory(_recording_rank([], max_over_ranks=max_over_ranks), into, "peak"):
        torch.ones(2**20).sum()
    assert into == {"peak": 12345} and len(asked) == 1 and asked[0] >= 0
    with phases.peak_memory(_recording_rank([]), into, "alone"):
        pass
    assert into["alone"] is None or into["alone"] > 0  # world size 1: this process's own peak


def test_a_cpu_block_that_does_not_grow_the_process_reports_no_peak(monkeypatch):
    # A CPU process that already holds freed pages runs the block in them: its resident set
    # does not grow, and 0 B would read as a measurement. It is None (empty) instead.
    import contextlib

    from attngym import device as device_mod

    @contextlib.contextmanager
    def grew_by(nbytes):
        yield (result := {})
        result["bytes"] = nbytes

    into: dict = {}
    monkeypatch.setattr(device_mod, "peak_memory", lambda device: grew_by(0))
    with phases.peak_memory(_recording_rank([]), into, "peak"):
        pass
    assert into == {"peak": None}
    monkeypatch.setattr(device_mod, "peak_memory", lambda device: grew_by(4096))
    with phases.peak_memory(_recording_rank([]), into, "peak"):
        pass
    assert into == {"peak": 4096}


@pytest.mark.parametrize(
    ("wanted", "done", "status"),
    [
        (True, True, "ok"),
        (True, False, "not available: FlexAttention has no CPU backward"),
        (False, False, "not requested"),
    ],
)
def test_bwd_status_has_one_text_for_each_case(wanted, done, status):
    assert phases.bwd_status(wanted, done) == status


def test_every_ratio_of_a_run_carries_its_interval(tmp_path):
    """flex_over_<baseline>_<pass> and the headlines each with `_ci95`: [lo, hi] around the
    ratio from 5 timed calls a side, null from fewer (said in the metric's meaning)."""
    m = single.run(settings({"name": "causal"}, benchmark=Benchmark(repeats=5, budget_ms=0)),
                   tmp_path)  # fmt: skip
    ratios = [k for k in m if k.startswith("flex_over_") and not k.endswith("_ci95")]
    assert {"flex_over_sdpa_fwd", "flex_over_best_fwd", "flex_over_best_sdpa_fwd"} <= set(ratios)
    for key in ratios:
        lo, hi = m[f"{key}_ci95"]
        assert lo <= m[key] <= hi, key
    few = single.run(settings({"name": "causal"}, benchmark=Benchmark(repeats=2, budget_ms=0)),
                     tmp_path)  # fmt: skip
    assert few["flex_over_sdpa_fwd"] > 0 and few["flex_over_sdpa_fwd_ci95"] is None


def test_contenders_are_timed_together_and_a_pass_one_cannot_run_is_left_out():
    """time_contenders: per pass, rounds of one call of each contender; a contender's pass that
    raises (a backend with no backward here) is recorded and its other passes still timed."""
    seen: list[bool] = []
    rank = _recording_rank(seen, repeats=3)
    order: list[str] = []

    def one(name):
        def call():
            order.append(name)
            return rank.attend()

        return call

    def no_backward():  # an output the leaves are not in: its backward raises
        return torch.zeros(4, 3, requires_grad=True) * 1

    failures: dict = {}
    times = phases.time_contenders(
        {"a": (rank, one("a")), "b": (rank, one("b")), "c": (rank, no_backward)},
        ("fwd", "fwd_bwd"),
        failures,
    )
    assert set(times["a"]) == set(times["b"]) == {"fwd", "fwd_bwd"} and set(times["c"]) == {"fwd"}
    assert list(failures) == ["c"] and list(failures["c"]) == ["fwd_bwd"]
    assert times["a"]["fwd"].repeats == times["b"]["fwd"].repeats == times["c"]["fwd"].repeats == 3
    assert order[:2] == ["a", "b"] and order[2:8] == ["a", "b"] * 3  # warm-up, then rounds
