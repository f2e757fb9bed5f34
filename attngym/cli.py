"""The command line: `attngym [overrides]`, `python -m attngym`, `attngym report DIR`.

This is the only @hydra.main. It turns a composed config into a run in a fixed order, so every
topology gets the same treatment:

    lock the run folder  →  check + resolve (attngym.config)  →  task from the registry
    (topology.kind)  →  metrics.json (complete: false)  →  heatmap.png, block_mask.png  →
    tracker (logger group)  →  metrics.json (complete: true)  →  a short results table

metrics.json is written whatever happens (status ok, failed or interrupted, with the error),
because sweep summaries, reports and resumed sweeps read it; a resumed sweep re-runs a job whose
`complete` never became true. SIGINT and SIGTERM stop a run with what it measured so far (exit
130 / 143); a file that cannot be written (a full disk) fails it with one line (exit 1), the
results table still printed from memory. Tasks judge their own validation
(attngym.validation.validate_rows sets `validation` to "ok" or "failed: ...") and return all
their numbers; a failed verdict makes the run's status failed with that error (exit code 1), so
the timings of a wrong kernel are still on record but never pass as a good run.
A bad value stops a single run with one line naming the key (exit code 2; HYDRA_FULL_ERROR=1
shows the traceback); inside a sweep it becomes a failed row and the other jobs still run, and
the sweep exits 1 at the end.

Before Hydra composes anything, `entry` checks config-group options on the command line, so a typo
like `attention=sliding_windw` is one line with a suggestion instead of Hydra's multi-line error,
and quotes numeric option names (`block_size=64`) that Hydra would otherwise parse as integers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import signal
import sys
from importlib.resources import files
from pathlib import Path
from typing import Any, NoReturn

import hydra
from omegaconf import DictConfig, OmegaConf

from attngym.config import Settings
from attngym.errors import ConfigError, Interrupted, RankFailure, choice_error
from attngym.metrics import HEADLINE_BASELINES, format_value  # ratios worth a line; units

log = logging.getLogger(__name__)

# The repository's conf/, installed as this package (an editable install maps it to conf/ itself).
# Hydra composes from it and the option checks below list it: one place for both.
CONF_PACKAGE = "attngym.conf"
CONF_DIR = Path(str(files(CONF_PACKAGE)))  # a regular package, so a real folder on disk
PICTURES = {"heatmap": "heatmap.png", "block_mask": "block_mask.png"}
HEATMAP_WINDOW = 128  # tokens of heatmap.png's zoom
# Both pictures evaluate the mask over all S x S (query, key) pairs, tile by tile: ~8 s at S=64K
# on one CPU thread, growing with S^2. Above these many pairs on the device that draws (the
# heatmap always on the CPU) a picture is skipped with the reason, so a long run is not followed
# by minutes of drawing.
PICTURE_MAX_PAIRS = {"cpu": 2**34, "cuda": 2**40}  # S = 128K on a CPU, 1M on a GPU

# Shown at the end of a run, in this order, when present.
RESULT_ROWS = (
    ("variant", "variant"),
    ("device", "device"),
    ("dtype", "dtype"),
    ("seq_len", "seq_len"),
    ("sparsity", "block sparsity"),
    ("compile_s", "first call (s)"),
    ("fwd_ms", "fwd (ms)"),
    ("fwd_tflops", "fwd TFLOP/s"),
    ("bwd_ms", "bwd (ms)"),
    ("fwd_bwd_ms", "fwd+bwd (ms)"),
    ("fwd_bwd_tflops", "fwd+bwd TFLOP/s"),
    ("err_out_max_abs", "max |out - ref|"),
    ("err_lse_max_abs", "max |lse - ref|"),
    ("err_dq_rel", "rel err dq"),
    ("validation", "validation"),
    ("bwd_status", "bwd"),
)
# Context-parallel runs also show how the ranks did.
CP_ROWS = (
    ("topology", "topology"),
    ("world_size", "ranks"),
    ("transport", "transport"),
    ("layout", "layout"),
    ("single_fwd_ms", "one device fwd (ms)"),
    ("efficiency", "efficiency"),
    ("single_fwd_bwd_ms", "one device fwd+bwd (ms)"),
    ("efficiency_fwd_bwd", "efficiency fwd+bwd"),
    ("load_imbalance", "load imbalance"),
    ("torch_cp_status", "torch_cp"),
    ("attngym_over_torch_cp_fwd", "attngym speed-up vs torch_cp fwd"),
    ("attngym_over_torch_cp_fwd_bwd", "attngym speed-up vs torch_cp fwd+bwd"),
)


def register_resolvers() -> None:
    """Register the OmegaConf resolvers the YAML files use (idempotent; call before composing).

    - `${div:a,b}`: integer division, e.g. `prefix_length: ${div:${shape.seq_len},4}`.
    - `${split:total,[fractions]}`: integer lengths proportional to the fractions that sum to
      `total` exactly (the last one takes the rounding), e.g. document lengths.
    - `${pid:}`: this process's id, which makes default run folders unique even for runs started
      in the same microsecond.
    """
    if not OmegaConf.has_resolver("div"):
        OmegaConf.register_new_resolver("div", _div)
    if not OmegaConf.has_resolver("split"):
        OmegaConf.register_new_resolver("split", _split)
    if not OmegaConf.has_resolver("pid"):
        OmegaConf.register_new_resolver("pid", os.getpid)


def _div(a: Any, b: Any) -> int:
    if not isinstance(a, int) or not isinstance(b, int) or b == 0:
        raise ValueError(f"div needs two integers and a non-zero divisor, got {a!r}, {b!r}")
    return a // b


def _split(total: Any, fractions: Any) -> list[int]:
    if not isinstance(total, int) or total < 1:
        raise ValueError(f"split needs a positive integer total, got {total!r}")
    fractions = list(fractions)
    if not fractions or any(not isinstance(f, int | float) or f <= 0 for f in fractions):
        raise ValueError(f"split needs positive fractions, got {fractions!r}")
    norm = sum(fractions)
    lengths = [max(1, int(total * f / norm)) for f in fractions[:-1]]
    return [*lengths, total - sum(lengths)]


def to_plain(cfg: DictConfig) -> dict[str, Any]:
    """The composed config as a plain, resolved dict without the `hydra` node: what
    attngym.config reads.

    Raises:
        ConfigError: an interpolation cannot be resolved; the key names where.
    """
    from omegaconf.errors import OmegaConfBaseException

    try:
        data = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "config"
        raise ConfigError(str(key), str(err).split("\n")[0]) from None
    data.pop("hydra", None)  # type: ignore[union-attr]
    return data  # type: ignore[return-value]


def _group_dirs() -> set[str]:
    """Config groups a user picks options of: conf/'s folders, less hydra/ and __pycache__/."""
    return {
        p.name
        for p in CONF_DIR.iterdir()
        if p.is_dir() and p.name != "hydra" and not p.name.startswith(("_", "."))
    }


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


