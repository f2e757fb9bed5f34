"""Where results go: files first (metrics.json, always), then the configured tracker.

Files come first so that a run whose tracker fails, hangs or is offline still leaves everything a
sweep summary or a report needs. Trackers register as "tracker" in attngym.registry:

    none    nothing besides metrics.json
    local   metrics.json plus a readable results.md
    wandb   Weights & Biases (offline by default; imported only when used)

A tracker is built from the `logger` config group (`registry.build("tracker", name, **params)`)
and receives one `RunRecord` per run through `log_run`.
"""

from attngym.runner.tracking import files, wandb_logger  # noqa: F401  (register the trackers)
from attngym.runner.tracking.files import RunRecord, read_metrics, scalar_metrics, write_metrics

__all__ = ["RunRecord", "read_metrics", "scalar_metrics", "write_metrics"]
