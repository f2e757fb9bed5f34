"""How near the device's limit: the mask's kept density (exact), the peak table and probe, the
energy counter, and what a run records where it cannot measure them."""

from __future__ import annotations

import json
import time

import pytest
import torch

from attngym import bench, energy, kernels, peak, variants
from attngym.reference import dense_mask
from attngym.variants.base import Variant


def _head_stripes(b, h, q_idx, kv_idx):
    """A user's mask that depends on the head and the batch: no block rule, partial blocks."""
    return (q_idx >= kv_idx) & ((q_idx - kv_idx) % (h + 2 + b) != 1)


@pytest.mark.parametrize("seq", [512, 500])
@pytest.mark.parametrize(
    "variant",
    [
        variants.get("causal"),
        variants.get("sliding_window", window_size=40),
        variants.get("document", doc_lengths=[150, 350]),
        Variant(name="user", mask_mod=_head_stripes),
        variants.get("full"),
    ],
    ids=lambda v: v.name,
)
def test_mask_density_is_the_dense_masks_mean(variant, seq):
    """Every batch and head, partial blocks evaluated, blocks cut at the sequence's end."""
    if variant.name == "document":
        variant = variants.get("document", doc_lengths=[150, seq - 150])
    block_mask = kernels.make_block_mask(variant, seq, seq, block_size=(64, 128), device="cpu")
    got, rows = bench.mask_density(variant.mask_mod, block_mask, 2, 3)
    pos = torch.arange(seq)
    want = dense_mask(variant.mask_mod, 2, 3, pos, pos).expand(2, 3, seq, seq).double().mean()
    assert got == pytest.approx(float(want), abs=1e-12) and rows == 1.0


