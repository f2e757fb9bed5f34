"""A folder belongs to one run, and writes stay inside it: symlinks, odd metrics.json, stale
temporaries, two writers (lock), two sweeps with different grids."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from attngym.errors import ConfigError
from attngym.fileio import SymlinkRefused, atomic_write, tmp_name
from attngym.runner.tracking import files, sweep
from attngym.runner.tracking.lock import LOCK_FILE, FolderLock, FolderLocked

from .procs import wait_gone

pytestmark = pytest.mark.faults

TINY = [
    "device=cpu",
    "shape.heads=2",
    "shape.head_dim=16",
    "shape.seq_len=64",
    "benchmark.warmup=0",
    "benchmark.repeats=1",
    "validate_rows=16",
    "baselines=[]",
    "block_size=64",
    "logger=none",
]


def _record(run_dir):
    return files.RunRecord(
        run_dir=run_dir,
        metrics={"status": "ok", "fwd_ms": 1.5},
        config={},
        images={},
        name="r",
        group="g",
        job_type="single",
    )


@pytest.mark.parametrize(
    "write",
    [
        pytest.param(lambda d: files.write_metrics(d, {"status": "ok"}), id="metrics.json"),
        pytest.param(lambda d: files.LocalTracker().log_run(_record(d)), id="results.md"),
        pytest.param(
            lambda d: sweep.write_csv([{"job": "0"}], d / "summary.csv"), id="summary.csv"
        ),
        pytest.param(
            lambda d: sweep.write_markdown([{"job": "0"}], d / "summary.md", "t"), id="summary.md"
        ),
        pytest.param(
            lambda d: sweep.write_plot(
                [{"status": "ok", "seq_len": 64, "fwd_ms": 1.0, "variant": "causal"}],
                d / "summary.png",
                "t",
            ),
            id="summary.png",
        ),
    ],
)
def test_writers_refuse_a_planted_symlink_and_leave_its_target_alone(tmp_path, write):
    outside = tmp_path / "outside.txt"
    outside.write_text("precious\n")
    run = tmp_path / "run"
    run.mkdir()
    names = {"metrics.json", "results.md", "summary.csv", "summary.md", "summary.png"}
    for name in names:
        (run / name).symlink_to(outside)
    with pytest.raises(SymlinkRefused, match=r"refusing to write .*run/\S+: .* is a symlink"):
        write(run)
    assert outside.read_text() == "precious\n"
    assert [p.name for p in run.iterdir() if not p.is_symlink()] == []  # no temporary left


def test_writes_into_a_symlinked_folder_are_refused_and_a_plain_folder_works(tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (tmp_path / "job").symlink_to(outside)
    with pytest.raises(SymlinkRefused, match="job is a symlink"):
        files.write_metrics(tmp_path / "job", {"status": "ok"})
    assert list(outside.iterdir()) == []
    files.write_metrics(tmp_path / "plain", {"status": "ok", "x": 1.0})
    assert files.read_metrics(tmp_path / "plain") == {"status": "ok", "x": 1.0}


@pytest.mark.parametrize("content", ["[1, 2]", '"ok"', "null", "{not json", ""])
def test_odd_metrics_json_counts_as_incomplete_with_a_warning(tmp_path, caplog, content):
    (tmp_path / "0" / ".hydra").mkdir(parents=True)
    (tmp_path / "0" / "metrics.json").write_text(content)
    assert files.read_metrics(tmp_path / "0") is None
    assert "counts as incomplete" in caplog.text
    (row,) = sweep.collect(tmp_path)
    assert row["status"] == "failed"


def test_a_missing_metrics_json_is_incomplete_without_a_warning(tmp_path, caplog):
    assert files.read_metrics(tmp_path) is None
    assert caplog.text == ""


def test_stale_temporaries_of_dead_writers_are_removed_live_ones_kept(tmp_path):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        text=True,
        capture_output=True,
        check=True,
    )
    dead_pid = int(dead.stdout)
    assert wait_gone([dead_pid]) == []
    stale = tmp_name(tmp_path / "metrics.json", dead_pid)
    live = tmp_name(tmp_path / "metrics.json", os.getppid())  # pytest's parent: alive
    stale.write_text("{")
    live.write_text("{")
    files.write_metrics(tmp_path, {"status": "ok"})
    assert not stale.exists() and live.exists()


def test_a_failed_write_leaves_no_temporary_and_the_old_file(tmp_path, monkeypatch):
    files.write_metrics(tmp_path, {"status": "ok", "run": 1})

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left"):
        atomic_write(tmp_path / "metrics.json", "{}")
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.json"]
    assert files.read_metrics(tmp_path) == {"status": "ok", "run": 1}


HOLD = textwrap.dedent(
    """
    import sys, time
    from attngym.runner.tracking.lock import FolderLock
    lock = FolderLock(sys.argv[1]).acquire()
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
    if sys.argv[3] == "release":
        lock.release()
    """
)


def test_a_holder_that_has_not_written_its_name_yet_is_called_starting():
    message = str(FolderLocked(Path("outputs/x"), {}))
    assert message.startswith("outputs/x is in use by another run that is just starting;")


def test_a_second_writer_is_refused_naming_the_holder_and_a_dead_holder_is_taken_over(
    tmp_path, caplog, no_new_children
):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path), "60", "keep"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(FolderLocked, match=rf"in use by pid {holder.pid} on \S+ \(since "):
            FolderLock(tmp_path).acquire()
    finally:
        holder.kill()  # dies holding the lock: the file still names it
        holder.wait()
        holder.stdout.close()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == holder.pid
    with FolderLock(tmp_path):
        assert f"taking over the stale lock of pid {holder.pid}" in caplog.text
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert (tmp_path / LOCK_FILE).read_text() == ""  # released: nobody named
    caplog.clear()
    with FolderLock(tmp_path):  # a cleanly released lock is taken without a warning
        pass
    assert "stale" not in caplog.text


@pytest.mark.parametrize("code", [errno.ENOLCK, errno.EOPNOTSUPP])
def test_a_file_system_without_flock_runs_unlocked_with_a_warning(
    tmp_path, monkeypatch, caplog, code
):
    """Lustre without -o flock, NFS without its lock service: flock is refused. No such file
    system mounts here, so flock is made to fail as theirs does."""

    def refused(fd, op):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr("attngym.runner.tracking.lock.fcntl.flock", refused)
    with FolderLock(tmp_path) as lock:
        assert json.loads(lock.path.read_text())["pid"] == os.getpid()
    assert "does not lock files" in caplog.text and "-o flock" in caplog.text


def test_other_flock_errors_are_not_taken_for_a_missing_flock(tmp_path, monkeypatch):
    def broken(fd, op):
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr("attngym.runner.tracking.lock.fcntl.flock", broken)
    with pytest.raises(OSError, match="I/O error"):
        FolderLock(tmp_path).acquire()


def test_the_lock_file_is_not_followed_through_a_symlink(tmp_path):
    outside = tmp_path / "outside"
    outside.write_text("precious\n")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / LOCK_FILE).symlink_to(outside)
    with pytest.raises(SymlinkRefused):
        FolderLock(tmp_path / "run").acquire()
    assert outside.read_text() == "precious\n"


def test_record_grid_accepts_the_same_grid_and_refuses_another(tmp_path):
    sweep.record_grid(tmp_path, ["shape.seq_len=64,128", "attention=causal"])
    sweep.record_grid(tmp_path, ["attention=causal", "shape.seq_len=64,128"])  # a resume
    with pytest.raises(ConfigError, match=r"^hydra.sweep.dir: .* holds a sweep of another grid"):
        sweep.record_grid(tmp_path, ["attention=full"])


def test_two_sweeps_with_different_grids_into_one_folder(tmp_path, attngym_cli):
    folder = tmp_path / "sweep"
    first = attngym_cli(["-m", *TINY, "attention=causal", f"hydra.sweep.dir={folder}"], tmp_path)
    assert first.returncode == 0, first.stderr
    kept = (folder / "0" / "metrics.json").read_text()
    second = attngym_cli(["-m", *TINY, "attention=full", f"hydra.sweep.dir={folder}"], tmp_path)
    assert second.returncode == 2
    (line,) = [ln for ln in second.stderr.splitlines() if ln.startswith("attngym: error:")]
    assert line.startswith(f"attngym: error: hydra.sweep.dir: {folder} holds a sweep of another")
    assert "it had attention=causal, this one has attention=full" in line
    assert (folder / "0" / "metrics.json").read_text() == kept  # the first sweep's results stay
    assert not (folder / "1").exists()


def test_a_holder_that_exits_without_releasing_leaves_no_stale_name(tmp_path):
    """A clean exit (a Ctrl-C's SystemExit included) empties the lock file: the next writer
    takes it without calling the holder dead."""
    code = (
        "import sys; from attngym.runner.tracking.lock import FolderLock; "
        f"FolderLock({str(tmp_path)!r}).acquire(); sys.exit(130)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert proc.returncode == 130
    assert (tmp_path / LOCK_FILE).read_text() == ""
