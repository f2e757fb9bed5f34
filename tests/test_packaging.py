"""The wheel carries every package and the configs (.ci/check_wheel builds and runs it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from attngym.runner import overrides

ROOT = Path(__file__).resolve().parents[1]

if sys.version_info >= (3, 11):
    import tomllib
else:
    tomllib = pytest.importorskip("tomli")


def _setuptools_table() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_pyproject_lists_every_package_under_attngym():
    on_disk = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for top in ("attngym", "hydra_plugins")
        for p in (ROOT / top).rglob("__init__.py")
    }
    listed = set(_setuptools_table()["packages"])
    assert listed - {"attngym.conf"} == on_disk
    assert not (ROOT / "hydra_plugins" / "__init__.py").exists()  # Hydra's namespace package


def test_hydra_finds_attngyms_launcher_plugins(tmp_path):
    """Hydra instantiates only launchers its plugin scan found in `hydra_plugins`; an editable
    install hides them from that scan unless the CLI shows them (a wheel: .ci/check_wheel)."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="the slurm extra")
    scan = (  # a fresh process (Hydra scans once), outside the repository, as a user's
        "from attngym.runner import cli; cli._show_own_plugins(); "
        "from hydra.core.plugins import Plugins; from hydra.plugins.launcher import Launcher; "
        "print(*(f'{c.__module__}.{c.__name__}' for c in Plugins.instance().discover(Launcher)))"
    )
    found = subprocess.run(
        [sys.executable, "-c", scan],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.split()
    assert "hydra_plugins.attngym_launcher.SlurmLauncher" in found, found
    assert "hydra_plugins.attngym_launcher.BasicLauncher" in found, found  # every local sweep's


def test_conf_is_installed_as_attngym_conf():
    table = _setuptools_table()
    assert table["package-dir"] == {"attngym.conf": "conf"}
    installed = {p.relative_to(overrides.CONF_DIR) for p in overrides.CONF_DIR.rglob("*.yaml")}
    in_repo = {p.relative_to(ROOT / "conf") for p in (ROOT / "conf").rglob("*.yaml")}
    assert installed == in_repo and Path("attention/causal.yaml") in installed


def test_group_listing_and_hydra_read_the_same_package():
    groups = overrides._group_dirs()
    assert {"attention", "topology", "logger"} <= groups
    assert not any(g.startswith("_") for g in groups)  # conf/__pycache__ is no group
    with initialize_config_module(overrides.CONF_PACKAGE, version_base="1.3"):
        cfg = compose("config", overrides=["attention=sliding_window"])
    assert cfg.attention.window_size > 0
    assert "sliding_window" in overrides.group_options("attention")