_GROUP_ARG = re.compile(
    r"^(?P<prefix>[+~]{0,2})(?P<group>[A-Za-z_][\w/]*)(?P<pkg>@[\w.]*)?=(?P<value>.*)$"
)


# Keys whose sub-keys are open: a variant's parameters differ per variant, kernel options are
# flex_attention's. Overrides of them are forced (`++`), so a misspelt key reaches attngym's own
# check (one line with a suggestion) rather than Hydra's struct-mode error.
OPEN_KEYS = ("attention", "kernel_options")
_OPEN_ARG = re.compile(rf"^(?:{'|'.join(OPEN_KEYS)})\.[\w.]+=")


def prepare_overrides(argv: list[str]) -> list[str]:
    """Check and normalise config-group overrides before Hydra sees them.

    - `group=option` (and sweeps `group=a,b`) must name files in conf/<group>/; an unknown option
      raises ConfigError listing the options with a suggestion;
    - numeric option names are quoted (`block_size=64` → `block_size='64'`): Hydra would parse them
      as integers and refuse them as group options;
    - any other `key=value` (with or without `+`) must name a config key
      (attngym.config.check_key): `seq_len=512` or `+shape.seqlen=512` raise ConfigError with
      the key meant (`shape.seq_len`);
    - `attention.<key>=v` and `kernel_options.<key>=v` become `++attention.<key>=v` (add or
      override): these keys are checked by attngym (attngym.variants.spec.build_variant, the
      kernel-option checks of attngym.config), which names a misspelt key with a suggestion.
      `kernel_options` is null in conf/config.yaml so that sweeps can set whole mappings
      (`kernel_options={...}`); `++kernel_options.X=v` creates the mapping from null.

    Arguments that are not group overrides pass through unchanged.
    """
    groups = _group_dirs()
    out = []
    for arg in argv:
        if _OPEN_ARG.match(arg):
            out.append(f"++{arg}")
            continue
        match = _GROUP_ARG.match(arg)
        if arg.startswith("-") or not match or match["group"] not in groups:
            _check_value_key(arg)
            out.append(arg)
            continue
        value = match["value"]
        if match["prefix"].startswith("~") and not value:
            out.append(arg)
            continue
        if "(" in value or "[" in value or "$" in value:  # choice(...), range(...), globs: Hydra's
            out.append(arg)
            continue
        items = [v.strip().strip("'\"") for v in value.split(",")]
        options = _options(match["group"])
        for item in items:
            if item not in options and item != "null":
                raise ConfigError(match["group"], choice_error("option", item, options))
        quoted = ",".join(f"'{v}'" if v.isdigit() else v for v in items)
        out.append(f"{match['prefix']}{match['group']}{match['pkg'] or ''}={quoted}")
    _check_preset_on_this_machine(out)
    return out


