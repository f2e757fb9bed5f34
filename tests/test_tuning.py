"""The tuned table: winners from a sweep summary, lookup order, and `block_size=tuned`."""

from __future__ import annotations

import csv
import json
import logging

import pytest

from attngym import tuning
from attngym.runner import config
from attngym.runner.tracking.sweep import write_csv

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
    # CPU rows (no capability) are a CPU's own entries, never a GPU's
    {"capability": "", "variant": "causal", "head_dim": "128", "seq_len": "8192",
     "block_q": "128", "block_kv": "128", "status": "ok", "fwd_bwd_tflops": "1000"},
]  # fmt: skip


def test_winners_pick_the_fastest_ok_row_per_gpu_variant_and_head_dim():
    table = tuning.winners(ROWS, "fwd_bwd_tflops")
    assert sorted(table) == ["cpu", "sm90"]
    assert table["cpu"]["causal/d128"]["fwd_bwd_tflops"] == 1000
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
    assert tuning.lookup("causal", 128, None, table=table) is None  # a CPU: "cpu", not sm90


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


FLASH_ROWS = [
    # FLASH faster than Triton: 1.405x the rows' Triton winner (ROWS), 1.5x its own flex_default
    {"capability": "9.0", "variant": "causal", "head_dim": "128", "seq_len": "8192",
     "block_q": "128", "block_kv": "128", "status": "ok", "fwd_bwd_tflops": "450.0",
     "kernel_options.BACKEND": "FLASH", "flex_default_fwd_bwd_tflops": "300.0",
     # a tuning trial's Triton options, which FLASH ignores: not kept in its part
     "kernel_options.fwd_BLOCK_M": "64", "kernel_options.bwd_num_warps": "8"},
    # FLASH slower than Triton on the narrow window: recorded, never taken
    {"capability": "9.0", "variant": "sliding_window", "head_dim": "128", "seq_len": "8192",
     "block_q": "128", "block_kv": "128", "status": "ok", "fwd_bwd_tflops": "180.0",
     "kernel_options.BACKEND": "FLASH", "flex_default_fwd_bwd_tflops": "240.0"},
    # no Triton reference in the row: not comparable, skipped
    {"capability": "9.0", "variant": "full", "head_dim": "128", "seq_len": "8192",
     "block_q": "128", "block_kv": "128", "status": "ok", "fwd_bwd_tflops": "600.0",
     "kernel_options.BACKEND": "FLASH", "flex_default_fwd_bwd_tflops": ""},
]  # fmt: skip


def _write_csv(path, rows):
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=sorted({k for row in rows for k in row}))
        writer.writeheader()
        writer.writerows(rows)


def test_flash_rows_become_flash_parts_measured_against_triton():
    table = tuning.winners(ROWS + FLASH_ROWS, "fwd_bwd_tflops")["sm90"]
    assert table["causal/d128"]["block_size"] == [128, 128]  # the Triton winner stays
    assert table["causal/d128"]["kernel_options"] == {"fwd_BLOCK_M": 64}
    assert table["causal/d128"]["flash"]["kernel_options"] == {"BACKEND": "FLASH"}
    assert table["causal/d128"]["flash"]["over_triton"] == 1.405  # over the Triton part
    assert table["sliding_window/d128"] == {"flash": table["sliding_window/d128"]["flash"]}
    assert table["sliding_window/d128"]["flash"]["over_triton"] == 0.75
    assert "full/d128" not in table


