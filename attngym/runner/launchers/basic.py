"""The launcher of a sweep on this machine: Hydra's basic launcher, each job failing alone.

Hydra prepares a job's folder before the job runs: it creates the folder and writes
.hydra/config.yaml, hydra.yaml and overrides.yaml, and its log file opens there. A full disk, a
symlink planted as `.hydra` (Hydra would write through it) or a job Hydra cannot compose raises
out of Hydra's launcher and ends the whole sweep with a traceback, no summary and no resume
command. This launcher runs the same jobs in the same order through Hydra's own `run_job`, and
makes such a job a failed row of the sweep (attngym.runner.tracking.files.record_failure) instead;
the next job runs, and the sweep's end callback writes the summary and the exit code.

conf/config.yaml makes it the default (`hydra/launcher: attngym`); `hydra/launcher=basic` is
Hydra's own.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from hydra._internal.core_plugins.basic_launcher import BasicLauncher
from hydra.core.utils import (
    JobReturn,
    JobStatus,
    configure_log,
    filter_overrides,
    run_job,
    setup_globals,
)
from omegaconf import open_dict

from attngym.errors import ConfigError, failure_text
from attngym.fileio import check_target, write_error
from attngym.runner.overrides import launch_lines

log = logging.getLogger(__name__)

# What Hydra writes into a job's folder before the job runs, besides its log file.
HYDRA_FILES = (".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml")


class AttngymBasicLauncher(BasicLauncher):
    """Hydra's BasicLauncher, a job that cannot be prepared failing alone (module docstring)."""

    def launch(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
    ) -> Sequence[JobReturn]:
        setup_globals()
        assert self.hydra_context is not None and self.config is not None
        assert self.task_function is not None
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        shared, lines = launch_lines([filter_overrides(o) for o in job_overrides])
        each = f", each with:\n{shared}" if shared else ""  # the shared overrides, once
        log.info("Launching %d jobs locally%s", len(job_overrides), each)
        returns = []
        for num, overrides in enumerate(job_overrides, start=initial_job_idx):
            log.info("\t#%d : %s", num, lines[num - initial_job_idx])
            run_dir = Path(str(self.config.hydra.sweep.dir)) / str(num)
            try:
                config = self.hydra_context.config_loader.load_sweep_config(
                    self.config, list(overrides)
                )
                with open_dict(config):
                    config.hydra.job.id = num
                    config.hydra.job.num = num
                run_dir = Path(str(config.hydra.sweep.dir)) / str(config.hydra.sweep.subdir)
                for name in (*HYDRA_FILES, f"{config.hydra.job.name}.log"):
                    check_target(run_dir / name)  # Hydra would write through a symlink
                returns.append(
                    run_job(
                        hydra_context=self.hydra_context,
                        task_function=self.task_function,
                        config=config,
                        job_dir_key="hydra.sweep.dir",
                        job_subdir_key="hydra.sweep.subdir",
                    )
                )
            except Exception as err:  # this job fails alone
                returns.append(self._failed(num, list(overrides), run_dir, err))
            configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        return returns

    def _failed(self, num: int, overrides: list[str], run_dir: Path, err: Exception) -> JobReturn:
        """A job that could not be prepared: one line, a failed row in its folder, and a
        JobReturn the sweeper reads without raising (the summary judges the job)."""
        from attngym.runner.tracking.files import record_failure

        if isinstance(err, OSError):
            reason = f"Hydra could not prepare the job's folder: {write_error(err)}"
        elif isinstance(err, ConfigError):
            reason = str(err)
        else:
            reason = f"Hydra could not compose the job: {failure_text(err)}"
        log.error("job %d failed: %s", num, reason)  # its overrides: the launch line above
        record_failure(run_dir, overrides, reason)
        return JobReturn(overrides=overrides, status=JobStatus.COMPLETED)