def _check_preset_on_this_machine(argv: list[str]) -> None:
    """A GPU-sized preset on a CPU is refused once, before a sweep's first job (each job checks
    it again with the device its config resolves to: attngym.presets)."""
    presets = [
        m["value"] for a in argv if (m := _GROUP_ARG.match(a)) and m["group"] == "experiment"
    ]
    if len(presets) != 1 or "," in presets[0]:
        return
    from attngym.device import resolve_device
    from attngym.presets import check_fits_machine

    devices = [a.split("=", 1)[1] for a in argv if a.lstrip("+").startswith("device=")]
    try:
        device = resolve_device(devices[-1] if devices else "auto").type
    except ValueError:
        return  # the job's own check names the device
    check_fits_machine(CONF_DIR, presets[0], device, argv)


_VALUE_ARG = re.compile(r"^(?P<prefix>\+{0,2})(?P<key>[A-Za-z_][\w.]*)=")


def _check_value_key(arg: str) -> None:
    """A `key=value` override (also `+key=` and `++key=`) names a config key
    (attngym.config.check_key): a misspelt or group-less key is one line with the key it most
    likely means, never a key Hydra adds and nothing reads. Hydra's own keys pass."""
    from attngym.config import check_key

    match = _VALUE_ARG.match(arg)
    if match and match["key"].split(".")[0] != "hydra":
        check_key(match["key"])


@dataclasses.dataclass(frozen=True)
class Job:
    """What Hydra says about the running job, read once."""

    run_dir: Path
    rank: int  # under torchrun; 0 otherwise
    multirun: bool
    overrides: list[str]  # the job's task overrides
    num: int | None  # job number in a sweep
    name: str  # the run's name for trackers: its overrides, or "defaults"
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
    return Job(
        run_dir=run_dir,
        rank=int(os.environ.get("RANK", "0")),
        multirun=multirun,
        overrides=[str(o) for o in hc.overrides.task],
        num=hc.job.num if multirun else None,
        name=str(hc.job.override_dirname or "") or "defaults",
        group=f"{folder.parent.name}_{folder.name}",
        sweep_dir=str(hc.sweep.dir) if multirun else "",
        preset=hc.runtime.choices.get("experiment"),
    )


