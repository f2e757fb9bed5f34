"""The README's Quick start, run as a newcomer pastes it: a fresh bash in a fresh folder that has
only what a clone has, `make setup` (already done: it finds .venv up to date), activation, the
user's own mask, one run. What it prints fits a terminal. Every other `attngym` command of the
README and of docs/*.md is read as attngym reads a command line before composing it (groups,
options, keys, Hydra's grammar): a renamed key or option fails here, in the page that shows it.
The commands run whole elsewhere: the cluster page's in tests/slurm, the scheme page's mycp.py in
tests/distributed/test_custom_scheme.py."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# What a printed line may exceed the width for: a path (a run folder, a file) or a one-line
# error, which names its key and what is allowed whole.
WIDTH = 100


PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, flags=re.DOTALL)


def quick_start_blocks() -> list[str]:
    """The bash blocks of the README's "## Quick start"."""
    text = (REPO / "README.md").read_text()
    return bash_blocks(text.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0])


def commands(block: str) -> list[tuple[str, list[str]]]:
    """A block's command lines, each as written (continuations joined) and as the shell splits
    its words (comments off)."""
    lines = block.replace("\\\n", " ").splitlines()
    return [(line, words) for line in lines if (words := shlex.split(line, comments=True))]


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


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_attngym_command_of_the_docs_reads_as_written(page, tmp_path, monkeypatch):
    """Each `attngym` line of the page's bash blocks passes attngym's checks of a command line
    (attngym.runner.overrides.prepare_overrides); the folders a block makes first (a config folder
    of your own) are made in a temporary folder, where the line is read."""
    from attngym.errors import ConfigError
    from attngym.runner.overrides import prepare_overrides

    monkeypatch.chdir(tmp_path)
    read = 0
    for block in bash_blocks(page.read_text()):
        for line, words in commands(block):
            if words[0] in ("mkdir", "printf"):  # a block's own set-up
                subprocess.run(["bash", "-c", line], check=True, cwd=tmp_path)
            if words[0] != "attngym" or words[1:2] == ["report"]:
                continue
            try:
                try:
                    prepare_overrides(words[1:])
                except ConfigError as err:  # a GPU-sized preset on this CPU: as its smoke run
                    smoke = str(err).partition("as its CPU smoke run does: add ")[2]
                    if not smoke:
                        raise
                    prepare_overrides(words[1:] + smoke.split())
            except ConfigError as err:
                raise AssertionError(f"{page.name}: {line.strip()}: {err}") from None
            read += 1
    if page.name in ("README.md", "variants.md", "config.md", "context-parallel.md"):
        assert read > 0, f"{page.name} shows no attngym command"
