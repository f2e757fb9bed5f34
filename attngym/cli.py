"""The command line: `attngym [overrides]`, `python -m attngym`, `attngym report DIR`.

`entry` is the console script. `attngym report ...` goes to attngym.report; anything else is a
Hydra run or sweep: the command line is checked and prepared (attngym.overrides), the OmegaConf
resolvers registered, SIGINT/SIGTERM made to raise errors.Interrupted, and `main`, the only
@hydra.main, composes `config.yaml` from `pkg://attngym.conf` and runs each job
(attngym.job.run_job). Hydra's own flags (`--help`, `--cfg job`, `-sc install=bash`, ...) reach
Hydra untouched.
"""

from __future__ import annotations

import sys

import hydra

from attngym import overrides
from attngym.errors import ConfigError, Interrupted
from attngym.job import catch_interrupts, run_job
from attngym.overrides import CONF_PACKAGE, prepare_overrides, register_resolvers

main = hydra.main(config_path=f"pkg://{CONF_PACKAGE}", config_name="config", version_base="1.3")(
    run_job
)


def entry(argv: list[str] | None = None) -> None:
    """Console script: `attngym report DIR ...` or a Hydra run/sweep with `argv` overrides."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "report":
        from attngym import report

        raise SystemExit(report.main(argv[1:]))
    overrides.typed_command_line[:] = argv
    try:
        argv = prepare_overrides(argv)
    except ConfigError as err:
        print(f"attngym: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    register_resolvers()
    sys.argv = [sys.argv[0], *argv]
    catch_interrupts()
    try:
        main()  # a sweep with failed jobs exits 1 from its end callback (attngym.tracking.sweep)
    except Interrupted as stop:  # outside a job (a job stops itself: job._stop_interrupted)
        print(f"attngym: {stop}", file=sys.stderr, flush=True)
        raise SystemExit(stop.exit_code) from None