def _why_rerun(run_dir: Path, overrides: list[str]) -> str | None:
    """Why a sweep job must run again: None when an earlier run of it finished ok with every file
    written (status ok, `complete: true`, heatmap.png and block_mask.png not empty), "" when it
    never wrote metrics.json, else what is wrong with what it left."""
    from attngym.tracking import read_metrics

    previous = read_metrics(run_dir)
    if previous is None:
        return ""
    if previous.get("overrides") != overrides:
        return "its metrics.json is of other overrides"
    if previous.get("status") != "ok":
        return f"it ended {previous.get('status')}: {previous.get('error')}"
    if previous.get("complete") is not True:
        return "it stopped after metrics.json, before its pictures and tracker"
    for name in PICTURES.values():
        path = run_dir / name
        if not path.is_file() or path.stat().st_size == 0:
            return f"its {name} is missing or empty"
    return None


def _draw_pictures(settings: Settings, run_dir: Path) -> dict[str, Path]:
    """heatmap.png and block_mask.png for any topology; a picture that cannot be drawn is a
    warning, one that cannot be written (OSError) fails the run, and a sequence too long to draw
    in seconds is skipped with the reason."""
    from attngym import viz

    variant = settings.variant
    seq_len = settings.shape.seq_len

    def heatmap(path: Path) -> None:
        window = min(HEATMAP_WINDOW, seq_len)
        viz.save_heatmap(variant, path, seq_len=seq_len, window=window, seed=settings.seed)

    def block_mask(path: Path) -> None:
        viz.save_block_mask_picture(
            variant.to(settings.device).mask_mod,
            seq_len,
            seq_len,
            path,
            block_size=settings.block_size,
            title=f"{variant.name}: block mask at {settings.block_size}",
            device=settings.device,
        )

    drawn = {}
    # The heatmap evaluates the mask on the CPU, the block mask on the run's device.
    for name, draw, device in (("heatmap", heatmap, "cpu"), ("block_mask", block_mask, None)):
        device = device or settings.device
        limit = PICTURE_MAX_PAIRS.get(device, PICTURE_MAX_PAIRS["cpu"])
        if seq_len * seq_len > limit:
            log.info(
                "%s not drawn: S x S = %.3g mask pairs to evaluate on %s, above %.3g",
                PICTURES[name],
                float(seq_len) ** 2,
                device,
                limit,
            )
            continue
        path = run_dir / PICTURES[name]
        try:
            draw(path)
            drawn[name] = path
        except OSError:
            raise  # a write error fails the run (run_job)
        except Exception as err:
            log.warning("%s not drawn: %s: %s", PICTURES[name], type(err).__name__, err)
    return drawn


def _tracked_config(cfg: DictConfig) -> dict[str, Any]:
    """The config a tracker records: resolved, or as written where a value cannot resolve."""
    try:
        return to_plain(cfg)
    except ConfigError:
        data = OmegaConf.to_container(cfg, resolve=False)
        data.pop("hydra", None)  # type: ignore[union-attr]
        return data  # type: ignore[return-value]


def format_results(metrics: dict[str, Any], run_dir: Path) -> str:
    """The short table printed at the end of a single run."""
    lines = [f"attngym: {metrics.get('status')}"]
    shown = RESULT_ROWS + (CP_ROWS if metrics.get("topology") not in (None, "single") else ())
    rows = [
        (_label(key, label, metrics), format_value(key, metrics[key]))
        for key, label in shown
        if metrics.get(key) is not None
    ]
    rows += [
        (f"flex speed-up vs {baseline} {p.replace('fwd_bwd', 'fwd+bwd')}", f"{metrics[key]:.3g}")
        for baseline in HEADLINE_BASELINES
        for p in ("fwd", "bwd", "fwd_bwd")
        if metrics.get(key := f"flex_over_{baseline}_{p}") is not None
    ]
    width = max((len(label) for label, _ in rows), default=0)
    for label, text in rows:
        lines.append(f"  {label:<{width}}  {text}")
    if metrics.get("error"):
        lines.append(f"  error: {metrics['error']}")
    lines.append(f"run folder: {run_dir}")
    return "\n".join(lines)


