"""The real SLURM cluster the tests here submit to (tests/slurm/cluster.py), one per session.

`make test` runs this folder in a pytest run of its own, after the parallel suite: the cluster's
jobs run on this machine's cores and must not race the other tests' timings. Without SLURM (or
without root, which slurmd needs to run jobs) every test here skips, saying which.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from .cluster import SlurmCluster, missing

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    why = missing()
    if why is not None:
        pytest.skip(why)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def user_shell(slurm, tmp_path):
    """`run(command, timeout)`: a shell command as a user types it, in a folder of their own,
    against the test cluster, with this Python's `attngym` and `torchrun` first on PATH."""
    bin_dir = str(Path(sys.executable).parent)
    clean = {k: v for k, v in slurm.env.items() if not k.startswith(("WANDB_", "HYDRA_"))}
    env = {
        **clean,
        "PATH": f"{bin_dir}:{clean.get('PATH', '')}",
        "PYTHONPATH": str(tmp_path),  # the user's own modules (masks) are importable
    }

    def run(command: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", "-c", command],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            start_new_session=True,
        )

    def start(command: str) -> subprocess.Popen:
        """The same command, not waited for: its output in one pipe, its own session."""
        return subprocess.Popen(
            ["bash", "-c", command],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )

    run.env = env
    run.cwd = tmp_path
    run.start = start
    return run


def mask_module(folder: Path, name: str, first: str = "") -> None:
    """`<folder>/<name>.py`: a causal `mask`, after `first` (what the module does as it is
    imported on the node: sleep, kill its rank)."""
    (folder / f"{name}.py").write_text(
        f"{first}\ndef mask(b, h, q_idx, kv_idx):\n    return q_idx >= kv_idx\n"
    )


def readme_block(marker: str) -> str:
    """The fenced code block of docs/clusters.md (the README's cluster page) whose first comment
    line (after a `#!` line) holds `marker`."""
    blocks, block = [], None
    for line in (REPO / "docs" / "clusters.md").read_text().splitlines():
        if line.startswith("```"):
            block = [] if block is None else blocks.append("\n".join(block) + "\n")
        elif block is not None:
            block.append(line)
    for text in blocks:
        head = [line for line in text.splitlines()[:2] if not line.startswith("#!")]
        if head and marker in head[0]:
            return text
    raise AssertionError(f"docs/clusters.md has no code block starting with {marker!r}")