def test_past_its_budget_mask_density_samples_rows_and_says_so():
    """Every other row of blocks evaluated (half the partial entries allowed): full blocks still
    counted exactly, the evaluated rows standing for the others, `rows` 0.5."""
    variant = variants.get("sliding_window", window_size=300)
    seq = 4096
    block_mask = kernels.make_block_mask(variant, seq, seq, block_size=(64, 64), device="cpu")
    exact, _ = bench.mask_density(variant.mask_mod, block_mask, 1, 1)
    partial = int(block_mask.kv_num_blocks.sum()) * 64 * 64
    near, rows = bench.mask_density(variant.mask_mod, block_mask, 1, 1, budget=partial // 2 + 1)
    assert rows == 0.5 and near == pytest.approx(exact, rel=0.01) and near != exact


def test_peak_on_a_cpu_and_for_other_dtypes_says_why_not():
    assert peak.peak("cpu", "bfloat16") == peak.Peak(None, "no peak for cpu devices")
    if torch.cuda.is_available():
        why = peak.peak("cuda", "float32").source
        assert why == "the peak is for bf16/fp16 runs, this one is float32"


@pytest.mark.parametrize(
    ("name", "tflops"),
    [
        ("NVIDIA H200", 989.5),
        ("NVIDIA H200 NVL", 835.5),
        ("NVIDIA H100 80GB HBM3", 989.5),
        ("NVIDIA H100 PCIe", 756.5),
        ("NVIDIA H100 NVL", 835.5),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA L40S", 366.5),
        ("NVIDIA L4", 121.0),
    ],
)
def test_peak_table_picks_the_most_specific_entry(monkeypatch, name, tflops):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    got = peak.peak("cuda", "bfloat16")
    assert got.tflops == tflops and got.source.startswith("table: NVIDIA")


def test_an_unknown_gpu_is_probed_once_and_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some GPU 9000")
    assert peak.peak("cuda", "float16", probe=False).source == (
        "'Some GPU 9000' is not in the peak table"
    )
    probes = []
    monkeypatch.setattr(peak, "matmul_tflops", lambda device: probes.append(device) or 123.4)
    first, again = peak.peak("cuda", "float16"), peak.peak("cuda", "bfloat16")
    assert first == again and first.tflops == 123.4 and len(probes) == 1
    assert first.source.startswith("probe: a bf16 8192^3 matmul on Some GPU 9000")
    cached = json.loads((tmp_path / "attngym" / "peak.json").read_text())
    assert list(cached.values()) == [123.4]


def test_peak_fraction_is_the_kept_flops_rate_over_the_peak():
    flops = bench.attention_flops(1, 8, 8192, 8192, 128, sparsity=0.5)
    assert bench.peak_fraction(flops, 1.0, 1000.0) == pytest.approx(flops / 1e9 / 1000.0)
    assert bench.peak_fraction(flops, 1.0, None) is None


class _SteppingCounter:
    """A counter as NVML's behaves on an H200: `watts` accumulated, visible every 100 ms."""

    def __init__(self, watts: float):
        self.watts, self.start = watts, time.perf_counter()

    def millijoules(self) -> int:
        shown = (time.perf_counter() - self.start) // 0.1 * 0.1
        return int(self.watts * shown * 1e3)


def test_joules_per_call_reads_power_between_the_counters_steps():
    """Two reads around a loop would be off by up to a step (100 ms of 0.2 s here): the power
    between the first and last steps seen is within a few percent, and a call's joules are that
    power times the loop's time per call."""
    counter, calls = _SteppingCounter(500.0), []
    start = time.perf_counter()
    spent = energy.joules_per_call(
        counter, lambda: calls.append(time.sleep(2e-3)), torch.device("cpu"), call_ms=2.0,
        repeats=3, min_s=0.6,
    )  # fmt: skip
    per_call_s = (time.perf_counter() - start) / len(calls)  # a busy machine's sleeps overshoot
    assert spent.watts == pytest.approx(500, rel=0.05)
    assert spent.joules == pytest.approx(500 * per_call_s, rel=0.05)


class _FailingCounter(_SteppingCounter):
    """A counter whose reads start failing part way (a driver reset, say)."""

    def millijoules(self) -> int:
        if time.perf_counter() - self.start > 0.3:
            raise RuntimeError("NVML: GPU is lost")
        return super().millijoules()


@pytest.mark.parametrize("counter", [_SteppingCounter(0.0), _FailingCounter(500.0)],
                         ids=["still", "failing"])  # fmt: skip
def test_a_counter_that_does_not_move_or_fails_measures_nothing(counter):
    assert energy.joules_per_call(counter, lambda: time.sleep(1e-3), torch.device("cpu"),
                                  call_ms=1.0, repeats=3, min_s=0.6) is None  # fmt: skip


def test_a_cpu_has_no_energy_counter():
    assert energy.meter("cpu") == (None, "no energy counter on cpu devices")


def test_a_cpu_run_says_in_one_place_what_it_cannot_measure(tmp_path):
    from attngym.runner.config import Benchmark, Settings, Shape
    from attngym.runner.tasks import single

    settings = Settings(
        attention={"name": "sliding_window", "window_size": 32},
        shape=Shape(batch=1, heads=2, seq_len=256, head_dim=16),
        benchmark=Benchmark(warmup=0, repeats=1),
        device="cpu",
        dtype="float32",
        block_size=(64, 64),
        baselines=("sdpa_dense_mask",),
        validate_rows=8,
    )
    metrics = single.run(settings, tmp_path)
    assert metrics["not_measured"] == (
        "fraction of peak (no peak for cpu devices); energy (no energy counter on cpu devices); "
        "kernel path (no CUDA kernels on cpu)"
    )
    assert "kernel_path_fwd" not in metrics
    assert (
        metrics["flash"]
        == "refused: FLASH needs a 16-bit dtype (bfloat16 or float16), but dtype=float32"
    )
    for key in ("peak_tflops", "peak_source", "energy_source", "fwd_peak_fraction"):
        assert metrics[key] is None, key
    assert "fwd_joules" not in metrics and metrics["sdpa_dense_mask_fwd_peak_fraction"] is None
    pos = torch.arange(256)
    variant = variants.get("sliding_window", window_size=32)
    want = float(dense_mask(variant.mask_mod, 1, 1, pos, pos).double().mean())
    assert metrics["mask_density"] == pytest.approx(want)
    assert metrics["flops_spent_over_kept"] == pytest.approx((1 - metrics["sparsity"]) / want)
    assert metrics["flops_spent_over_kept"] > 1  # partial blocks compute masked entries


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_energy_counter_reads_a_matmul_loop():
    meter, source = energy.meter("cuda")
    if meter is None:
        pytest.skip(source)
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    spent = energy.joules_per_call(meter, lambda: a @ a, torch.device("cuda"), call_ms=0.2,
                                   repeats=5)  # fmt: skip
    assert 0 < spent.joules < 10 and 20 < spent.watts < 2000, spent


@pytest.mark.parametrize(
    ("names", "family"),
    [
        (["triton_tem_fused_0", "triton_poi_fused_1"], "triton (triton_tem_fused_0)"),
        (["kernel_cutlass_flash_attncute_fwd_sm90", "triton_poi_x"], "flash"),
        (["triton_tem_fused_flex_decoding_0"], "triton decode"),
        (["ampere_bf16_s16816gemm", "softmax_warp_forward"], "eager (2 kernels"),
        ([], "no CUDA kernel"),
    ],
)
def test_kernel_family_reads_the_kernels_that_ran(names, family):
    from attngym.profiling import kernel_family

    assert kernel_family(names).startswith(family)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_run_reports_its_fraction_of_peak_energy_and_kernel_path(tmp_path):
    from attngym.runner.config import Benchmark, Settings, Shape
    from attngym.runner.tasks import single

    settings = Settings(
        attention={"name": "causal"},
        shape=Shape(batch=1, heads=8, seq_len=4096, head_dim=128),
        benchmark=Benchmark(warmup=2, repeats=5),
        device="cuda",
        dtype="bfloat16",
        baselines=("sdpa",),
        validate_rows=16,
    )
    metrics = single.run(settings, tmp_path)
    assert metrics["kernel_path_fwd"].startswith("triton (")
    assert metrics["kernel_path_bwd"].startswith("triton (")
    assert 0 < metrics["fwd_peak_fraction"] < 1 and 0 < metrics["sdpa_fwd_peak_fraction"] < 1
    assert metrics["mask_density"] == pytest.approx(0.5, abs=1e-3)
    if metrics["energy_source"] is not None:
        assert metrics["fwd_bwd_joules"] > metrics["fwd_joules"] > 0
        assert metrics["fwd_joules_per_token"] == pytest.approx(metrics["fwd_joules"] / 4096)
    assert "kernel path" not in (metrics["not_measured"] or "")
    assert metrics["flash"].startswith(("possible", "refused: FLASH runs flash-attn-4"))