# On a CPU the one-device comparison attends densely (every masked entry computed, then
# dropped) while the ranks skip masked blocks, so efficiency there compares unequal work.
CPU_EFFICIENCY_NOTE = " (CPU: one device computes masked pairs too; not scaling)"


def _label(key: str, label: str, metrics: dict[str, Any]) -> str:
    if key.startswith("efficiency") and metrics.get("device") == "cpu":
        return label + CPU_EFFICIENCY_NOTE
    return label


def _rank_log(run_dir: Path, rank: int) -> logging.Handler:
    """A file handler on the `attngym` logger: this process's records go to rank<N>.log."""
    run_dir.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(run_dir / f"rank{rank}.log")
    handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] %(message)s"))
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


def _run_task(settings: Settings, run_dir: Path, metrics: dict[str, Any]) -> dict[str, Any]:
    """The topology's task, from the registry: its flat metrics, filled into `metrics` as they
    come (an interrupted run keeps what was measured)."""
    from attngym import registry

    return registry.get("task", settings.topology.kind)(settings, run_dir, metrics) or {}


def _run_other_rank(cfg: DictConfig, job: Job) -> None:
    """A rank other than 0 under torchrun: the same checks and task (its collectives need every
    rank), logged to <run_dir>/rank<N>.log; no metrics.json, pictures, tracker or table, which
    are rank 0's. A failure is logged there and raised, so torchrun sees the rank fail; in a sweep
    a ConfigError alone lets the rank go on to the next job, since every rank raises it alike
    before any collective (see _stop_sweep_after). It leaves the run's attngym.log to rank 0."""
    from attngym.config import from_config

    _leave_run_log()
    handler = _rank_log(job.run_dir, job.rank)
    try:
        metrics = _run_task(from_config(to_plain(cfg)), job.run_dir, {})
        log.info("rank %d done: validation %s", job.rank, metrics.get("validation", "on rank 0"))
    except Exception as err:
        log.exception("rank %d failed", job.rank)
        if not job.multirun:
            raise
        if _stop_sweep_after(err):
            raise SystemExit(1) from err  # Hydra would go on to the next job after an Exception
    finally:
        logging.getLogger("attngym").removeHandler(handler)
        handler.close()


def _stop_sweep_after(err: BaseException) -> bool:
    """Whether a failed job must end a sweep run under torchrun (WORLD_SIZE > 1).

    A ConfigError is raised alike on every rank before any collective, so the ranks stay in step
    and the sweep goes on. Any other failure may leave the ranks at different collectives of the
    job, which the next job's collectives would then pair with: the sweep stops (torchrun ends
    every rank, rank 0 first writing the summary of the jobs so far); the job's metrics.json or
    rank log records why, and running the same command again resumes, skipping the jobs already ok.
    """
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and not isinstance(err, ConfigError)


