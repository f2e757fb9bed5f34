"""The tuned table: winners from a sweep summary, lookup order, and `block_size=tuned`."""

from __future__ import annotations

import csv
import json
import logging

import pytest

from attngym import config, tuning

ROWS = [
    # two configs of causal/d128 on sm90: the faster one (by fwd_bwd_tflops) must win
    {"capability": "9.0", "variant": "causal", "head_dim": "128", "seq_len": "8192",
     "block_q": "128", "block_kv": "128", "status": "ok", "fwd_bwd_tflops": "300.5",
     "kernel_options.fwd_BLOCK_M": "128", "kernel_options.fwd_num_warps": "8"},
    {"capability": "9.0", "variant": "causal", "head_dim": "128", "seq_len": "8192",
     "block_q": "128", "block_kv": "128", "status": "ok", "fwd_bwd_tflops": "320.25",
     "kernel_options.fwd_BLOCK_M": "64", "kernel_options.fwd_num_warps": ""},
    # a failed job is never a winner, whatever it reports
    {"capability": "9.0", "variant": "causal", "head_dim": "128", "seq_len": "8192",
     "block_q": "64", "block_kv": "64", "status": "failed", "fwd_bwd_tflops": "999"},
    # CPU rows (no capability) are not tuning data
    {"capability": "", "variant": "causal", "head_dim": "128", "seq_len": "8192",
     "block_q": "128", "block_kv": "128", "status": "ok", "fwd_bwd_tflops": "1000"},
]  # fmt: skip


def test_winners_pick_the_fastest_ok_row_per_gpu_variant_and_head_dim():
    table = tuning.winners(ROWS, "fwd_bwd_tflops")
    assert list(table) == ["sm90"]
    entry = table["sm90"]["causal/d128"]
    assert entry["block_size"] == [128, 128]
    assert entry["kernel_options"] == {"fwd_BLOCK_M": 64}  # empty cells are not options
    assert entry["fwd_bwd_tflops"] == 320.25


def test_lookup_order_prefers_the_exact_head_dim_then_the_variant_then_default():
    table = {
        "sm90": {
            "causal/d128": {"block_size": [128, 64]},
            "causal": {"block_size": [64, 64]},
            "default": {"block_size": [128, 128]},
        }
    }
    assert tuning.lookup("causal", 128, "9.0", table=table)["block_size"] == [128, 64]
    assert tuning.lookup("causal", 64, "9.0", table=table)["block_size"] == [64, 64]
    assert tuning.lookup("document", 64, "9.0", table=table)["block_size"] == [128, 128]
    assert tuning.lookup("causal", 128, "10.0", table=table) is None
    assert tuning.lookup("causal", 128, None, table=table) is None


def test_update_writes_the_table_from_a_sweep_summary(tmp_path):
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    with (sweep / "summary.csv").open("w", newline="") as f:
        columns = sorted({k for row in ROWS for k in row})
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(ROWS)
    table_path = tmp_path / "tuned.json"
    tuning.update(sweep, "fwd_bwd_tflops", table_path)
    written = json.loads(table_path.read_text())
    assert written["sm90"]["causal/d128"]["kernel_options"] == {"fwd_BLOCK_M": 64}
    assert written["sm90"]["causal/d128"]["source"] == "sweep, best fwd_bwd_tflops"


def test_update_refuses_a_folder_without_summary(tmp_path):
    with pytest.raises(FileNotFoundError, match="summary.csv"):
        tuning.update(tmp_path, "fwd_bwd_tflops", tmp_path / "t.json")


def _cfg(**block_size):
    return {
        "attention": {"name": "causal"},
        "shape": {"batch": 1, "heads": 2, "seq_len": 256, "head_dim": 64},
        "device": {"name": "cpu"},
        "block_size": block_size,
        "topology": {"kind": "single", "world_size": 1},
        "profiler": {"name": "none"},
        "logger": {"name": "none"},
        "kernel_options": {"num_warps": 4},
    }


def test_block_size_tuned_uses_the_entry_and_keeps_explicit_kernel_options(monkeypatch):
    entry = {"block_size": [64, 128], "kernel_options": {"num_warps": 8, "num_stages": 2}}
    monkeypatch.setattr(tuning, "lookup", lambda *a, **k: {**entry, "source": "test"})
    settings = config.from_config(_cfg(q="tuned", kv="tuned"))
    assert settings.block_size == (64, 128)
    assert settings.kernel_options == {"num_warps": 4, "num_stages": 2}  # the user's 4 wins


def test_block_size_tuned_without_an_entry_falls_back_with_a_note(caplog):
    with caplog.at_level(logging.WARNING, logger="attngym.tuning"):
        settings = config.from_config(_cfg(q="tuned", kv="tuned"))  # CPU: never in the table
    assert settings.block_size == tuning.DEFAULT_BLOCK_SIZE
    assert settings.kernel_options == {"num_warps": 4}
    assert "no entry for causal" in caplog.text


def test_block_size_names_are_checked():
    with pytest.raises(config.ConfigError, match=r"block_size.q.*tuned"):
        config.from_config(_cfg(q="tunde", kv=128))