def test_update_from_a_csv_keeps_the_other_backends_part(tmp_path):
    table_path = tmp_path / "tuned.json"
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    _write_csv(sweep / "summary.csv", ROWS)
    tuning.update(sweep, "fwd_bwd_tflops", table_path)
    _write_csv(tmp_path / "flash_backend.csv", FLASH_ROWS)
    tuning.update(tmp_path / "flash_backend.csv", "fwd_bwd_tflops", table_path)
    causal = json.loads(table_path.read_text())["sm90"]["causal/d128"]
    assert causal["kernel_options"] == {"fwd_BLOCK_M": 64}  # the Triton sweep's winner is kept
    assert causal["source"] == "sweep, best fwd_bwd_tflops"
    assert causal["flash"]["over_triton"] == 1.5
    assert causal["flash"]["source"].startswith("flash_backend, best fwd_bwd_tflops")
    tuning.update(sweep, "fwd_bwd_tflops", table_path)  # and a Triton re-run keeps FLASH's part
    assert json.loads(table_path.read_text())["sm90"]["causal/d128"]["flash"]["over_triton"] == 1.5


def test_the_checked_in_table_takes_flash_except_on_the_narrow_window():
    table = tuning.load()["sm90"]
    faster = {
        name for name, entry in table.items() if entry.get("flash", {}).get("over_triton", 0) > 1
    }
    assert "causal/d128" in faster and "full/d64" in faster
    assert table["sliding_window/d128"]["flash"]["over_triton"] < 1


TABLE = tuning.winners(ROWS + FLASH_ROWS, "fwd_bwd_tflops")


@pytest.fixture
def flash_table(monkeypatch):
    monkeypatch.setattr(tuning, "load", lambda path=tuning.TABLE: TABLE)


@pytest.mark.parametrize("importable", [True, False])
def test_resolve_takes_flash_only_where_importable_and_faster(
    flash_table, monkeypatch, caplog, importable
):
    monkeypatch.setattr(tuning, "flash_importable", lambda: importable)
    with caplog.at_level(logging.INFO, logger="attngym.tuning"):
        blocks, options = tuning.resolve("causal", 128, "9.0", {"num_warps": 4})
    if importable:
        assert options == {"BACKEND": "FLASH", "num_warps": 4}
        assert "FLASH (Triton not taken: FLASH measured 1.41x Triton)" in caplog.text
    else:
        assert options == {"fwd_BLOCK_M": 64, "num_warps": 4}
        assert "flash-attn-4 is not importable" in caplog.text
    assert blocks == (128, 128)


def test_resolve_keeps_triton_where_flash_measured_slower(flash_table, monkeypatch, caplog):
    monkeypatch.setattr(tuning, "flash_importable", lambda: True)
    with caplog.at_level(logging.INFO, logger="attngym.tuning"):
        blocks, options = tuning.resolve("sliding_window", 128, "9.0", {})
    # the entry has no Triton part: FlexAttention's defaults, Triton backend
    assert (blocks, options) == (tuning.DEFAULT_BLOCK_SIZE, {})
    assert "measured slower, 0.75x Triton" in caplog.text


def test_choose_backend_explains_each_case():
    triton = {"block_size": [64, 64], "kernel_options": {}}
    flash = {"block_size": [128, 128], "kernel_options": {"BACKEND": "FLASH"}, "over_triton": 1.3}
    both = {**triton, "flash": flash}
    assert tuning.choose_backend(triton, None, None) == (
        triton,
        "Triton (FLASH not taken: no FLASH entry)",
    )
    assert tuning.choose_backend(both, None, None)[0] is flash
    assert tuning.choose_backend(both, None, "no flash")[0] is both
    assert tuning.choose_backend(both, "TRITON", None) == (
        both,
        "Triton (kernel_options.BACKEND=TRITON)",
    )
    assert tuning.choose_backend(both, "FLASH", "no flash")[0] is flash  # asked: the user decides


@pytest.mark.parametrize(
    ("dtype", "topology", "reason"),
    [("float32", "single", "16-bit dtype"), ("bfloat16", "ring", "topology=ring")],
)
def test_resolve_keeps_flash_out_of_runs_it_cannot_do(
    flash_table, monkeypatch, caplog, dtype, topology, reason
):
    monkeypatch.setattr(tuning, "flash_importable", lambda: True)
    with caplog.at_level(logging.INFO, logger="attngym.tuning"):
        _, options = tuning.resolve("causal", 128, "9.0", {}, dtype=dtype, topology=topology)
    assert "BACKEND" not in options
    assert reason in caplog.text


