"""attngym: declarative experiments for PyTorch FlexAttention.

Importing the package is cheap: it pulls in neither Hydra, wandb, matplotlib, triton, pynvml nor
symmetric memory. Submodules import what they need when they are used; `attngym.run` (one
experiment from a notebook, as the command line runs it) imports the run layer when called.
"""

from typing import Any

__version__ = "0.1.0"


def run(**kwargs: Any) -> dict[str, Any]:
    """One experiment, as `attngym [overrides]` runs it; its metrics (attngym.api.run)."""
    from attngym.api import run as run_experiment

    return run_experiment(**kwargs)
