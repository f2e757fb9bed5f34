"""A result never lies and a report leaks nothing, under what an adversarial user does: user code
that exits, odd files planted in run and sweep folders, a full disk between jobs, text that
would drive a terminal or a spreadsheet, a "factory" that is not one."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

from attngym.errors import ConfigError
from attngym.runner import job
from attngym.runner.tracking import files, sweep
from attngym.runner.tracking.lock import LOCK_FILE

from .test_folders import TINY

pytestmark = pytest.mark.faults

# A user's module: a mask_mod factory whose mask leaves the process the way `how` says, on the
# full-size grids of the run (the reference, the pictures), past attngym's small probe grid.
HOSTILE = textwrap.dedent(
    """
    import sys

    def exits(how):
        def mask_mod(b, h, q_idx, kv_idx):
            if kv_idx.numel() >= 64:
                if how == "exit0":
                    sys.exit(0)
                if how == "exit3":
                    raise SystemExit(3)
                if how == "interrupt":
                    raise KeyboardInterrupt
                if how == "generator":
                    raise GeneratorExit
            return q_idx >= kv_idx
        return mask_mod
    """
)
CUSTOM = ["attention=custom", "attention.mask_mod=hostile.exits"]


@pytest.fixture
def user_dir(tmp_path):
    (tmp_path / "hostile.py").write_text(HOSTILE)
    return tmp_path


def _error_lines(stderr):
    return [ln for ln in stderr.splitlines() if ln.startswith("attngym: error:")]


def _rows(folder):
    return {row["job"]: row for row in sweep.collect(folder)}


# 1. User code that ends the process ends only its job.


def test_user_code_that_exits_fails_its_job_and_the_sweep_goes_on(user_dir, attngym_cli):
    folder = user_dir / "sweep"
    how = "attention.mask_args.how=none,exit0,interrupt,exit3"
    proc = attngym_cli(["-m", *TINY, *CUSTOM, how, f"hydra.sweep.dir={folder}"], user_dir)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr.split("sweep:")[-1]
    rows = _rows(folder)
    assert [rows[str(i)]["status"] for i in range(4)] == ["ok", "failed", "failed", "failed"]
    where = "attention.mask_mod: hostile.exits raised {} at hostile.py:"  # key, file and line
    for i, raised in (1, "SystemExit"), (2, "KeyboardInterrupt"), (3, "SystemExit"):
        assert rows[str(i)]["error"].startswith(where.format(raised)), rows
    assert ": 0 (the run's code called sys.exit, or argparse at import" in rows["1"]["error"]
    assert "only a real Ctrl-C or SIGTERM stops a run" in rows["2"]["error"]
    assert ": 3 (the run's code called sys.exit" in rows["3"]["error"]
    assert "4 jobs, 3 failed." in (folder / "summary.md").read_text()
    assert "3 of 4 sweep jobs failed" in proc.stderr and "hydra.sweep.dir=" in proc.stderr


def test_a_single_run_whose_code_raises_generator_exit_fails_with_one_line(user_dir, attngym_cli):
    run = user_dir / "run"
    proc = attngym_cli(
        [*TINY, *CUSTOM, "attention.mask_args.how=generator", f"hydra.run.dir={run}"], user_dir
    )
    assert proc.returncode == 1, proc.stderr
    (line,) = _error_lines(proc.stderr)
    where = "attngym: error: attention.mask_mod: hostile.exits raised GeneratorExit at hostile.py:"
    assert line.startswith(where)
    assert json.loads((run / "metrics.json").read_text())["status"] == "failed"


def test_argparse_at_import_of_the_users_module_is_a_config_error(tmp_path, attngym_cli):
    (tmp_path / "argy.py").write_text(
        "import argparse\nargparse.ArgumentParser().parse_args()\n"
        "def mask(b, h, q_idx, kv_idx):\n    return q_idx >= kv_idx\n"
    )
    proc = attngym_cli([*TINY, "attention=custom", "attention.mask_mod=argy.mask"], tmp_path)
    assert proc.returncode == 2, proc.stderr
    (line,) = _error_lines(proc.stderr)
    assert "importing argy failed: SystemExit: 2" in line


# 2. A sweep whose summary cannot be made, or whose jobs are nested, still tells.

FAILING_SUMMARY = textwrap.dedent(
    """
    import sys
    from attngym.runner import cli
    from attngym.runner.tracking import sweep

    def broken(sweep_dir):
        raise RuntimeError("summary exploded")

    sweep.summarize = broken
    cli.entry(sys.argv[1:])
    """
)


def test_a_summary_callback_error_ends_the_sweep_with_one_line_and_exit_1(tmp_path, attngym_cli):
    folder = tmp_path / "sweep"
    proc = attngym_cli(
        ["-m", *TINY, f"hydra.sweep.dir={folder}"], tmp_path, command=("-c", FAILING_SUMMARY)
    )
    assert proc.returncode == 1, proc.stderr
    (line,) = _error_lines(proc.stderr)
    assert line == (
        "attngym: error: the sweep's on_multirun_end failed: RuntimeError: summary exploded"
    )
    assert "attngym: resume with: " in proc.stderr and str(folder) in proc.stderr
    assert not (folder / LOCK_FILE).read_text()  # released


def test_jobs_in_nested_sub_folders_are_summarised_and_a_failure_tells(user_dir, attngym_cli):
    folder = user_dir / "sweep"
    args = [*TINY, *CUSTOM, "attention.mask_args.how=none,exit3"]
    nested = ["hydra.sweep.subdir=grp/${hydra.job.num}", f"hydra.sweep.dir={folder}"]
    proc = attngym_cli(["-m", *args, *nested], user_dir)
    assert proc.returncode == 1, proc.stderr
    rows = _rows(folder)
    assert rows["grp/0"]["status"] == "ok" and rows["grp/1"]["status"] == "failed"
    assert "2 jobs, 1 failed." in (folder / "summary.md").read_text()


@pytest.mark.parametrize(
    "content, why",
    [
        pytest.param("[" * 200_000 + "]" * 200_000, "nested too deep", id="deep"),
        pytest.param(
            '{"status": "ok", "seq_len": "abc"}', 'seq_len is "abc", not a number', id="type"
        ),
        pytest.param('{"status": "ok", "fwd_ms": Infinity}', "Infinity is not standard", id="inf"),
        pytest.param('{"status": 5}', "status is 5, not text", id="status"),
        pytest.param('{"status": "ok", "overrides": "x"}', "overrides is", id="overrides"),
    ],
)
def test_a_metrics_json_attngym_could_not_have_written_is_incomplete_naming_why(
    tmp_path, caplog, content, why
):
    job_dir = tmp_path / "0"
    (job_dir / ".hydra").mkdir(parents=True)
    (job_dir / "metrics.json").write_text(content)
    assert files.read_metrics(job_dir) is None
    assert f"{job_dir}/metrics.json" in caplog.text and why in caplog.text
    (row,) = sweep.collect(tmp_path)
    assert row["status"] == "failed" and why in row["error"]
    assert job.why_rerun(job_dir, []) == ""  # resumed: run again
    sweep.summarize(tmp_path)  # and the summary is written
    assert "1 jobs, 1 failed." in (tmp_path / "summary.md").read_text()


# 3. The sweep's lock and grid cannot be bypassed.


def test_a_symlinked_sweep_lock_stops_the_sweep_with_one_line(tmp_path, attngym_cli):
    folder = tmp_path / "sweep"
    folder.mkdir()
    outside = tmp_path / "outside"
    outside.write_text("precious\n")
    (folder / LOCK_FILE).symlink_to(outside)
    proc = attngym_cli(["-m", *TINY, f"hydra.sweep.dir={folder}"], tmp_path)
    assert proc.returncode == 1, proc.stderr
    (line,) = _error_lines(proc.stderr)
    assert f"{folder}/{LOCK_FILE}" in line and "is a symlink" in line
    assert outside.read_text() == "precious\n" and not (folder / "0").exists()


@pytest.mark.parametrize(
    "grid", ['{"overrides": 5}', '{"overrides": [1, 2]}', "[]", '"x"', "{"], ids=str
)
def test_a_grid_json_attngym_did_not_write_is_refused(tmp_path, grid):
    (tmp_path / sweep.GRID_FILE).write_text(grid)
    with pytest.raises(ConfigError, match=r"^hydra.sweep.dir: .*grid.json is not a grid attngym"):
        sweep.record_grid(tmp_path, ["attention=full"])


def test_an_odd_grid_json_does_not_let_another_grid_overwrite_results(tmp_path, attngym_cli):
    folder = tmp_path / "sweep"
    first = attngym_cli(["-m", *TINY, "attention=causal", f"hydra.sweep.dir={folder}"], tmp_path)
    assert first.returncode == 0, first.stderr
    kept = (folder / "0" / "metrics.json").read_text()
    (folder / sweep.GRID_FILE).write_text('{"overrides": 5}')
    second = attngym_cli(["-m", *TINY, "attention=full", f"hydra.sweep.dir={folder}"], tmp_path)
    assert second.returncode == 2
    (line,) = _error_lines(second.stderr)
    assert "grid.json is not a grid attngym wrote" in line
    assert (folder / "0" / "metrics.json").read_text() == kept


# 4. report.html and the summary read only regular files inside the folder, within limits.


def _planted_sweep(tmp_path):
    """A sweep folder whose files point out of it, block, or explode."""
    secret = tmp_path / "secret"
    secret.write_text("root:x:0:0:the secret line\n")
    folder = tmp_path / "sweep"
    for num in ("0", "1"):
        (folder / num / ".hydra").mkdir(parents=True)
        files.write_metrics(
            folder / num,
            {"status": "ok", "complete": True, "seq_len": 64, "fwd_ms": 1.0, "variant": "causal"},
        )
    (folder / "0" / ".hydra" / "overrides.yaml").write_text("- attention=causal\n")
    (folder / "0" / "heatmap.png").symlink_to(secret)
    os.mkfifo(folder / "0" / "block_mask.png")
    with open(folder / "1" / "heatmap.png", "wb") as f:
        f.truncate(1 << 30)  # sparse: a GiB that costs nothing on disk
    bomb = ["a: &a [x, x, x, x, x, x, x, x, x]"]
    bomb += [
        f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]"
        for p, c in zip("abcdefgh", "bcdefghi", strict=True)
    ]
    (folder / "1" / ".hydra" / "overrides.yaml").write_text("\n".join(bomb) + "\n")
    (folder / "summary.png").symlink_to(secret)
    return folder, secret


def test_report_skips_symlinks_fifos_huge_pictures_and_yaml_aliases(tmp_path):
    folder, secret = _planted_sweep(tmp_path)
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "attngym", "report", str(folder)],
        capture_output=True,
        text=True,
        timeout=120,  # a FIFO read or an alias bomb would hang or eat memory
    )
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - start < 60
    page = (folder / "report.html").read_text()
    leaked = base64.b64encode(secret.read_bytes()).decode()
    assert "secret line" not in page and leaked[:16] not in page
    for skipped in (
        "0/heatmap.png: it is a symlink",
        "0/block_mask.png: not a regular",
        "1/heatmap.png: 1073741824 bytes",
        "summary.png: it is a symlink",
        "aliases are not read",
    ):
        assert skipped in proc.stderr, proc.stderr
    assert os.path.islink(folder / "summary.png") and secret.read_text().startswith("root")


def test_the_sweep_summary_reads_the_planted_folder_safely(tmp_path):
    folder, _ = _planted_sweep(tmp_path)
    (folder / "summary.png").unlink()
    rows = sweep.summarize(folder)
    assert [row["overrides"] for row in rows] == ["attention=causal", ""]


def test_resume_does_not_take_a_symlinked_picture_for_a_drawn_one(tmp_path):
    overrides = ["shape.seq_len=64"]
    files.write_metrics(tmp_path, {"status": "ok", "complete": True, "overrides": overrides})
    elsewhere = tmp_path / "elsewhere.png"
    elsewhere.write_bytes(b"png")
    (tmp_path / "heatmap.png").symlink_to(elsewhere)
    (tmp_path / "block_mask.png").write_bytes(b"png")
    assert job.why_rerun(tmp_path, overrides) == "its heatmap.png is missing, empty or not a file"


# 5. Every file written for a run stays inside it.


def test_profile_run_does_not_write_through_planted_symlinks(tmp_path, attngym_cli):
    run = tmp_path / "run"
    run.mkdir()
    outside = tmp_path / "outside"
    outside.write_text("precious\n")
    for name in ("run_profile.txt", "run_profile.prof"):
        (run / name).symlink_to(outside)
    proc = attngym_cli([*TINY, "profile_run=true", f"hydra.run.dir={run}"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert outside.read_text() == "precious\n"
    assert "no run profile: could not write" in proc.stdout + proc.stderr


def test_a_symlinked_hydra_folder_fails_its_job_alone_and_is_not_written(tmp_path, attngym_cli):
    folder = tmp_path / "sweep"
    outside = tmp_path / "outside"
    outside.mkdir()
    (folder / "1").mkdir(parents=True)
    (folder / "1" / ".hydra").symlink_to(outside)
    proc = attngym_cli(["-m", *TINY, "shape.seq_len=64,128", f"hydra.sweep.dir={folder}"], tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    rows = _rows(folder)
    assert rows["0"]["status"] == "ok" and rows["1"]["status"] == "failed"
    assert "Hydra could not prepare the job's folder" in rows["1"]["error"]
    assert "is a symlink" in rows["1"]["error"]
    assert list(outside.iterdir()) == []


def test_a_single_run_into_a_folder_with_a_symlinked_hydra_is_refused(tmp_path, attngym_cli):
    run = tmp_path / "run"
    run.mkdir()
    (tmp_path / "outside").mkdir()
    (run / ".hydra").symlink_to(tmp_path / "outside")
    proc = attngym_cli([*TINY, f"hydra.run.dir={run}"], tmp_path)
    assert proc.returncode == 2
    (line,) = _error_lines(proc.stderr)
    assert line == f"attngym: error: hydra.run.dir: {run}/.hydra is a symlink; " + (
        "remove it (writes stay inside)"
    )
    assert list((tmp_path / "outside").iterdir()) == []


# 7. A full disk between jobs: each job fails alone, the sweep ends with one line and a resume.

FILL_AFTER_FIRST = textwrap.dedent(
    """
    import errno, os, sys
    from attngym.runner import cli, job
    import hydra.core.utils as hydra_utils

    disk, args = sys.argv[1], sys.argv[2:]
    real_finish = job._finish

    def fill_after(*a, **k):  # once the first job has every file written
        out = real_finish(*a, **k)
        if disk == "none":  # no tmpfs here: Hydra's writes of the next jobs fail as on one
            def full(cfg, filename, output_dir):
                path = str(output_dir / filename)
                raise OSError(errno.ENOSPC, "No space left on device", path)
            hydra_utils._save_config = full
            return out
        try:
            with open(os.path.join(disk, "filler"), "wb") as f:
                while True:
                    f.write(b"x" * 4096)
                    f.flush()
        except OSError:  # full
            return out

    job._finish = fill_after
    cli.entry(args)
    """
)


def test_a_full_disk_between_jobs_fails_them_alone_and_the_sweep_tells(
    tmp_path, attngym_cli, small_disk
):
    if small_disk is not None:  # room for the first job's files without its pictures
        subprocess.run(["mount", "-o", "remount,size=4m", str(small_disk)], check=True)
    base = small_disk if small_disk is not None else tmp_path
    folder = base / "sweep"
    args = ["-m", *TINY, "shape.seq_len=64,128,192", f"hydra.sweep.dir={folder}"]
    proc = attngym_cli(
        [str(small_disk or "none"), *args], tmp_path, command=("-c", FILL_AFTER_FIRST)
    )
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert re.search(
        r"job 1 failed: Hydra could not prepare the job's folder: could not "
        r"write .*No space left on device",
        proc.stderr + proc.stdout,
    )
    assert re.search(r"job 2 failed: Hydra could not prepare", proc.stderr + proc.stdout)
    assert "resume" in proc.stderr and f"hydra.sweep.dir={folder}" in proc.stderr
    assert json.loads((folder / "0" / "metrics.json").read_text())["fwd_ms"] > 0


# 8. One W&B offline run per job folder for `wandb sync <sweep>/*/wandb/offline-run-*`.


def test_a_rerun_sets_the_earlier_offline_wandb_run_aside(tmp_path, attngym_cli):
    run = tmp_path / "run"
    failing = textwrap.dedent(
        """
        import sys
        from attngym.runner import cli, job
        def broken(settings, run_dir, metrics):
            raise RuntimeError("the first attempt fails")
        job._run_task = broken
        cli.entry(sys.argv[1:])
        """
    )
    args = [*TINY, "logger=wandb", "logger.mode=offline", f"hydra.run.dir={run}"]
    first = attngym_cli(args, tmp_path, command=("-c", failing))
    assert first.returncode == 1
    assert len(list(run.glob("wandb/offline-run-*"))) == 1  # a failed run is logged too
    second = attngym_cli(args, tmp_path)
    assert second.returncode == 0, second.stderr
    assert len(list(run.glob("wandb/offline-run-*"))) == 1
    assert len(list(run.glob("wandb/earlier-attempts/offline-run-*"))) == 1


# 9. Text that reaches terminals, Markdown and spreadsheets.

HOSTILE_TEXT = '\x1b[2J\x1b[31mred|col\nnext =HYPERLINK("http://x")'


def test_control_characters_never_reach_the_terminal_or_break_a_table(tmp_path):
    from attngym.results import format_results

    metrics = {"status": "failed", "variant": HOSTILE_TEXT, "error": HOSTILE_TEXT, "seq_len": 64}
    printed = format_results(metrics, tmp_path)
    rows = [{"job": "0", "overrides": HOSTILE_TEXT, **metrics}, {"job": "1", "status": "ok"}]
    text = sweep.summary_text(rows)
    for out in (printed, text):
        assert "\x1b" not in out and "\\x1b[31m" in out
    table = [ln for ln in text.splitlines() if ln.startswith("| 0")]
    assert len(table) == 1 and "red\\|col" in table[0]  # one row, the | escaped


def test_results_md_keeps_one_row_per_metric(tmp_path):
    record = files.RunRecord(
        run_dir=tmp_path,
        metrics={"status": "ok", "variant": HOSTILE_TEXT},
        config={},
        images={},
        name=HOSTILE_TEXT,
        group="g",
        job_type="single",
    )
    files.LocalTracker().log_run(record)
    lines = (tmp_path / "results.md").read_text().splitlines()
    (variant,) = [ln for ln in lines if ln.startswith("| variant")]
    assert variant.count(" | ") == 1 and "\x1b" not in "".join(lines)


def test_summary_csv_quotes_what_a_spreadsheet_would_run(tmp_path):
    import csv

    rows = [
        {
            "job": "0",
            "error": '=HYPERLINK("http://x")',
            "label": "@SUM(A1)",
            "variant": "+cmd|' /C calc'!A0",
            "overrides": "+experiment=ring_attention shape.seq_len=512",
            "fwd_ms": -1.5,
        }
    ]
    sweep.write_csv(rows, tmp_path / "summary.csv")
    (row,) = csv.DictReader((tmp_path / "summary.csv").open())
    assert row["error"] == '\'=HYPERLINK("http://x")' and row["label"] == "'@SUM(A1)"
    assert row["variant"] == "'+cmd|' /C calc'!A0"
    assert row["overrides"] == rows[0]["overrides"]  # an override calls nothing: as typed
    assert row["fwd_ms"] == "-1.5"  # a number stays a number


# 10. A "factory" is checked before it is called.


def test_a_builtin_named_as_a_factory_is_refused_before_it_runs(tmp_path, attngym_cli):
    proc = attngym_cli(
        [
            *TINY,
            "attention=custom",
            "attention.mask_mod=os.system",
            "attention.mask_args.command='touch made_by_os_system'",
        ],
        tmp_path,
    )
    assert proc.returncode == 2
    (line,) = _error_lines(proc.stderr)
    assert "os.system is a built-in function, not a mask_mod" in line
    assert not (tmp_path / "made_by_os_system").exists()


def test_a_factory_annotated_to_return_no_callback_is_not_called(tmp_path, monkeypatch):
    from attngym.variants import custom

    (tmp_path / "annotated.py").write_text(
        "import pathlib\n"
        "def make(n: int) -> int:\n"
        "    pathlib.Path('called').touch()\n"
        "    return n\n"
    )
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="returns int .*not a mask_mod"):
        custom.callback("annotated.make", {"n": 1}, kind="mask_mod", key="attention.mask_mod")
    assert not (tmp_path / "called").exists()


# 11. Messages that name the right key.


@pytest.mark.parametrize(
    "shape, key",
    [
        ({"head_dim": 10**7}, "shape.head_dim"),
        ({"batch": 10**6}, "shape.batch"),
        ({"seq_len": 2**22}, "shape.seq_len"),
    ],
    ids=["head_dim", "batch", "seq_len"],
)
def test_a_memory_refusal_names_the_dimension_that_is_large(shape, key):
    from attngym.estimate import estimate

    dims = {"batch": 1, "heads": 4, "seq_len": 1024, "head_dim": 64, **shape}
    result = estimate(**dims, dtype="float32", device="cpu", available_bytes=8 << 30)
    assert result.key == key and result.problem.endswith(f"shrink {key}")


def test_a_file_as_the_run_folder_is_one_line(tmp_path, attngym_cli):
    (tmp_path / "taken").write_text("x")
    proc = attngym_cli([*TINY, "hydra.run.dir=taken"], tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    (line,) = _error_lines(proc.stderr)
    assert line == "attngym: error: hydra.run.dir: taken is a file, not a folder; " + (
        "name a folder for the output"
    )


def test_a_read_only_run_folder_is_one_line(tmp_path, attngym_cli):
    ro = tmp_path / "ro"
    ro.mkdir()
    if (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(ro)], capture_output=True
        ).returncode
        != 0
    ):
        ro.chmod(0o555)  # not root: a folder that is not ours to write
        if os.access(ro, os.W_OK):
            pytest.skip("neither a read-only mount nor a read-only folder can be made here")
    try:
        proc = attngym_cli([*TINY, f"hydra.run.dir={ro}/run"], tmp_path)
    finally:
        subprocess.run(["umount", "-l", str(ro)], capture_output=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    (line,) = _error_lines(proc.stderr)
    assert line == f"attngym: error: hydra.run.dir: cannot write in {ro} " + (
        "(read-only or not yours); choose another folder"
    )
