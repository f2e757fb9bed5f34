"""Weights & Biases tracker: one W&B run per attngym run, offline unless asked otherwise.

Offline by default because experiments often run where there is no network (compute nodes,
laptops on a train) and a tracker must never block or fail a run: offline runs are stored in the
run folder (`<run_dir>/wandb/offline-run-*`, one per run folder: earlier attempts of a re-run
job move to `wandb/earlier-attempts/`) and uploaded later with `wandb sync`.

Bounded for real: wandb runs in a child process, never in the caller. `wandb.init`, the logging,
`run.finish` and wandb's own shutdown (its service, telemetry and upload threads, which waited
30 s at exit against a server that accepts connections but never answers) all happen there. The
child has `init_timeout_s` (passed to wandb.init) + `finish_timeout_s` (run.finish, in a daemon
thread) + CHILD_START_S (interpreter, `import wandb`, wandb's service) to report; it then leaves
with os._exit, skipping wandb's exit hooks. Past that deadline the caller kills the child's whole
process group (the child leads one, so wandb's service goes too) and logs a warning: the run goes
on, the local copy in the run folder can be uploaded with `wandb sync`. A W&B failure is a warning
(metrics.json is already on disk: the caller writes it first). wandb is imported only in the child.

Mapping: config = the resolved config; summary = the scalar metrics (the names of metrics.json,
each a row of the table in attngym.metrics, which says its label, unit and meaning), the numeric
ones also as one history step (for report line plots); the PNGs as `wandb.Image`; group = the
sweep (or run) folder name; job_type = the topology; name = the overrides that make the run
different, as the user typed them (attngym.runner.overrides.run_name, joined as Hydra joins
hydra.job.override_dirname).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from attngym import registry
from attngym.errors import ConfigError, choice_error
from attngym.fileio import check_target
from attngym.runner.tracking.files import RunRecord, scalar_metrics

log = logging.getLogger(__name__)

MODES = ("offline", "online", "disabled")
# What the child may take beyond init_timeout_s + finish_timeout_s: start an interpreter, import
# wandb and start its service on a busy machine.
CHILD_START_S = 20.0


# Where the offline runs of a folder's earlier attempts go (set_aside_earlier_runs).
EARLIER_ATTEMPTS = "earlier-attempts"


def set_aside_earlier_runs(run_dir: str | os.PathLike) -> list[Path]:
    """Keep one offline W&B run per run folder where `wandb sync <sweep>/*/wandb/offline-run-*`
    (the README's upload) looks: the offline runs of earlier attempts of this run (killed,
    failed, run again by a resumed sweep) move to wandb/earlier-attempts/, out of that glob's
    reach and still there to sync by hand. Returns where they went.

    Raises:
        SymlinkRefused: the run folder's `wandb` is a symlink (W&B would write through it).
    """
    folder = check_target(Path(run_dir) / "wandb")
    moved = []
    for earlier in sorted(folder.glob("offline-run-*")):
        if earlier.is_dir() and not earlier.is_symlink():
            (folder / EARLIER_ATTEMPTS).mkdir(exist_ok=True)
            moved.append(earlier.rename(folder / EARLIER_ATTEMPTS / earlier.name))
    return moved


@registry.register("tracker", "wandb")
class WandbTracker:
    """Log a run to W&B (see the module docstring for what goes where).

    Registered as the tracker "wandb": its keyword arguments are the `logger.*` config keys.
    """

    def __init__(
        self,
        *,
        mode: str = "offline",
        project: str = "attngym",
        entity: str | None = None,
        tags: Sequence[str] = (),
        init_timeout_s: float = 5.0,
        finish_timeout_s: float = 5.0,
    ):
        if mode not in MODES:
            raise ConfigError("logger.mode", choice_error("wandb mode", mode, MODES))
        self.mode = mode
        self.project = project
        self.entity = entity
        self.tags = list(tags)
        self.init_timeout_s = float(init_timeout_s)
        self.finish_timeout_s = float(finish_timeout_s)
        self._child: subprocess.Popen | None = None
        self._begun = False  # the child has the run's first part (begin)
        self.seconds: dict[str, float] = {}  # in the child: where its time went

    def __getstate__(self) -> dict[str, Any]:  # the child gets the settings, not itself
        return {**self.__dict__, "_child": None, "_begun": False}

    def start(self) -> None:
        """Start the child while the run works: its interpreter and `import wandb` (seconds)
        are then done by the time log_run hands it the run. A child never handed a run exits
        when this process does (its stdin closes)."""
        if self._child is None:
            code = "from attngym.runner.tracking.wandb_logger import child_main; child_main()"
            self._child = subprocess.Popen(
                [sys.executable, "-c", code],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,  # its own process group: wandb's service dies with it
            )

    def begin(self, record: RunRecord) -> None:
        """Hand the child the run as the task left it (config, names, the task's metrics): it
        calls wandb.init while the caller draws the pictures, and log_run sends the rest. A
        child that cannot take it is reported by log_run."""
        set_aside_earlier_runs(record.run_dir)
        self.start()
        assert self._child is not None and self._child.stdin is not None
        with contextlib.suppress(OSError):  # a dead child: log_run reads why
            self._child.stdin.write(pickle.dumps((self, record)))
            self._child.stdin.flush()
            self._begun = True

    def close(self) -> None:
        """Stop a started child that will get no run (the run was refused)."""
        child, self._child = self._child, None
        if child is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.pid, signal.SIGKILL)
            child.communicate()

    def log_run(self, record: RunRecord) -> None:
        """One W&B run in a child process, bounded (see the module docstring); never raises."""
        deadline_s = self.init_timeout_s + self.finish_timeout_s + CHILD_START_S
        self.start()
        child, self._child = self._child, None
        assert child is not None
        # The child reads the run twice: as the task left it (begin, else now) and complete.
        if not self._begun:
            set_aside_earlier_runs(record.run_dir)
        payload = b"" if self._begun else pickle.dumps((self, record))
        self._begun = False
        try:
            out, err = child.communicate(payload + pickle.dumps(record), timeout=deadline_s)
        except subprocess.TimeoutExpired:
            log.warning(
                "wandb did not finish within %.0f s (init_timeout_s + finish_timeout_s + %.0f s "
                "to start; no network?): abandoned; metrics.json is unaffected, the local copy "
                "in %s can be uploaded with `wandb sync`",
                deadline_s,
                CHILD_START_S,
                record.run_dir,
            )
            return
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.pid, signal.SIGKILL)
            child.kill()
            child.communicate()
        try:
            report = json.loads(out.decode().strip().splitlines()[-1])
        except (ValueError, IndexError):
            tail = err.decode(errors="replace").strip().splitlines()[-3:]
            log.warning(
                "wandb logging failed (exit code %s: %s); metrics.json is unaffected",
                child.returncode,
                " / ".join(tail) or "no output",
            )
            return
        for message in report["warnings"]:
            log.warning("%s", message)
        if report.get("where") is not None:
            seconds = report.get("seconds", {})
            log.info(
                "wandb (%s): %s%s (import %.1f s while the task ran, init %.1f s beside the "
                "pictures, then %.1f s)",
                self.mode,
                report["where"],
                _read_offline(report["where"], report.get("leet", False))
                if self.mode == "offline"
                else "",
                seconds.get("import", 0.0),
                seconds.get("init", 0.0),
                seconds.get("log", 0.0),
            )

    def _log_here(self, record: RunRecord, complete: Callable[[], RunRecord]) -> str | None:
        """In the child: the W&B run, started from `record` (the run as the task left it) and
        finished from `complete()` (the run with its pictures and run time); where it went (run
        folder or URL); never raises."""
        try:
            return self._log(record, complete)
        except Exception as err:  # a tracker must not fail a run whose files are written
            log.warning(
                "wandb logging failed (%s: %s); metrics.json is unaffected", type(err).__name__, err
            )
            return None

    def _log(self, record: RunRecord, complete: Callable[[], RunRecord]) -> str:
        import wandb

        metrics = record.metrics
        tags = [
            *self.tags,
            str(metrics.get("variant")),
            str(metrics.get("device")),
            record.job_type,
        ]
        settings = wandb.Settings(
            init_timeout=self.init_timeout_s,
            silent=True,
            x_disable_stats=True,
            disable_git=True,
            x_save_requirements=False,
        )
        run = wandb.init(
            project=self.project,
            entity=self.entity,
            mode=self.mode,
            dir=str(record.run_dir),
            name=record.name,
            group=record.group,
            job_type=record.job_type,
            config=record.config,
            tags=[t for t in tags if t and t != "None"],
            reinit="finish_previous",
            settings=settings,
        )
        self.seconds["init"] = time.perf_counter() - self.seconds.pop("start", time.perf_counter())
        ok = False
        try:
            record = complete()
            started = time.perf_counter()
            metrics = record.metrics
            ok = metrics.get("status") == "ok"
            run.summary.update(scalar_metrics(metrics))
            images = {
                n: wandb.Image(str(p), caption=f"{record.name}: {n}")
                for n, p in record.images.items()
                if p.exists()
            }
            # the numbers go to the history too: a report's line plot of fwd_tflops against
            # seq_len, grouped by variant, reads them there (one step per run)
            numbers = {
                k: v
                for k, v in scalar_metrics(metrics).items()
                if isinstance(v, int | float) and not isinstance(v, bool)
            }
            run.log({**numbers, **images})
        finally:
            self._finish(run, exit_code=0 if ok else 1)
        self.seconds["log"] = time.perf_counter() - started
        # offline: the run's folder (offline-run-*: its .wandb log), not run.dir, its files/ of
        # images only
        return os.path.dirname(run.dir) if self.mode == "offline" else getattr(run, "url", "")

    def _finish(self, run: Any, exit_code: int) -> None:
        """run.finish in a daemon thread, bounded by finish_timeout_s (online it waits for the
        upload); past it the child reports and leaves, abandoning the thread."""
        done = threading.Event()

        def finish() -> None:
            try:
                run.finish(exit_code=exit_code)
            except Exception as err:
                log.warning("wandb finish failed (%s: %s)", type(err).__name__, err)
            finally:
                done.set()

        threading.Thread(target=finish, name="wandb-finish", daemon=True).start()
        if not done.wait(self.finish_timeout_s):
            log.warning(
                "wandb: finish did not return within %.0f s (no network?); abandoned; the local "
                "copy in %s can be uploaded with `wandb sync`",
                self.finish_timeout_s,
                getattr(run, "dir", "the run folder"),
            )


def _read_offline(run_folder: str, leet: bool) -> str:
    """Where an offline run's summary reads without a network: `wandb leet inspect --summary`
    where the installed wandb has it (0.31), else metrics.json beside it (the same values)."""
    if leet:
        return f"; its summary: wandb leet inspect --summary {run_folder}"
    return "; its summary: metrics.json in the run folder (the same values)"


class _Collect(logging.Handler):
    """Keeps the child's warnings, to be logged by the caller (whose log files they belong in)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def child_main() -> None:
    """The child process of WandbTracker.log_run: read (tracker, record) from stdin, log the W&B
    run, print {"where", "warnings"} as JSON on stdout, and leave without wandb's exit hooks."""
    collect = _Collect()
    log.addHandler(collect)
    log.propagate = False
    started = time.perf_counter()
    import wandb  # noqa: F401  (while the caller's run still works: WandbTracker.start)

    imported = time.perf_counter()
    stream = sys.stdin.buffer
    try:
        tracker, record = pickle.load(stream)
    except EOFError:  # the caller ended without a run to log
        os._exit(0)
    tracker.seconds = {"import": imported - started, "start": time.perf_counter()}
    where = tracker._log_here(record, lambda: pickle.load(stream))
    leet = importlib.util.find_spec("wandb.cli.leet") is not None  # wandb 0.31's offline reader
    report = {"where": where, "warnings": collect.messages, "seconds": tracker.seconds}
    report["leet"] = leet
    print(json.dumps(report), flush=True)
    os._exit(0)
