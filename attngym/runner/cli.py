"""The command line: `attngym [overrides]`, `python -m attngym`, `attngym report DIR`.

`entry` is the console script. `attngym report ...` goes to attngym.runner.report; anything else is
a Hydra run or sweep: the command line is checked and prepared (attngym.runner.overrides), the
OmegaConf resolvers registered, SIGINT/SIGTERM made to raise errors.Interrupted, and `main`, the
only @hydra.main, composes `config.yaml` from `pkg://attngym.conf` and runs each job
(attngym.runner.job.run_job). Hydra's own flags (`--help`, `--cfg job`, `-sc install=bash`, ...)
reach Hydra untouched.
"""

from __future__ import annotations

import atexit
import gc
import logging
import sys
from pathlib import Path

import hydra

from attngym.distributed.ranks.launch import join_slurm_step
from attngym.errors import ConfigError, Interrupted
from attngym.runner import overrides
from attngym.runner.job import catch_interrupts, run_job
from attngym.runner.overrides import (
    CONF_PACKAGE,
    expect_launcher_schema,
    prepare_overrides,
    register_resolvers,
)

main = hydra.main(config_path=f"pkg://{CONF_PACKAGE}", config_name="config", version_base="1.3")(
    run_job
)


def entry(argv: list[str] | None = None) -> None:
    """Console script: `attngym report DIR ...` or a Hydra run/sweep with `argv` overrides."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # At the process's exit, after the other exit handlers (W&B's), everything is written: the
    # interpreter's teardown need not collect what torch, Dynamo and Inductor built (1-3 s of
    # garbage collection after the run's last line; gc.freeze leaves those objects out). At
    # exit only, so that a caller of entry() in its own process keeps collecting them.
    atexit.unregister(gc.freeze)
    atexit.register(gc.freeze)
    if argv and argv[0] == "report":
        from attngym.runner import report

        raise SystemExit(report.main(argv[1:]))
    join_slurm_step()  # `srun -n N attngym ...`: each task is a rank, as under torchrun
    overrides.typed_command_line[:] = argv
    overrides.refused.clear()
    try:  # a single run's override Hydra would refuse is refused by its job (overrides.refused)
        argv = prepare_overrides(argv, overrides.refused if _one_run(argv) else None)
    except ConfigError as err:
        print(f"attngym: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    register_resolvers()
    expect_launcher_schema()
    _show_own_plugins()
    sys.argv = [sys.argv[0], *argv]
    logging.raiseExceptions = False  # a log line a full disk refuses is lost, not a traceback
    catch_interrupts()
    try:
        main()  # a sweep with failed jobs exits 1 from its end callback (tracking.sweep)
    except Interrupted as stop:  # outside a job (a job stops itself: job._stop_interrupted)
        _record_stop(stop)
        print(f"attngym: {stop}", file=sys.stderr, flush=True)
        raise SystemExit(stop.exit_code) from None


def _record_stop(stop: Interrupted) -> None:
    """A single run stopped while Hydra prepared its folder, before its job began: the folder's
    metrics.json says so (a job's own stop writes it: job._stop_interrupted)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from attngym.runner.tracking.files import record_failure

    if not HydraConfig.initialized() or HydraConfig.get().mode == RunMode.MULTIRUN:
        return
    hc = HydraConfig.get()
    run_dir = Path(str(hc.runtime.output_dir or ""))
    if hc.runtime.output_dir and run_dir.is_dir() and not (run_dir / "metrics.json").exists():
        record_failure(run_dir, overrides.task_overrides(hc), str(stop), "interrupted")


# Hydra's flags after which no job runs (help, the config printed), or several (a sweep).
NO_SINGLE_RUN = ("-m", "--multirun", "-h", "--help", "--hydra-help", "--version", "-c", "--cfg",
                 "-i", "--info", "-sc", "--shell-completion")  # fmt: skip


def _one_run(argv: list[str]) -> bool:
    """Whether the command line runs one job (no sweep, no help or printed config)."""
    flag_args, _ = overrides.split_flags(argv)
    return not any(arg.partition("=")[0] in NO_SINGLE_RUN for _, arg in flag_args)


def _show_own_plugins() -> None:
    """Make Hydra's plugin scan find attngym's launcher (hydra_plugins.attngym_launcher). An
    editable install (setuptools' import hook) makes it importable, but not listed by the
    pkgutil walk of `hydra_plugins.__path__` that Hydra scans; a wheel install needs nothing."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("hydra_plugins.attngym_launcher")
    except ImportError:  # no hydra_plugins at all
        return
    if spec is None or not spec.submodule_search_locations:
        return
    import hydra_plugins

    folder = str(Path(list(spec.submodule_search_locations)[0]).parent)
    if folder not in list(hydra_plugins.__path__):
        hydra_plugins.__path__.append(folder)
