"""The memory estimate: refuses what cannot fit, in one line that names the key, and accepts the
defaults; numbers are checked against the tensors' own sizes, not against timings."""

from __future__ import annotations

import pytest

from attngym.estimate import available_memory, estimate, format_bytes

DEFAULTS = dict(  # conf/config.yaml on a CPU
    batch=1,
    heads=4,
    seq_len=1024,
    head_dim=64,
    dtype="float32",
    device="cpu",
    passes=("fwd", "bwd"),
    baselines=("sdpa", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "sdpa_dense_mask"),
    validate_rows=256,
)


def test_the_defaults_fit_this_machine():
    result = estimate(**DEFAULTS)
    assert result.fits and result.problem is None and not result.skipped_baselines
    assert result.available_bytes == available_memory("cpu") or result.available_bytes > 0


def test_ten_million_tokens_are_refused_in_one_line_naming_the_key():
    result = estimate(**{**DEFAULTS, "seq_len": 10_000_000})
    assert not result.fits and result.key == "shape.seq_len"
    assert "\n" not in result.problem and result.problem.startswith("shape.seq_len:")
    assert format_bytes(result.available_bytes) in result.problem  # both numbers
    assert format_bytes(result.needed_bytes) in result.problem


def test_resident_bytes_are_the_tensors_sizes():
    # fwd only, no validation, no baselines, plenty of memory: q, out (B, H, S, D), k, v
    # (B, G, S, D) and the float32 lse (B, H, S); the block mask 16 bytes a block pair.
    result = estimate(
        batch=2,
        heads=8,
        kv_heads=2,
        seq_len=4096,
        head_dim=64,
        dtype="bfloat16",
        device="cpu",
        available_bytes=2**50,
        cpu_cores=8,
    )
    q = 2 * 8 * 4096 * 64 * 2
    kv = 2 * 2 * 2 * 4096 * 64 * 2
    assert result.parts["resident"] == 2 * q + kv + 2 * 8 * 4096 * 4
    assert result.parts["block_mask"] == 16 * 32 * 32
    assert result.parts["flex"] == 2 * 2 * 8 * 4096 * 4096 * 4  # eager flex: S x S twice


def test_a_baseline_that_alone_does_not_fit_is_skipped_with_its_reason():
    # 34 GiB: at S=32K the run's own eager flex scores (float32 scores and probabilities, 4 heads
    # of 4 GiB each: 32 GiB, plus the process) fit, SDPA's math backend (the same 32 GiB) too,
    # the dense-mask baseline (its 4 GiB float32 (S x S) bias on top: 36 GiB) does not.
    result = estimate(
        **{**DEFAULTS, "seq_len": 32768, "validate_rows": 0, "passes": ("fwd",)},
        available_bytes=34 * 2**30,
    )
    assert result.fits
    assert set(result.skipped_baselines) == {"sdpa_dense_mask"}
    assert "available" in result.skipped_baselines["sdpa_dense_mask"]


def test_a_large_reference_names_validate_rows():
    # On CUDA flex and the SDPA backends work tile by tile; validating every one of 64K rows in
    # float64 (32 heads x 64K x 64K x 8 bytes, three times) is what does not fit in 80 GB.
    big = {"batch": 1, "heads": 32, "seq_len": 65536, "validate_rows": 65536}
    result = estimate(**{**DEFAULTS, **big, "device": "cuda"}, available_bytes=80 * 2**30)
    assert result.key == "validate_rows"
    assert estimate(**{**DEFAULTS, **big, "validate_rows": 1, "device": "cuda"},
                    available_bytes=80 * 2**30).fits  # fmt: skip


@pytest.mark.parametrize(
    ("change", "key"),
    [
        # The reference is the largest term, but the inputs alone are 3,000 TiB: only the batch
        # can make it fit (it named validate_rows, and shape.batch only at validate_rows=1).
        ({"batch": 100_000_000}, "shape.batch"),
        ({"batch": 100_000_000, "validate_rows": 1}, "shape.batch"),
        # 64 x 32 heads x 64K rows of inputs do not fit in 80 GB whatever is validated.
        ({"batch": 64, "heads": 32, "seq_len": 65536, "validate_rows": 65536}, "shape.batch"),
        # On a CPU eager flex's (S x S) scores do not fit either: seq_len, not validate_rows.
        ({"seq_len": 200_000, "validate_rows": 200_000, "passes": ("fwd",)}, "shape.seq_len"),
    ],
)
def test_the_key_named_can_make_the_run_fit(change, key):
    device = "cuda" if change.get("heads") == 32 else "cpu"
    result = estimate(**{**DEFAULTS, **change, "device": device}, available_bytes=80 * 2**30)
    assert result.key == key and result.problem.endswith(f"shrink {key}")


def test_far_more_ranks_than_cores_on_a_cpu_are_refused():
    result = estimate(**{**DEFAULTS, "world_size": 9}, cpu_cores=2)
    assert result.key == "topology.world_size" and "<=8" in result.problem
    assert estimate(**{**DEFAULTS, "world_size": 8}, cpu_cores=2).fits


def test_a_few_more_ranks_than_cores_run_with_a_warning(caplog):
    # 3 ranks on 2 cores is how an odd world size is tested on a laptop.
    with caplog.at_level("WARNING", logger="attngym.estimate"):
        assert estimate(**{**DEFAULTS, "world_size": 3}, cpu_cores=2).fits
    assert "world_size=3 ranks share this CPU's 2 core(s)" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="attngym.estimate"):
        assert estimate(**{**DEFAULTS, "world_size": 2}, cpu_cores=2).fits
    assert caplog.text == ""


def test_an_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="dtype"):
        estimate(**{**DEFAULTS, "dtype": "auto"})


def test_under_torchrun_every_rank_judges_by_the_total_memory(monkeypatch, caplog):
    """Free memory differs between GPUs (and moves between ranks' checks): under torchrun the
    ranks judge against the device's total, which is the same on like machines, so they agree."""
    from attngym.runner import config

    total = available_memory("cpu", total=True)
    assert total is not None and total >= available_memory("cpu")
    data = {
        "shape": {k: DEFAULTS[k] for k in ("batch", "heads", "seq_len", "head_dim")},
        "passes": ["fwd"], "baselines": [], "validate": False, "validate_rows": 0,
        "baseline_max_mask_bytes": None,
    }  # fmt: skip
    with caplog.at_level("INFO", logger="attngym.runner.config"):
        config.resolve._check_fits(data, "cpu", "float32", 1, (128, 128))
    assert "available" in caplog.text and "in all" not in caplog.text
    caplog.clear()
    monkeypatch.setenv("LOCAL_RANK", "0")
    with caplog.at_level("INFO", logger="attngym.runner.config"):
        config.resolve._check_fits(data, "cpu", "float32", 1, (128, 128))
    assert f"of {format_bytes(total)} in all (each rank of torchrun or SLURM" in caplog.text
