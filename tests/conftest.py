"""Shared test fixtures and the GPU skips."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_multi = pytest.mark.skip(reason="needs two or more CUDA GPUs")
    for item in items:
        if "gpu" in item.keywords and n_gpu < 1:
            item.add_marker(skip_gpu)
        if "multigpu" in item.keywords and n_gpu < 2:
            item.add_marker(skip_multi)


@pytest.fixture
def rng():
    """A fresh, seeded generator per test: random inputs, reproducible failures."""
    return torch.Generator().manual_seed(1234)


@pytest.fixture(scope="session")
def attngym_cli():
    """`run(args, cwd)`: `python -m attngym ARGS` in a subprocess, as a user runs it, without the
    caller's W&B or Hydra environment. `env` adds variables; `command` replaces `-m attngym`
    (e.g. `("-c", code)`)."""

    def run(args, cwd, *, env=None, command=("-m", "attngym")):
        clean = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "HYDRA_"))}
        return subprocess.run(
            [sys.executable, *command, *args],
            cwd=cwd,
            env={**clean, **(env or {})},
            capture_output=True,
            text=True,
            timeout=300,
        )

    return run