def test_flash_importable_is_false_without_flash_attn(monkeypatch):
    def missing(name):
        raise ModuleNotFoundError(name)

    monkeypatch.setattr(tuning.importlib.util, "find_spec", missing)
    assert tuning.flash_importable() is False


def test_times_win_when_lower_and_a_better_entry_is_kept(tmp_path):
    """The tuner's objective is a time: the lowest wins, and an entry already faster (an earlier
    sweep of the study) stays when a later sweep finds nothing better."""
    rows = [
        {"capability": "9.0", "variant": "mine", "head_dim": "64", "seq_len": "4096",
         "block_q": bq, "block_kv": "128", "status": "ok", "validation": valid, "fwd_bwd_ms": ms}
        for bq, ms, valid in (("128", "2.5", "ok"), ("64", "2.0", "ok"), ("32", "1.0", "failed"))
    ]  # fmt: skip
    entry = tuning.winners(rows, "fwd_bwd_ms")["sm90"]["mine/d64"]
    assert entry["block_size"] == [64, 128] and entry["fwd_bwd_ms"] == 2.0  # unvalidated: out

    def sweep(name, rows):
        folder = tmp_path / name
        folder.mkdir()
        with (folder / "summary.csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=sorted(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        return folder

    path = tmp_path / "tuned.json"
    tuning.update(sweep("first", rows), "fwd_bwd_ms", path, keep_better=True)
    slower = [{**rows[0], "block_q": "16", "fwd_bwd_ms": "3.0"}]
    table = tuning.update(sweep("second", slower), "fwd_bwd_ms", path, keep_better=True)
    assert table["sm90"]["mine/d64"]["block_size"] == [64, 128]  # kept
    faster = [{**rows[0], "block_q": "16", "fwd_bwd_ms": "1.5"}]
    table = tuning.update(sweep("third", faster), "fwd_bwd_ms", path, keep_better=True)
    assert table["sm90"]["mine/d64"]["block_size"] == [16, 128]


def test_a_studys_flash_trial_is_judged_against_its_best_triton_trial():
    """The tuner's trials run FLASH and Triton apart (no flex_default column): FLASH's part is
    measured against the best Triton trial of the same rows, so block_size=tuned can take it."""
    base = {"capability": "9.0", "variant": "mine", "head_dim": "128", "seq_len": "8192",
            "status": "ok", "validation": "ok"}  # fmt: skip
    rows = [
        {**base, "block_q": "128", "block_kv": "128", "fwd_bwd_ms": "2.0"},
        {**base, "block_q": "64", "block_kv": "128", "fwd_bwd_ms": "2.4"},
        {**base, "block_q": "128", "block_kv": "128", "fwd_bwd_ms": "1.6",
         "kernel_options.BACKEND": "FLASH"},
    ]  # fmt: skip
    entry = tuning.winners(rows, "fwd_bwd_ms")["sm90"]["mine/d128"]
    assert entry["fwd_bwd_ms"] == 2.0 and entry["flash"]["over_triton"] == 1.25
    alone = tuning.winners(rows[2:], "fwd_bwd_ms")  # no Triton to compare with: skipped
    assert alone == {}


def test_a_trial_wins_only_if_it_beats_the_defaults_of_its_own_run():
    """The tuner runs FlexAttention's defaults (flex_default) in every trial: a Triton trial no
    faster than them is no candidate, and FLASH is judged against the Triton part the entry
    gets, else against the defaults (a study whose Triton trials all lost or failed)."""
    base = {"capability": "9.0", "variant": "mine", "head_dim": "128", "seq_len": "8192",
            "status": "ok", "validation": "ok", "block_q": "64", "block_kv": "64"}  # fmt: skip
    slow = {**base, "fwd_bwd_ms": "2.2", "flex_default_fwd_bwd_ms": "2.0"}
    fast = {**base, "fwd_bwd_ms": "1.6", "flex_default_fwd_bwd_ms": "2.0",
            "kernel_options.fwd_num_warps": "8"}  # fmt: skip
    flash = {**base, "block_q": "128", "block_kv": "128", "fwd_bwd_ms": "1.2",
             "flex_default_fwd_bwd_ms": "2.1", "kernel_options.BACKEND": "FLASH"}  # fmt: skip
    entry = tuning.winners([slow, fast, flash], "fwd_bwd_ms")["sm90"]["mine/d128"]
    assert entry["fwd_bwd_ms"] == 1.6 and entry["flash"]["over_triton"] == round(1.6 / 1.2, 3)
    entry = tuning.winners([slow, flash], "fwd_bwd_ms")["sm90"]["mine/d128"]
    assert "block_size" not in entry  # no Triton trial beat the defaults: they stay
    assert entry["flash"]["over_triton"] == 1.75  # over the defaults of its own run
    assert tuning.winners([slow], "fwd_bwd_ms") == {}


def test_trials_of_one_configuration_count_by_their_median():
    """What the H200 showed: two FLASH trials of a window study (their Triton tiles meant
    nothing) read 1.30 and 2.32 ms against defaults of 1.49 and 1.47; the lucky one alone had
    made FLASH the table's pick, and the next run 0.77x the defaults."""
    base = {"capability": "9.0", "variant": "sliding_window", "head_dim": "128",
            "seq_len": "8192", "status": "ok", "validation": "ok", "block_q": "128",
            "block_kv": "128", "kernel_options.BACKEND": "FLASH"}  # fmt: skip
    rows = [
        {**base, "fwd_bwd_ms": "1.295", "flex_default_fwd_bwd_ms": "1.485",
         "kernel_options.fwd_BLOCK_M": "64"},
        {**base, "fwd_bwd_ms": "2.321", "flex_default_fwd_bwd_ms": "1.474",
         "kernel_options.fwd_BLOCK_M": "32"},
    ]  # fmt: skip
    flash = tuning.winners(rows, "fwd_bwd_ms")["sm90"]["sliding_window/d128"]["flash"]
    assert flash["runs"] == 2 and flash["fwd_bwd_ms"] == 1.808
    assert flash["over_triton"] == round(1.4795 / 1.808, 3) < 1  # recorded, never taken
    assert tuning.choose_backend({"flash": flash}, None, None)[0] is None


def test_the_tuner_never_writes_the_defaults_and_says_in_one_line_why_nothing_won(tmp_path):
    """A study whose trials are the defaults or slower than them in their own run writes
    nothing; the reason names the best trial and the defaults' median."""
    base = {"capability": "9.0", "variant": "mine", "head_dim": "128", "seq_len": "8192",
            "status": "ok", "validation": "ok"}  # fmt: skip
    rows = [
        {**base, "block_q": "128", "block_kv": "128", "fwd_bwd_ms": "9.0"},  # the defaults
        {**base, "block_q": "128", "block_kv": "128", "fwd_bwd_ms": "9.5",
         "kernel_options.fwd_num_warps": "4", "flex_default_fwd_bwd_ms": "9.1"},
    ]  # fmt: skip
    assert tuning.winners(rows, "fwd_bwd_ms")["sm90"]["mine/d128"]["fwd_bwd_ms"] == 9.0
    assert tuning.winners(rows, "fwd_bwd_ms", skip_defaults=True) == {}
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    write_csv(rows, sweep / "summary.csv")
    with pytest.raises(ValueError) as info:
        tuning.update(sweep, "fwd_bwd_ms", tmp_path / "t.json", skip_defaults=True)
    assert str(info.value) == (
        "no configuration of 2 validated trials beat FlexAttention's defaults in its own run "
        "beyond the 95 % interval (best fwd_bwd_ms 9, FlexAttention's defaults 9.1): the "
        "defaults stay"
    )
    assert not (tmp_path / "t.json").exists()
