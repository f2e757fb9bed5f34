"""The README's Quick start, run as a newcomer pastes it: a fresh bash in a fresh folder that has
only what a clone has, `make setup` (already done: it finds .venv up to date), activation, the
user's own mask, one run. What it prints fits a terminal."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# What a printed line may exceed the width for: a path (a run folder, a file) or a one-line
# error, which names its key and what is allowed whole.
WIDTH = 100


def quick_start_blocks() -> list[str]:
    """The bash blocks of the README's "## Quick start", up to its install notes."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Quick start", 1)[1].split("**Installing outside", 1)[0]
    return re.findall(r"```bash\n(.*?)```", section, flags=re.DOTALL)


def too_wide(output: str) -> list[str]:
    """Printed lines wider than WIDTH that hold no path and are no error line."""
    return [
        line
        for line in output.splitlines()
        if len(line) > WIDTH and "/" not in line and not re.search(r"error|failed: ", line)
    ]


@pytest.fixture
def clone_like(tmp_path):
    """A folder with what `make setup` reads (Makefile, pyproject.toml) and its .venv."""
    if not (REPO / ".venv" / ".installed").exists():
        pytest.skip("needs the repository's .venv, made by make setup")
    for name in ("Makefile", "pyproject.toml", ".venv"):
        (tmp_path / name).symlink_to(REPO / name)
    return tmp_path


def test_the_quick_start_runs_as_pasted_and_fits_a_terminal(clone_like):
    blocks = quick_start_blocks()
    assert len(blocks) == 2 and "make setup" in blocks[0] and "mymasks.py" in blocks[1]
    script = "set -e\n" + "\n".join(blocks)
    env = {"HOME": os.environ.get("HOME", "/root"), "PATH": "/usr/local/bin:/usr/bin:/bin"}
    proc = subprocess.run(
        ["bash", "-c", script],
        cwd=clone_like,
        env=env,  # a fresh shell: no venv active, attngym not on PATH until the README says
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run,) = (clone_like / "outputs").glob("*/*")
    for name in ("heatmap.png", "block_mask.png", "metrics.json"):
        assert (run / name).stat().st_size > 0
    assert "attngym: ok" in proc.stdout
    assert too_wide(proc.stdout + proc.stderr) == []


def test_a_failed_sweep_prints_lines_that_fit(tmp_path, attngym_cli):
    (tmp_path / "mymasks.py").write_text(
        "def checkerboard(b, h, q_idx, kv_idx):\n    return (q_idx // 8 + kv_idx // 8) % 2 == 0\n"
    )
    args = [
        "-m",
        "attention=custom",
        "attention.mask_mod=mymasks.checkerboard",
        "attention.mask_args.stride=1,2",  # a mask_mod is no factory: both jobs fail
        "shape.seq_len=64",
        "device=cpu",
        "logger=none",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    ]
    proc = attngym_cli(args, tmp_path)
    assert proc.returncode == 1
    assert "2 jobs, 2 failed." in proc.stdout
    lines = [ln for ln in too_wide(proc.stdout + proc.stderr) if "[HYDRA] \t#" not in ln]
    assert lines == []  # Hydra's own launch lines ("#0 : overrides") aside
    summary = (tmp_path / "sweep" / "summary.md").read_text()
    assert "is a mask_mod itself" in summary  # every error whole, under the table
