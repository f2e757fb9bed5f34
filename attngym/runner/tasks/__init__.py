"""Tasks: what one run does, per topology. Each registers itself as a "task" in attngym.registry.

Every task has the signature `run(settings: Settings, run_dir: pathlib.Path, metrics=None) ->
dict[str, Any]`: it fills `metrics` in place as results come (a run stopped by SIGINT/SIGTERM
keeps what it measured) and returns it, flat. The caller (attngym.runner.job) writes metrics.json,
draws the pictures and hands everything to the trackers, so a task never deals with files other than
its profiler's.

Metric names, labels, units and meanings are the table of attngym.metrics (`METRICS`): W&B, the
sweep summary, report.html and the printed results table read them there, and a key a task
writes without a row there fails tests/test_metrics.py. Values are None where a quantity does
not apply (e.g. gradient errors on CPU).
"""

from attngym.runner.tasks import (
    context_parallel,  # noqa: F401  (registers a task per topology)
    single,  # noqa: F401  (registers "single")
)
