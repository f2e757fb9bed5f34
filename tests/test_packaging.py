"""The wheel carries every package and the configs (.ci/check_wheel builds and runs it)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from attngym import overrides

ROOT = Path(__file__).resolve().parents[1]

if sys.version_info >= (3, 11):
    import tomllib
else:
    tomllib = pytest.importorskip("tomli")


def _setuptools_table() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_pyproject_lists_every_package_under_attngym():
    on_disk = {
        ".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "attngym").rglob("__init__.py")
    }
    listed = set(_setuptools_table()["packages"])
    assert listed - {"attngym.conf"} == on_disk


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
    assert "sliding_window" in overrides._options("attention")
