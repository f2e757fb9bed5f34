"""Weights & Biases tracker: one W&B run per attngym run, offline unless asked otherwise.

Offline by default because experiments often run where there is no network (compute nodes,
laptops on a train) and a tracker must never block or fail a run: offline runs are stored in the
run folder (`<run_dir>/wandb/offline-run-*`) and uploaded later with `wandb sync`. wandb is
imported only here, only when the tracker logs; `wandb.init` is bounded by `init_timeout_s` and,
online, `run.finish` (which waits for the upload) by `finish_timeout_s`: it runs in a daemon thread
and, past the timeout, the run goes on while the upload continues in the background until the
process exits (the local copy stays in the run folder for `wandb sync`). A W&B failure is logged
as a warning (metrics.json is already on disk).

Mapping: config = the resolved config; summary = the scalar metrics (same names as
metrics.json), the numeric ones also as one history step (for report line plots); the PNGs as
`wandb.Image`; group = the sweep (or run) folder name; job_type = the topology; name = the
overrides that make the run different (hydra.job.override_dirname).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from attngym import registry
from attngym.errors import ConfigError, choice_error
from attngym.tracking.files import RunRecord, scalar_metrics

log = logging.getLogger(__name__)

MODES = ("offline", "online", "disabled")


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

    def log_run(self, record: RunRecord) -> None:
        """One W&B run: config, summary metrics, images; always finished, never raises."""
        try:
            self._log(record)
        except Exception as err:  # a tracker must not fail a run whose files are written
            log.warning(
                "wandb logging failed (%s: %s); metrics.json is unaffected", type(err).__name__, err
            )

    def _log(self, record: RunRecord) -> None:
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
        ok = metrics.get("status") == "ok"
        try:
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
        where = run.dir if self.mode == "offline" else getattr(run, "url", "")
        log.info("wandb (%s): %s", self.mode, where)

    def _finish(self, run: Any, exit_code: int) -> None:
        """run.finish, bounded by finish_timeout_s when online (it waits for the upload)."""
        if self.mode != "online":
            run.finish(exit_code=exit_code)
            return
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
                "wandb: finish did not return within %.0f s (no network?); the upload continues "
                "in the background and is abandoned when the process exits; the local copy in "
                "%s can be uploaded with `wandb sync`",
                self.finish_timeout_s,
                getattr(run, "dir", "the run folder"),
            )
