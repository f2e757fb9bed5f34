"""attngym: declarative experiments for PyTorch FlexAttention.

Importing the package is cheap: it pulls in neither Hydra, wandb, matplotlib, triton, pynvml nor
symmetric memory. Submodules import what they need when they are used.
"""

__version__ = "0.1.0"
