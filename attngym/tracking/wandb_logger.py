"""Weights & Biases tracker: one W&B run per attngym run, offline unless asked otherwise.

Offline by default because experiments often run where there is no network (compute nodes,
laptops on a train) and a tracker must never block or fail a run: offline runs are stored in the
run folder (`<run_dir>/wandb/offline-run-*`) and uploaded later with `wandb sync`. wandb is
imported only here, only when the tracker logs; every W&B call is bounded by `init_timeout_s`,
and a W&B failure is logged as a warning (metrics.json is already on disk).

Mapping: config = the resolved config; summary = the scalar metrics (same names as
metrics.json); the PNGs as `wandb.Image`; group = the sweep (or run) folder name; job_type = the
topology; name = the overrides that make the run different (hydra.job.override_dirname).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from attngym import registry
from attngym.errors import ConfigError, choice_error
from attngym.tracking.files import RunRecord, scalar_metrics

log = logging.getLogger(__name__)

MODES = ("offline", "online", "disabled")


class WandbTracker:
    """Log a run to W&B (see the module docstring for what goes where)."""

    def __init__(
        self,
        *,
        mode: str = "offline",
        project: str = "attngym",
        entity: str | None = None,
        tags: Sequence[str] = (),
        init_timeout_s: float = 20.0,
    ):
        if mode not in MODES:
            raise ConfigError("logger.mode", choice_error("wandb mode", mode, MODES))
        self.mode = mode
        self.project = project
        self.entity = entity
        self.tags = list(tags)
        self.init_timeout_s = float(init_timeout_s)

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
            if images:
                run.log(images)
        finally:
            run.finish(exit_code=0 if ok else 1)
        where = run.dir if self.mode == "offline" else getattr(run, "url", "")
        log.info("wandb (%s): %s", self.mode, where)


@registry.register("tracker", "wandb")
def wandb_tracker(
    mode: str = "offline",
    project: str = "attngym",
    entity: str | None = None,
    tags: Sequence[str] = (),
    init_timeout_s: float = 20.0,
) -> WandbTracker:
    """W&B tracker; `mode` offline (default), online or disabled."""
    return WandbTracker(
        mode=mode, project=project, entity=entity, tags=tags, init_timeout_s=init_timeout_s
    )
