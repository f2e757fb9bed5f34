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


@pytest.fixture(scope="session", autouse=True)
def _own_cache_folder(tmp_path_factory):
    """attngym's cache folder (kept answers of topology=auto, tuned tables) is the test
    session's own: a run never takes an answer a run outside the tests left."""
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("cache"))


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


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """`write(name, source)`: a researcher's `<name>.py` in the working directory (tmp_path, not
    installed anywhere), imported afresh by the test and dropped after it; returns tmp_path."""
    written = []

    def write(name, source):
        (tmp_path / f"{name}.py").write_text(source)
        monkeypatch.chdir(tmp_path)
        monkeypatch.delitem(sys.modules, name, raising=False)
        written.append(name)
        return tmp_path

    yield write
    for name in written:
        sys.modules.pop(name, None)
