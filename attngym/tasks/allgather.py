"""All-gather context parallelism: the context-parallel run of attngym.tasks.ring, gathering K/V.

Everything but the attention call (checks, launch, validation, timings, metrics) is shared with the
ring task, so the two topologies report comparable numbers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from attngym import registry
from attngym.config import Settings
from attngym.tasks.ring import run_context_parallel


@registry.register("task", "allgather")
def run(settings: Settings, run_dir: Path) -> dict[str, Any]:
    """All-gather attention over topology.world_size ranks; see attngym.tasks.ring."""
    return run_context_parallel(settings, run_dir, "allgather")
