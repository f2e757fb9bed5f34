"""One Hydra job, start to end: the run layer's fixed order, so every topology gets the same.

    job facts (Hydra)  →  lock the run folder  →  resume decision (a sweep)  →  check + resolve
    (attngym.runner.config)  →  task from the registry (topology.kind)  →  verdict  →  metrics.json
    (complete: false)  →  heatmap.png, block_mask.png (attngym.runner.pictures)  →  tracker (logger
    group)  →  metrics.json (complete: true)  →  the results table and the exit code

metrics.json is written whatever happens (status ok, failed or interrupted, with the error),
because sweep summaries, reports and resumed sweeps read it; a resumed sweep re-runs a job whose
`complete` never became true. SIGINT and SIGTERM stop a run with what it measured so far (exit
130 / 143); a file that cannot be written (a full disk) fails it with one line (exit 1), the
results table still printed from memory. Tasks judge their own validation
(attngym.validation.validate_rows sets `validation` to "ok" or "failed: ..."); a failed verdict
makes the run's status failed with that error (exit code 1), so the timings of a wrong kernel are
still on record but never pass as a good run. A bad value stops a single run with one line
naming the key (exit code 2; HYDRA_FULL_ERROR=1 shows the traceback); inside a sweep it becomes a
failed row and the other jobs still run, and the sweep exits 1 at the end.

Under torchrun, or as the tasks of a SLURM step (attngym.distributed.ranks.launch.join_slurm_step),
rank 0 does all of the above; the other ranks run the same checks and task (the collectives need
every rank) and log to <run_dir>/rank<N>.log.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from attngym import timeline
from attngym.errors import (
    CODE_ERRORS,
    ConfigError,
    Interrupted,
    RankFailure,
    UserCodeError,
    failure_text,
)
from attngym.metrics import printable
from attngym.results import format_results
from attngym.runner import pictures
from attngym.runner.config import Settings
from attngym.runner.overrides import (
    CONF_DIR,
    as_typed,
    attngym_preset,
    raise_refused,
    refused,
    resume_command,
    run_name,
    task_overrides,
    to_plain,
)

if TYPE_CHECKING:
    from omegaconf import DictConfig

log = logging.getLogger(__name__)

# SIGINT (Ctrl-C) and SIGTERM (kill, a scheduler's stop) end a run alike: Interrupted.
INTERRUPTS = (signal.SIGINT, signal.SIGTERM)


def catch_interrupts() -> None:
    """Make SIGINT and SIGTERM raise errors.Interrupted (a job stops itself with what it measured:
    _stop_interrupted)."""
    for signum in INTERRUPTS:
        signal.signal(signum, _raise_interrupted)


def _raise_interrupted(signum: int, frame: Any) -> None:
    raise Interrupted(signum)


def ignore_interrupts() -> None:
    """Ignore further SIGINT/SIGTERM while a stopped run or sweep writes what it has."""
    for signum in INTERRUPTS:
        signal.signal(signum, signal.SIG_IGN)


@dataclasses.dataclass(frozen=True)
class Job:
    """What Hydra says about the running job, read once."""

    run_dir: Path
    rank: int  # under torchrun; 0 otherwise
    multirun: bool
    overrides: list[str]  # the job's task overrides, as typed (overrides.as_typed)
    num: int | None  # job number in a sweep
    name: str  # the run's name for trackers: its typed overrides, or "defaults"
    group: str  # the tracker group: the output folder's date_time
    sweep_dir: str  # hydra.sweep.dir in a sweep
    preset: str | None  # +experiment=NAME


def _job() -> Job:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    multirun = hc.mode == RunMode.MULTIRUN
    folder = run_dir.parent if multirun else run_dir
    # With what Hydra never received: a single run's override it would refuse (overrides.refused).
    overrides = [*(as_typed(o) for o in task_overrides(hc)), *(o for o, _ in refused)]
    naming = hc.job.config.override_dirname  # how Hydra names hydra.job.override_dirname
    return Job(
        run_dir=run_dir,
        rank=int(os.environ.get("RANK", "0")),
        multirun=multirun,
        overrides=overrides,
        num=hc.job.num if multirun else None,
        name=run_name(
            overrides,
            exclude_keys=naming.exclude_keys,
            item_sep=naming.item_sep,
            kv_sep=naming.kv_sep,
        ),
        group=f"{folder.parent.name}_{folder.name}",
        sweep_dir=str(hc.sweep.dir) if multirun else "",
        preset=hc.runtime.choices.get("experiment"),
    )


def why_rerun(run_dir: Path, overrides: list[str]) -> str | None:
    """Why a sweep job must run again: None when an earlier run of it finished ok with every file
    written (status ok, `complete: true`, heatmap.png and block_mask.png not empty) by the code
    there is now (attngym's version and the user's modules it recorded: `_code_record`), "" when
    it never wrote metrics.json, else what is wrong with what it left. `overrides` are as typed;
    the recorded ones are compared as typed too (a folder whose metrics.json holds Hydra's
    forms, `++attention.window_size=128`, resumes alike)."""
    from attngym import user_code
    from attngym.fileio import regular_size
    from attngym.runner.tracking import read_metrics

    previous = read_metrics(run_dir)
    if previous is None:
        return ""
    recorded = previous.get("overrides")
    if not isinstance(recorded, list) or [as_typed(str(o)) for o in recorded] != overrides:
        return "its metrics.json is of other overrides"
    if previous.get("status") != "ok":
        return f"it ended {previous.get('status')}: {previous.get('error')}"
    if previous.get("complete") is not True:
        return "it stopped after metrics.json, before its pictures and tracker"
    for name in pictures.PICTURES.values():
        if not regular_size(run_dir / name):  # a symlink is no picture of this run
            return f"its {name} is missing, empty or not a file"
    return user_code.changed(previous)


def run_job(cfg: DictConfig) -> dict[str, Any] | None:
    """One Hydra job: check, run the topology's task, judge, write files, draw, track, exit.

    The run folder's lock (attngym.runner.tracking.lock) is held throughout by the process that
    writes there (rank 0 under torchrun): a second run pointed at the same folder stops with one
    line naming the holder, exit code 1, before it reads or writes anything.
    """
    from attngym.distributed.ranks.launch import join_slurm_step

    join_slurm_step()  # a task of a SLURM step is a rank (a submitit job starts here)
    start = _job_start()
    job = _job()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun's or SLURM's ranks share a terminal
        _tag_console(job.rank)
    if job.rank != 0:  # under torchrun: rank 0 writes, draws, tracks and prints
        if job.multirun and why_rerun(job.run_dir, job.overrides) is None:  # as rank 0 does
            return None
        with _started(start):
            return _run_other_rank(cfg, job)
    return _run_job(cfg, job, start)


@contextlib.contextmanager
def _started(start: float | None) -> Iterator[None]:
    """The job's timeline (from `start`) and its kept block masks, the CPU's math settled first.
    Their start is slow (torch._dynamo's import, seconds): it comes after the run folder is
    locked, so a Ctrl-C meanwhile stops the run like any other, with its metrics.json."""
    from attngym import kernels
    from attngym.device import settle_cpu_math

    settle_cpu_math()  # before the job's first parallel CPU op (see its docstring)
    timeline.begin(start)
    try:
        with kernels.kept_block_masks():  # the job's block masks, built once, freed after it
            yield
    finally:
        timeline.end()


def _run_job(cfg: DictConfig, job: Job, start: float | None) -> dict[str, Any] | None:
    """run_job's body on rank 0: the run folder locked, the job started, run."""
    from attngym.runner.tracking.lock import FolderLock, FolderLocked

    lock = FolderLock(job.run_dir)
    try:
        lock.acquire()
    except FolderLocked as err:
        print(f"attngym: error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    except OSError as err:  # a symlink planted as the lock file, a folder that cannot be made
        return _unlockable(job, err)
    try:
        with _profiled(job.run_dir, bool(cfg.get("profile_run", False))):
            return _run_locked(cfg, job, start)
    finally:
        lock.release()


@contextlib.contextmanager
def _profiled(run_dir: Path, on: bool) -> Iterator[None]:
    """profile_run=true: cProfile over the job; run_profile.prof (pstats, snakeviz) and the
    functions by cumulative time in run_profile.txt."""
    if not on:
        yield
        return
    import cProfile
    import io
    import marshal
    import pstats

    from attngym.fileio import atomic_write, write_error

    profile = cProfile.Profile()
    profile.enable()
    try:
        yield
    finally:
        profile.disable()
        text = io.StringIO()
        stats = pstats.Stats(profile, stream=text)  # takes the profile's stats, leaving it none
        stats.sort_stats("cumulative").print_stats(60)
        try:  # as every file of the run: atomically, never through a symlink
            atomic_write(run_dir / "run_profile.prof", marshal.dumps(stats.stats))
            atomic_write(run_dir / "run_profile.txt", text.getvalue())
            log.info("run profile: %s", run_dir / "run_profile.txt")
        except OSError as err:
            log.warning("no run profile: %s", write_error(err))


_process_started = False


def _job_start() -> float | None:
    """Where a job's wall time starts: the process's start for the first job of a process (its
    imports and Hydra's composition count, as the user waits for them), now for later ones."""
    global _process_started
    if _process_started:
        return None
    _process_started = True
    return timeline.process_start()


def _run_locked(cfg: DictConfig, job: Job, start: float | None) -> dict[str, Any] | None:
    """run_job's body, run folder locked: the resume decision, then the job started and run."""
    if job.multirun:  # a resumed sweep: every rank decides alike from the same files
        why = why_rerun(job.run_dir, job.overrides)
        what = f"job {job.num} ({' '.join(job.overrides)})"
        if why is None:
            log.info("%s: already ok in %s, skipping", what, job.run_dir)
            return None
        if why:
            log.info("%s: running it again: %s", what, why)
    metrics: dict[str, Any] = {"status": "failed", "error": None}
    try:
        with _started(start):
            return _run_started(cfg, job, metrics)
    except Interrupted as stop:  # while the job started, before its timeline ran
        _stop_interrupted(job, metrics, stop)


def _run_started(cfg: DictConfig, job: Job, metrics: dict[str, Any]) -> dict[str, Any] | None:
    """The job, its timeline running: check, run, write, draw, track, finish."""
    try:
        settings, failure, tracker = _check_and_run(cfg, job, metrics)
        try:
            # metrics.json first (what was measured is safe), then `complete: true` once every
            # file of the run is written: a resumed sweep re-runs a job whose last write never came.
            _write_metrics(job, metrics, complete=False)
            if settings is not None:  # it ran; a failed run draws nothing more
                ok = metrics["status"] == "ok"
                if tracker is not None and hasattr(tracker, "begin"):  # W&B inits meanwhile
                    tracker.begin(_record(cfg, job, settings, metrics, {}))
                with timeline.phase("pictures"):
                    ran = metrics.get("topology")  # auto's pick, where auto chose
                    images = pictures.draw_pictures(
                        settings, job.run_dir, ran,
                        code=metrics.get("code_fingerprint"), metrics=metrics,
                    ) if ok else {}  # fmt: skip
                metrics.update(_run_time())  # the tracker's summary has them, less its own time
                if tracker is not None:  # None: building it was the failure
                    with timeline.phase("tracker"):
                        _track(cfg, job, settings, tracker, metrics, images)
            metrics.update(_run_time())
            _write_metrics(job, metrics, complete=True)
        except Interrupted:
            raise
        except CODE_ERRORS as err:  # a full disk, a symlink, the callbacks in the pictures
            failure = _failed(job, metrics, err)
    except Interrupted as stop:
        _stop_interrupted(job, metrics, stop)
    outcome = _finish(job, metrics, failure)
    if job.multirun and cfg.get("objective"):
        return objective_value(cfg.objective, metrics)
    return outcome


def objective_value(names: Any, metrics: dict[str, Any]) -> float | list[float] | None:
    """What a tuning job (`objective=`) returns to the Optuna sweeper: the named metrics of a job
    that ended ok and validated; None otherwise, which the sweeper records as a failed trial, so
    a configuration that is wrong or did not run never wins."""
    names = [names] if isinstance(names, str) else list(names)
    values = [metrics.get(name) for name in names]
    validated = str(metrics.get("validation", "")).startswith("ok")
    if metrics.get("status") != "ok" or not validated or any(v is None for v in values):
        return None
    return float(values[0]) if len(values) == 1 else [float(v) for v in values]


def _check_and_run(
    cfg: DictConfig, job: Job, metrics: dict[str, Any]
) -> tuple[Settings | None, BaseException | None, Any]:
    """Settings (None when the config is refused: every check that needs no tensors, the preset
    against this machine included, runs here before the task), the failure that stopped the
    run (None for a run that ran, whatever its verdict) and the run's tracker (None with no
    settings); metrics and status go into `metrics`."""
    from attngym.runner.presets import check_fits_machine

    settings = tracker = None
    try:
        with timeline.phase("config"):
            settings = _settings(cfg)
            preset = attngym_preset(job.preset)
            check_fits_machine(CONF_DIR, preset, settings.device, job.overrides)
        metrics.update(_code_record(settings))
        tracker = _tracker(settings)  # started now when it has work to do before the results
        metrics.update(_run_task(settings, job.run_dir, metrics))
    except Interrupted:
        raise
    except CODE_ERRORS as err:  # a sys.exit in the user's code too: this run fails, no more
        err = _blamed(settings, err)
        metrics["error"] = (
            str(err) if isinstance(err, ConfigError | UserCodeError) else failure_text(err)
        )
        if not isinstance(err, ConfigError):
            if isinstance(err, RankFailure):  # the failing rank's traceback is in its rank log
                log.error("run failed: %s", err)
            elif isinstance(err, UserCodeError):  # its traceback: HYDRA_FULL_ERROR=1
                log.error("run failed: %s", err)
                log.debug("the traceback of the user's code", exc_info=err.__cause__)
            else:
                log.exception("run failed")
            return settings, err, tracker
        if job.multirun:  # a single run prints the one line of _finish instead
            log.error("config error: %s", err)
        if tracker is not None and hasattr(tracker, "close"):
            tracker.close()  # refused: no tracker run (W&B's child stops now, not at exit)
        return None, err, None  # refused: no picture, no tracker run
    metrics.update(_verdict(metrics))
    return settings, None, tracker


def _code_record(settings: Settings) -> dict[str, Any]:
    """The code the job runs, for metrics.json and a resumed sweep (`why_rerun`): attngym's
    version and the source of every module named by an import path of the config (callbacks,
    scheme, balancers; attngym.user_code.record), and how each callback path is read (the
    callback itself or a factory called with which arguments), which the log says too."""
    from attngym import user_code
    from attngym.variants import custom

    reads = custom.readings(settings.attention, settings.device)
    for read in reads:
        log.info("%s", read.sentence())
    record = user_code.record(_user_paths(settings).values())
    return {**record, "callbacks_read": "; ".join(map(str, reads)) or None}


def _blamed(settings: Settings | None, err: BaseException) -> BaseException:
    """`err`, or where it was raised in the user's code the config names (a callback failing on
    the run's grids, past its probe), a UserCodeError naming that key, file and line
    (attngym.user_code.blame): one line instead of two tracebacks."""
    from attngym import user_code

    if settings is None or isinstance(err, ConfigError):
        return err
    blamed = user_code.blame(err, _user_paths(settings)) or _inside_flex(err, settings)
    if blamed is None:
        return err
    blamed.__cause__ = err
    return blamed


# Where flex and the block mask run a variant's callbacks: traced, and under torch.vmap, so an
# error of a callback there may have no frame in the user's file.
RUNS_CALLBACKS = ("torch/nn/attention/flex_attention.py", "torch/_functorch/")


def _inside_flex(err: BaseException, settings: Settings) -> UserCodeError | None:
    """Where no frame of `err` is the user's but flex or vmap ran the user's callbacks on the
    way, a UserCodeError naming their keys (one line, not two tracebacks of torch's)."""
    from attngym.variants import custom

    keys = [key for key, _, _, _ in custom.callbacks(settings.attention)]
    tb, via_flex = err.__traceback__, False
    while tb is not None:
        via_flex |= any(part in tb.tb_frame.f_code.co_filename for part in RUNS_CALLBACKS)
        tb = tb.tb_next
    if not (keys and via_flex and isinstance(err, Exception)):
        return None
    return UserCodeError(
        " or ".join(keys),
        f"raised {failure_text(err)} inside flex_attention, which runs it under torch.vmap",
    )


def _user_paths(settings: Settings) -> dict[str, str]:
    """{config key: import path} of the user's code the config names: callbacks (compose entries
    too), a custom topology's scheme, balancers (topology.layout, auto's options.layouts)."""
    from attngym.distributed.placement.layout import is_user_layout
    from attngym.variants import custom

    topo = settings.topology
    paths = {key: path for key, _, path, _ in custom.callbacks(settings.attention)}
    if topo.kind == "custom" and isinstance(topo.scheme, str):
        paths["topology.scheme"] = topo.scheme
    if is_user_layout(topo.layout):
        paths["topology.layout"] = topo.layout
    for i, layout in enumerate(topo.options.get("layouts") or ()):
        if is_user_layout(layout):
            paths[f"topology.options.layouts.{i}"] = layout
    return paths


def _full_error() -> bool:
    """HYDRA_FULL_ERROR=1: the user asked for whole tracebacks."""
    return os.environ.get("HYDRA_FULL_ERROR") == "1"


def _settings(cfg: DictConfig) -> Settings:
    """The job's checked Settings; first the error of an override Hydra never received
    (overrides.raise_refused), on every rank alike."""
    from attngym.runner.config import from_config

    raise_refused()
    return from_config(to_plain(cfg))


def _run_task(settings: Settings, run_dir: Path, metrics: dict[str, Any]) -> dict[str, Any]:
    """The topology's task, from the registry: its flat metrics, filled into `metrics` as they
    come (an interrupted run keeps what was measured)."""
    from attngym import compile_cache, registry

    metrics.update(compile_cache.use(settings.compile_cache, settings.compile_threads))
    return registry.get("task", settings.topology.kind)(settings, run_dir, metrics) or {}


def _run_time() -> dict[str, Any]:
    """wall_s, the phases' seconds and the compile counts so far (attngym.timeline)."""
    current = timeline.current()
    return {} if current is None else current.metrics()


def _verdict(metrics: dict[str, Any]) -> dict[str, Any]:
    """status and error of a run that ran: a failed validation fails it. The task returns every
    number; metrics.json keeps both the numbers and the verdict."""
    verdict = metrics.get("validation")
    if isinstance(verdict, str) and verdict.startswith("failed"):
        log.error("validation %s", verdict)
        return {"status": "failed", "error": f"validation {verdict}"}
    return {"status": "ok"}


def _write_metrics(job: Job, metrics: dict[str, Any], *, complete: bool) -> None:
    """metrics.json, written whatever happened (sweep summaries and resumed sweeps read it);
    `complete` says whether every other file of the run is written too."""
    from attngym.metrics import unknown_keys
    from attngym.runner.tracking import write_metrics

    metrics["overrides"] = job.overrides
    if not complete and (unknown := unknown_keys(metrics)):
        log.warning("metrics without a row in attngym.metrics.METRICS: %s", ", ".join(unknown))
    with timeline.phase("files"):
        write_metrics(job.run_dir, {**metrics, "complete": complete})


def _track(
    cfg: DictConfig,
    job: Job,
    settings: Settings,
    tracker: Any,
    metrics: dict[str, Any],
    images: dict[str, Path],
) -> None:
    """Hand the run to its tracker (the `logger` group)."""
    tracker.log_run(_record(cfg, job, settings, metrics, images))


def _record(
    cfg: DictConfig, job: Job, settings: Settings, metrics: dict[str, Any], images: dict[str, Path]
) -> Any:
    """The run as a tracker takes it (a copy of the metrics as they are now)."""
    from attngym.runner.tracking import RunRecord

    return RunRecord(
        run_dir=job.run_dir,
        metrics=dict(metrics),
        config=_tracked_config(cfg),
        images=images,
        name=job.name,
        group=job.group,
        job_type=settings.topology.kind,
    )


def _tracker(settings: Settings) -> Any:
    """The run's tracker (the `logger` group), started at once when it has a `start` (W&B starts
    its child process, which imports wandb while the run works)."""
    from attngym import registry

    params = dict(settings.logger)
    tracker = registry.build("tracker", params.pop("name"), **params)
    if hasattr(tracker, "start"):
        tracker.start()
    return tracker


def _tracked_config(cfg: DictConfig) -> dict[str, Any]:
    """The config a tracker records: resolved, or as written where a value cannot resolve."""
    from omegaconf import OmegaConf

    try:
        return to_plain(cfg)
    except ConfigError:
        data = OmegaConf.to_container(cfg, resolve=False)
        data.pop("hydra", None)  # type: ignore[union-attr]
        return data  # type: ignore[return-value]


def _finish(job: Job, metrics: dict[str, Any], failure: BaseException | None) -> dict[str, Any]:
    """The job's outcome as Hydra and the shell see it.

    In a sweep: a log line, and the metrics (the sweep goes on) unless the failure leaves
    torchrun ranks out of step. A single run: one line and exit code 2 for a ConfigError; else
    the results table, then the failure raised, or exit code 1 for a failed validation.
    """
    if job.multirun:
        # Its overrides are on Hydra's launch line just above ("#N : ..."): status and time.
        log.info("job %s %s: %s", job.num, metrics["status"], timeline.largest(metrics))
        if failure is not None and _stop_sweep_after(failure):
            from attngym.runner.tracking.sweep import summarize

            summarize(job.sweep_dir)  # the jobs so far; on_multirun_end will not run
            log.error(
                "stopping the sweep: after this failure the ranks may be out of step; resume "
                "with (jobs already ok are skipped): %s",
                resume_command(job.sweep_dir),
            )
            raise SystemExit(1)  # Hydra would go on to the next job after an Exception
        return metrics
    if isinstance(failure, ConfigError) and not _full_error():
        print(f"attngym: error: {failure}", file=sys.stderr, flush=True)
        raise SystemExit(2)
    print(format_results(metrics, job.run_dir), flush=True)
    if isinstance(failure, UserCodeError) and _full_error():
        raise failure  # the user's traceback, its cause
    if isinstance(failure, RankFailure | OSError | UserCodeError):  # one line says it all
        print(f"attngym: error: {_one_line(failure)}", file=sys.stderr, flush=True)
        raise SystemExit(1)
    if failure is not None and not isinstance(failure, Exception):  # a sys.exit of user code
        print(f"attngym: error: {printable(metrics['error'])}", file=sys.stderr, flush=True)
        raise SystemExit(1)
    if failure is not None:
        raise failure
    if metrics["status"] != "ok":  # a validation failure: the table above says which error
        raise SystemExit(1)
    return metrics


def _one_line(failure: BaseException) -> str:
    from attngym.fileio import write_error

    return write_error(failure) if isinstance(failure, OSError) else printable(str(failure))


def _failed(job: Job, metrics: dict[str, Any], err: BaseException) -> BaseException:
    """The run fails after its task: a write (`could not write <path>: ...`, a full disk, a
    symlink) or the run's code again (drawing the pictures runs the callbacks, its traceback
    logged). metrics.json says so if it can still be written; the metrics stay in memory for
    the results table."""
    from attngym.fileio import write_error

    if isinstance(err, OSError):
        metrics.update(status="failed", error=write_error(err))
        log.error("%s", metrics["error"])
    else:
        log.exception("run failed")
        metrics.update(status="failed", error=failure_text(err))
    with contextlib.suppress(OSError):
        _write_metrics(job, metrics, complete=False)
    return err


def _unlockable(job: Job, err: OSError) -> dict[str, Any]:
    """The run folder cannot be locked: a single run stops with one line (exit 1); in a sweep
    the job fails (_failed) and the sweep goes on."""
    if not job.multirun:
        print(f"attngym: error: {_one_line(err)}", file=sys.stderr, flush=True)
        raise SystemExit(1)
    metrics: dict[str, Any] = {}
    _failed(job, metrics, err)
    return metrics


def _stop_interrupted(job: Job, metrics: dict[str, Any], stop: Interrupted) -> NoReturn:
    """SIGINT/SIGTERM during a job: metrics.json with status `interrupted` and what was measured
    so far, in a sweep the summary of the jobs so far, one line, exit code 128 + signal.
    Further signals are ignored meanwhile, so that these writes are not cut short."""
    from attngym.runner.tracking.sweep import report_stopped

    ignore_interrupts()
    metrics.update(status="interrupted", error=str(stop))
    metrics.update(_run_time())
    try:
        _write_metrics(job, metrics, complete=False)
    except OSError as err:
        print(f"attngym: error: {_one_line(err)}", file=sys.stderr, flush=True)
    if job.multirun and not _submitit_job():  # a submitit job's sweep is its launcher's
        report_stopped(Path(job.sweep_dir), stop)
    print(f"attngym: {stop}; what was measured is in {job.run_dir}", file=sys.stderr, flush=True)
    raise SystemExit(stop.exit_code)


def _submitit_job() -> bool:
    """Whether this process is a job Hydra's submitit launcher started (submitit marks it so):
    one job with ranks of its own, its sweep run by the launcher's process elsewhere."""
    return "SUBMITIT_EXECUTOR" in os.environ


def _run_other_rank(cfg: DictConfig, job: Job) -> None:
    """A rank other than 0 under torchrun: the same checks and task (its collectives need every
    rank), logged to <run_dir>/rank<N>.log; no metrics.json, pictures, tracker or table, which
    are rank 0's. A failure is logged there and raised, so torchrun sees the rank fail; in a sweep
    a ConfigError alone lets the rank go on to the next job, since every rank raises it alike
    before any collective (see _stop_sweep_after). It leaves the run's attngym.log to rank 0."""
    _leave_run_log()
    handler = _rank_log(job.run_dir, job.rank)
    try:
        metrics = _run_task(_settings(cfg), job.run_dir, {})
        log.info("rank %d done: validation %s", job.rank, metrics.get("validation", "on rank 0"))
    except Interrupted:
        raise
    except CODE_ERRORS as err:
        log.exception("rank %d failed", job.rank)
        if not job.multirun and not isinstance(err, Exception):  # a sys.exit(0) is no success
            raise RuntimeError(failure_text(err)) from err
        if not job.multirun:
            raise
        if _stop_sweep_after(err):
            raise SystemExit(1) from err  # Hydra would go on to the next job after an Exception
    finally:
        logging.getLogger("attngym").removeHandler(handler)
        handler.close()


def _stop_sweep_after(err: BaseException) -> bool:
    """Whether a failed job must end a sweep whose jobs share their ranks (torchrun or a SLURM
    step running the sweep, WORLD_SIZE > 1). Under Hydra's submitit launcher every job has ranks
    of its own (SUBMITIT_EXECUTOR is set in its jobs), so a failure ends only its job.

    A ConfigError is raised alike on every rank before any collective, so the ranks stay in step
    and the sweep goes on. Any other failure may leave the ranks at different collectives of the
    job, which the next job's collectives would then pair with: the sweep stops (torchrun ends
    every rank, rank 0 first writing the summary of the jobs so far); the job's metrics.json or
    rank log records why, and running the same command again resumes, skipping the jobs already ok.
    """
    shared = int(os.environ.get("WORLD_SIZE", "1")) > 1 and not _submitit_job()
    return shared and not isinstance(err, ConfigError)


def _tag_console(rank: int) -> None:
    """Tag this rank's terminal lines `[rankN]`, as spawned ranks tag theirs
    (attngym.distributed.ranks.launch), so the ranks' lines in one terminal say whose they are."""
    from attngym.distributed.ranks.launch import rank_formatter

    for handler in logging.getLogger().handlers:
        if type(handler) is logging.StreamHandler:  # Hydra's console handler, not a file's
            handler.setFormatter(rank_formatter(rank))


def _rank_log(run_dir: Path, rank: int) -> logging.Handler:
    """A file handler on the `attngym` logger: this process's records go to rank<N>.log."""
    from attngym.distributed.ranks.launch import rank_formatter
    from attngym.fileio import log_file

    run_dir.mkdir(parents=True, exist_ok=True)
    handler = log_file(run_dir / f"rank{rank}.log")
    handler.setFormatter(rank_formatter(rank))
    pkg = logging.getLogger("attngym")
    pkg.addHandler(handler)
    if pkg.getEffectiveLevel() > logging.INFO:
        pkg.setLevel(logging.INFO)
    return handler


def _leave_run_log() -> None:
    """Stop this process writing the run's attngym.log: Hydra gives every torchrun rank its file
    handler, and ranks other than 0 would interleave their records with rank 0's there."""
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, logging.FileHandler)]:
        root.removeHandler(handler)
        handler.close()
