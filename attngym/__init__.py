"""attngym: declarative experiments for PyTorch FlexAttention.

Importing the package is cheap: it pulls in neither Hydra, wandb, matplotlib, triton, pynvml nor
symmetric memory. Submodules import what they need when they are used; `attngym.run` (one
experiment from a notebook, as the command line runs it: attngym.runner.api.run) is imported when it
is first looked up (PEP 562), so `help(attngym.run)` shows its real signature and arguments.
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["run"]


def __getattr__(name: str) -> Any:
    if name == "run":
        from attngym.runner.api import run

        return run
    raise AttributeError(f"module 'attngym' has no attribute {name!r}")