def run_job(cfg: DictConfig) -> dict[str, Any] | None:
    """One Hydra job: check, run the topology's task, judge, write files, draw, track, exit.

    The run folder's lock (attngym.tracking.lock) is held throughout by the process that writes
    there (rank 0 under torchrun): a second run pointed at the same folder stops with one line
    naming the holder, exit code 1, before it reads or writes anything.
    """
    from attngym.tracking.lock import FolderLock, FolderLocked

    job = _job()
    if job.rank != 0:  # under torchrun: rank 0 writes, draws, tracks and prints
        if job.multirun and _why_rerun(job.run_dir, job.overrides) is None:  # as rank 0 does
            return None
        return _run_other_rank(cfg, job)
    lock = FolderLock(job.run_dir)
    try:
        lock.acquire()
    except FolderLocked as err:
        print(f"attngym: error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    try:
        return _run_locked(cfg, job)
    finally:
        lock.release()


def _run_locked(cfg: DictConfig, job: Job) -> dict[str, Any] | None:
    """run_job's body, run folder locked."""
    if job.multirun:  # a resumed sweep: every rank decides alike from the same files
        why = _why_rerun(job.run_dir, job.overrides)
        what = f"job {job.num} ({' '.join(job.overrides)})"
        if why is None:
            log.info("%s: already ok in %s, skipping", what, job.run_dir)
            return None
        if why:
            log.info("%s: running it again: %s", what, why)
    metrics: dict[str, Any] = {"status": "failed", "error": None}
    try:
        settings, failure = _check_and_run(cfg, job, metrics)
        try:
            # metrics.json first (what was measured is safe), then `complete: true` once every
            # file of the run is written: a resumed sweep re-runs a job whose last write never came.
            _write_metrics(job, metrics, complete=False)
            if settings is not None:  # it ran; a failed run draws nothing more
                ok = metrics["status"] == "ok"
                images = _draw_pictures(settings, job.run_dir) if ok else {}
                _track(cfg, job, settings, metrics, images)
            _write_metrics(job, metrics, complete=True)
        except OSError as err:  # a full disk, a symlink where a file goes
            failure = _unwritten(job, metrics, err)
    except Interrupted as stop:
        _stop_interrupted(job, metrics, stop)
    return _finish(job, metrics, failure)


def _unwritten(job: Job, metrics: dict[str, Any], err: OSError) -> OSError:
    """A write of the run failed: the run fails with `could not write <path>: ...`; metrics.json
    says so if it can still be written, and the metrics stay in memory for the results table."""
    from attngym.fileio import write_error

    metrics.update(status="failed", error=write_error(err))
    log.error("%s", metrics["error"])
    with contextlib.suppress(OSError):
        _write_metrics(job, metrics, complete=False)
    return err


def _stop_interrupted(job: Job, metrics: dict[str, Any], stop: Interrupted) -> NoReturn:
    """SIGINT/SIGTERM during a job: metrics.json with status `interrupted` and what was measured
    so far, in a sweep the summary of the jobs so far, one line, exit code 128 + signal.
    Further signals are ignored meanwhile, so that these writes are not cut short."""
    from attngym.tracking.sweep import summarize

    for signum in INTERRUPTS:
        signal.signal(signum, signal.SIG_IGN)
    metrics.update(status="interrupted", error=str(stop))
    try:
        _write_metrics(job, metrics, complete=False)
        if job.multirun:
            summarize(job.sweep_dir)
    except OSError as err:
        print(f"attngym: error: {_one_line(err)}", file=sys.stderr, flush=True)
    where = job.sweep_dir if job.multirun else job.run_dir
    print(f"attngym: {stop}; what was measured is in {where}", file=sys.stderr, flush=True)
    raise SystemExit(stop.exit_code)


def _check_and_run(
    cfg: DictConfig, job: Job, metrics: dict[str, Any]
) -> tuple[Settings | None, BaseException | None]:
    """Settings (None when the config is refused: every check that needs no tensors, the preset
    against this machine included, runs here before the task) and the failure that stopped the
    run (None for a run that ran, whatever its verdict); metrics and status go into `metrics`."""
    from attngym.config import from_config
    from attngym.presets import check_fits_machine

    settings = None
    try:
        settings = from_config(to_plain(cfg))
        check_fits_machine(CONF_DIR, job.preset, settings.device, job.overrides)
        metrics.update(_run_task(settings, job.run_dir, metrics))
    except Exception as err:
        metrics["error"] = (
            str(err) if isinstance(err, ConfigError) else f"{type(err).__name__}: {err}"
        )
        if not isinstance(err, ConfigError):
            if isinstance(err, RankFailure):  # the failing rank's traceback is in its rank log
                log.error("run failed: %s", err)
            else:
                log.exception("run failed")
            return settings, err
        if job.multirun:  # a single run prints the one line of _finish instead
            log.error("config error: %s", err)
        return None, err  # refused: no picture, no tracker run
    metrics.update(_verdict(metrics))
    return settings, None


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
    from attngym.tracking import write_metrics

    metrics["overrides"] = job.overrides
    write_metrics(job.run_dir, {**metrics, "complete": complete})


def _track(
    cfg: DictConfig, job: Job, settings: Settings, metrics: dict[str, Any], images: dict[str, Path]
) -> None:
    """Hand the run to the configured tracker (the `logger` group)."""
    from attngym import registry
    from attngym.tracking import RunRecord

    params = dict(settings.logger)
    tracker = registry.build("tracker", params.pop("name"), **params)
    tracker.log_run(
        RunRecord(
            run_dir=job.run_dir,
            metrics=metrics,
            config=_tracked_config(cfg),
            images=images,
            name=job.name,
            group=job.group,
            job_type=settings.topology.kind,
        )
    )


def _finish(job: Job, metrics: dict[str, Any], failure: BaseException | None) -> dict[str, Any]:
    """The job's outcome as Hydra and the shell see it.

    In a sweep: a log line, and the metrics (the sweep goes on) unless the failure leaves
    torchrun ranks out of step. A single run: one line and exit code 2 for a ConfigError; else
    the results table, then the failure raised, or exit code 1 for a failed validation.
    """
    if job.multirun:
        log.info("job %s %s: %s", job.num, " ".join(job.overrides), metrics["status"])
        if failure is not None and _stop_sweep_after(failure):
            from attngym.tracking.sweep import summarize

            summarize(job.sweep_dir)  # the jobs so far; on_multirun_end will not run
            log.error(
                "stopping the sweep: after this failure the ranks may be out of step; run the "
                "same command again to resume (jobs already ok are skipped)"
            )
            raise SystemExit(1)  # Hydra would go on to the next job after an Exception
        return metrics
    if isinstance(failure, ConfigError) and os.environ.get("HYDRA_FULL_ERROR") != "1":
        print(f"attngym: error: {failure}", file=sys.stderr, flush=True)
        raise SystemExit(2)
    print(format_results(metrics, job.run_dir), flush=True)
    if isinstance(failure, RankFailure | OSError):  # one line: a traceback would say no more
        print(f"attngym: error: {_one_line(failure)}", file=sys.stderr, flush=True)
        raise SystemExit(1)
    if failure is not None:
        raise failure
    if metrics["status"] != "ok":  # a validation failure: the table above says which error
        raise SystemExit(1)
    return metrics


def _one_line(failure: BaseException) -> str:
    from attngym.fileio import write_error

    return write_error(failure) if isinstance(failure, OSError) else str(failure)


main = hydra.main(config_path=f"pkg://{CONF_PACKAGE}", config_name="config", version_base="1.3")(
    run_job
)


def entry(argv: list[str] | None = None) -> None:
    """Console script: `attngym report DIR ...` or a Hydra run/sweep with `argv` overrides."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "report":
        from attngym import report

        raise SystemExit(report.main(argv[1:]))
    try:
        argv = prepare_overrides(argv)
    except ConfigError as err:
        print(f"attngym: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    register_resolvers()
    sys.argv = [sys.argv[0], *argv]
    for signum in INTERRUPTS:
        signal.signal(signum, _raise_interrupted)
    try:
        main()  # a sweep with failed jobs exits 1 from its end callback (attngym.tracking.sweep)
    except Interrupted as stop:  # outside a job (a job stops itself: _stop_interrupted)
        print(f"attngym: {stop}", file=sys.stderr, flush=True)
        raise SystemExit(stop.exit_code) from None


# SIGINT (Ctrl-C) and SIGTERM (kill, a scheduler's stop) end a run alike: Interrupted.
INTERRUPTS = (signal.SIGINT, signal.SIGTERM)


def _raise_interrupted(signum: int, frame: Any) -> None:
    raise Interrupted(signum)
