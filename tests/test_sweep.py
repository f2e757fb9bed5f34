"""Sweeps end to end on CPU: summary files, a failing job, a resumed sweep.

Each sweep is one subprocess (`python -m attngym -m ...`) with tiny shapes; the module-scoped
fixtures share them across tests.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest
import yaml

from attngym.runner.tracking.sweep import collect

TINY = [
    "device=cpu",
    "shape.heads=2",
    "shape.head_dim=16",
    "benchmark.warmup=0",
    "benchmark.repeats=1",
    "validate_rows=32",
    "baselines=[]",
    "block_size=64",
    "logger=none",
]


@pytest.fixture(scope="module")
def grid(tmp_path_factory, attngym_cli):
    """A 2 x 2 multirun: attention x seq_len."""
    tmp = tmp_path_factory.mktemp("grid")
    sweep = tmp / "sweep"
    args = [
        "-m",
        *TINY,
        "attention=causal,full",
        "shape.seq_len=64,128",
        f"hydra.sweep.dir={sweep}",
    ]
    proc = attngym_cli(args, tmp)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return sweep


@pytest.fixture(scope="module")
def failing(tmp_path_factory, attngym_cli):
    """Two jobs, the second with a bad value; then the same sweep again into the same folder.
    A variant parameter and a numeric block size: Hydra receives them rewritten
    (`++attention.window_size=16`, `block_size='64'`), every record shows them as typed."""
    tmp = tmp_path_factory.mktemp("failing")
    sweep = tmp / "sweep"
    args = [
        "-m",
        *TINY,
        "shape.seq_len=64",
        "attention=sliding_window",
        "attention.window_size=16",
        "shape.kv_heads=1,3",
        f"hydra.sweep.dir={sweep}",
    ]
    first = attngym_cli(args, tmp)
    second = attngym_cli(args, tmp)
    return sweep, first, second


def test_grid_summary_files(grid):
    for name in ("summary.csv", "summary.md", "summary.png"):
        assert (grid / name).stat().st_size > 100, name
    with open(grid / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4 and {r["status"] for r in rows} == {"ok"}
    assert sorted((r["variant"], int(r["seq_len"])) for r in rows) == [
        ("causal", 64),
        ("causal", 128),
        ("full", 64),
        ("full", 128),
    ]
    assert all(float(r["err_out_max_abs"]) < 1e-4 for r in rows)
    md = (grid / "summary.md").read_text()
    assert "4 jobs, 0 failed." in md and "| causal " in md
    assert (grid / "summary.png").read_bytes()[:4] == b"\x89PNG"
    for job in ("0", "1", "2", "3"):
        assert (grid / job / "heatmap.png").is_file() and (grid / job / "metrics.json").is_file()


def test_failing_job_is_a_row_and_exit_is_nonzero(failing):
    sweep, first, _ = failing
    assert first.returncode == 1
    assert "1 of 2 sweep jobs failed" in first.stderr
    rows = {r["job"]: r for r in collect(sweep)}
    assert rows["0"]["status"] == "ok" and rows["0"]["fwd_ms"] > 0
    assert rows["1"]["status"] == "failed"
    assert rows["1"]["error"].startswith("shape.kv_heads:") and "3" in rows["1"]["error"]
    assert "shape.kv_heads" in (sweep / "summary.md").read_text()


def test_resumed_sweep_skips_finished_jobs(failing):
    sweep, _, second = failing
    assert second.returncode == 1  # the bad job runs again and fails again
    log = second.stdout + second.stderr
    assert "already ok" in log and "skipping" in log
    assert "job 1 shape.kv_heads=3" not in log or "failed" in log
    log0 = (sweep / "0" / "attngym.log").read_text()
    assert log0.count("validated") == 1  # job 0 computed once, in the first sweep only


def test_a_sweep_records_and_shows_the_overrides_as_typed(failing):
    sweep, first, _ = failing
    rows = collect(sweep)
    for row in rows:
        assert "attention.window_size=16" in row["overrides"].split()
        assert "block_size=64" in row["overrides"].split()
    metrics = json.loads((sweep / "0" / "metrics.json").read_text())
    assert "attention.window_size=16" in metrics["overrides"]
    grid = json.loads((sweep / "grid.json").read_text())["overrides"]
    assert "attention.window_size=16" in grid and "shape.kv_heads=1,3" in grid
    # Hydra's own launch lines ("[HYDRA] #0 : ...") show what Hydra received; attngym's do not.
    ours = [ln for ln in (first.stdout + first.stderr).splitlines() if "[HYDRA]" not in ln]
    printed = "\n".join(ours) + (sweep / "summary.md").read_text()
    printed += (sweep / "summary.csv").read_text()
    assert "attention.window_size=16" in printed
    assert "++" not in printed and "'64'" not in printed


def test_a_sweep_folder_recorded_with_hydra_forms_resumes(tmp_path, attngym_cli):
    """metrics.json and grid.json written before records held typed overrides (Hydra's forms,
    `++attention.window_size=16`): the same command resumes the sweep, every job skipped."""
    from attngym.runner.overrides import prepare_overrides

    sweep = tmp_path / "sweep"
    typed = ["shape.seq_len=64", "attention=sliding_window", "attention.window_size=16,32"]
    args = ["-m", *TINY, *typed, f"hydra.sweep.dir={sweep}"]
    first = attngym_cli(args, tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    for job in ("0", "1"):
        path = sweep / job / "metrics.json"
        metrics = json.loads(path.read_text())
        received = yaml.safe_load((sweep / job / ".hydra" / "overrides.yaml").read_text())
        assert any(o.startswith("++attention.") for o in received)  # what Hydra got
        path.write_text(json.dumps({**metrics, "overrides": received}))
    grid = sorted(prepare_overrides([*TINY, *typed]))
    (sweep / "grid.json").write_text(json.dumps({"overrides": grid}))
    again = attngym_cli(args, tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    log = again.stdout + again.stderr
    assert log.count("already ok") == 2 and "another grid" not in log
    for job in ("0", "1"):
        assert (sweep / job / "attngym.log").read_text().count("validated") == 1


def test_summary_columns_follow_the_metric_names(tmp_path):
    from attngym.metrics import table_columns
    from attngym.runner.tracking.sweep import md_columns, write_markdown

    columns = md_columns()
    assert columns == ("job", "overrides", *table_columns()) and columns[-1] == "error"
    rows = [
        {"job": "0", "status": "failed", "validation": "failed: x", "flex_over_best_sdpa_fwd": 1.5},
        {"job": "1", "status": "ok", "validation": "ok", "sdpa_fwd_ms": 2.0},
    ]
    write_markdown(rows, tmp_path / "s.md", "t")
    header = (tmp_path / "s.md").read_text().splitlines()[4]
    assert [c.strip() for c in header.strip("|").split("|")] == [
        "job",
        "status",
        "validation",
        "flex_over_best_sdpa_fwd",
    ]


def test_summary_plot_leaves_pyplot_alone(tmp_path):
    code = (
        "import sys, matplotlib; from attngym.runner.tracking.sweep import write_plot; "
        f"ok = write_plot([{{'status': 'ok', 'variant': 'causal', 'seq_len': 64, 'fwd_ms': 1.0}}], "
        f"__import__('pathlib').Path({str(tmp_path / 'p.png')!r}), 't'); "
        "print(ok, 'matplotlib.pyplot' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "False"]
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_table_layout_names_shared_settings_once():
    from attngym.runner.tracking.sweep import table_layout

    rows = [
        {"job": 0, "status": "ok", "variant": "causal", "device": "cpu", "seq_len": 512, "x": None},
        {
            "job": 1,
            "status": "ok",
            "variant": "causal",
            "device": "cpu",
            "seq_len": 1024,
            "x": None,
        },
    ]
    columns, shared = table_layout(rows, ["job", "status", "variant", "device", "seq_len", "x"])
    assert columns == ["job", "status", "variant", "seq_len"]  # kept, or varying; x never set
    assert shared == {"device": "cpu"}
    one, none_shared = table_layout(rows[:1], ["job", "device", "x"])
    assert (one, none_shared) == (["job", "device"], {})  # one row: nothing to factor out


@pytest.mark.parametrize(
    ("column", "value", "text"),
    [
        ("peak_mem_bytes", 490237952, "468 MiB"),
        ("peak_mem_bytes", 3 * 2**30, "3 GiB"),
        ("bytes_moved", 512, "512 B"),
        ("fwd_ms", 0.0008481, "8.48e-04"),
        ("fwd_ms", 12.3456, "12.3"),
        ("fwd_ms", 1234.5, "1234"),
        ("fwd_tflops", 412.349, "412.3"),
        ("fwd_tflops", 0.02976, "0.0298"),
        ("seq_len", 4096, "4096"),
        ("variant", "causal", "causal"),
        ("error", None, ""),
    ],
)
def test_format_value_uses_units_a_person_reads(column, value, text):
    from attngym.runner.tracking.sweep import format_value

    assert format_value(column, value) == text


def test_summary_text_keeps_the_columns_that_vary():
    from attngym.runner.tracking.sweep import summary_text

    rows = [
        {"job": str(i), "status": "ok", "variant": v, "device": "cpu", "fwd_ms": ms}
        for i, (v, ms) in enumerate([("causal", 1.23456), ("full", 2.5)])
    ]
    text = summary_text(rows)
    assert "Every job: device=cpu" in text
    header, rule, first, second = text.splitlines()[-4:]
    assert [c.strip() for c in header.strip("|").split("|")] == [
        "job",
        "status",
        "variant",
        "fwd_ms",
    ]
    assert first.endswith("|   1.23 |") and second.endswith("|   2.50 |")  # right-aligned
    assert rule.endswith("-:|")


def test_one_length_sweep_draws_bars_and_many_lengths_draw_lines(tmp_path):
    from attngym.runner.tracking.sweep import series_name, write_plot

    rows = [
        {
            "status": "ok",
            "variant": f"v{i}",
            "overrides": f"attention=v{i} shape.seq_len={s}",
            "seq_len": s,
            "fwd_ms": 1.0 + i + s / 1000,
        }
        for i in range(20)
        for s in (256, 512)
    ]
    assert series_name(rows[0]) == "v0"
    assert write_plot([r for r in rows if r["seq_len"] == 256], tmp_path / "bars.png", "t")
    assert write_plot(rows, tmp_path / "lines.png", "t")
    import matplotlib.image

    bars = matplotlib.image.imread(str(tmp_path / "bars.png"))
    lines = matplotlib.image.imread(str(tmp_path / "lines.png"))
    assert bars.shape[0] > lines.shape[0]  # 20 bars stack taller than the line plot


def test_a_failed_sweep_prints_the_command_that_resumes_it(tmp_path, attngym_cli):
    import shlex

    args = ["-m", "attention=sliding_window", "attention.window_size=8,-1"]
    args += ["shape.seq_len=64", "logger=none", "benchmark.repeats=1", "validate_rows=16"]
    first = attngym_cli(args, tmp_path)
    assert first.returncode == 1
    line = next(x for x in first.stderr.splitlines() if "resume with" in x)
    command = line.split(": ", 2)[2]
    words = shlex.split(command)
    assert words[:3] == ["python", "-m", "attngym"] and words[3:-1] == args
    assert words[-1].startswith("hydra.sweep.dir=multirun/")
    again = attngym_cli(words[3:], tmp_path)  # the command as printed, pasted
    assert again.returncode == 1
    assert "already ok in" in again.stderr + again.stdout  # window_size=8 is not run again


def test_a_failed_jobs_empty_cells_make_no_column_vary():
    from attngym.runner.tracking.sweep import table_layout

    rows = [
        {"job": "0", "status": "ok", "variant": "causal", "device": "cpu", "seq_len": 512},
        {"job": "1", "status": "ok", "variant": "causal", "device": "cpu", "seq_len": 512},
        {"job": "2", "status": "failed", "error": "boom"},
    ]
    columns, shared = table_layout(rows, ["job", "status", "variant", "device", "seq_len"])
    assert columns == ["job", "status", "variant"] and shared == {"device": "cpu", "seq_len": 512}


def test_the_printed_summary_fits_a_terminal_and_summary_md_keeps_every_error():
    from attngym.runner.tracking.sweep import PRINT_WIDTH, summary_text

    many = {f"flex_over_sdpa_{p}": 1.0 + i for i, p in enumerate(("fwd", "fwd_bwd", "bwd"))}
    rows = [
        {
            "job": str(i),
            "overrides": f"shape.seq_len={512 * (i + 1)}",
            "status": "ok",
            "variant": "causal",
            "seq_len": 512 * (i + 1),
            "fwd_ms": 1.5 * i,
            "fwd_ms_min": 1.0 * i,
            "fwd_ms_max": 2.0 * i,
            "wall_s": 3.0 * i,
            "peak_mem_bytes": 2**20 * i,
            "err_out_rel": 1e-7 * i,
            **{k: v * i for k, v in many.items()},
        }
        for i in range(1, 4)
    ] + [{"job": "4", "overrides": "shape.seq_len=9999", "status": "failed", "error": "x" * 200}]
    printed = summary_text(rows, printed=True)
    assert max(len(line) for line in printed.splitlines()) <= PRINT_WIDTH
    assert "more columns, the errors whole: summary.md, summary.csv" in printed
    md = summary_text(rows)
    assert "- job 4: " + "x" * 200 in md  # the whole error, under the table
    assert "4 jobs, 1 failed." in md


def test_a_failed_sweeps_printed_table_keeps_what_it_measured(tmp_path, attngym_cli):
    """One job ok, one failed: every column of the ok job has its one value, and the settings
    (topology, ranks, transport, device, ...) give way before fwd_ms does."""
    (tmp_path / "mymasks.py").write_text(
        "def strided(stride):\n"
        "    def mask_mod(b, h, q_idx, kv_idx):\n"
        "        return (q_idx >= kv_idx) & ((q_idx - kv_idx) % stride == 0)\n"
        "    return mask_mod\n"
    )
    args = ["-m", "attention=custom", "attention.mask_mod=mymasks.strided", "logger=none",
            "attention.mask_args.stride=2,abc", "shape.seq_len=128", "benchmark.repeats=1",
            f"hydra.sweep.dir={tmp_path / 'sweep'}"]  # fmt: skip
    done = attngym_cli(args, tmp_path)
    assert done.returncode == 1
    header = next(ln for ln in done.stdout.splitlines() if ln.startswith("| job"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    assert columns[:4] == ["job", "overrides", "status", "variant"]
    assert "fwd_ms" in columns and "topology" not in columns and "transport" not in columns


def test_an_interrupted_job_is_counted_apart():
    from attngym.runner.tracking.sweep import outcome_count

    rows = [{"status": "ok"}, {"status": "failed"}, {"status": "interrupted"}]
    assert outcome_count(rows) == "3 jobs, 1 failed, 1 interrupted"
