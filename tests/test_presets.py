"""Every preset says the device it is sized for and how long it takes there, in its file and in
`attngym --help` (the help text is read from conf/hydra/default.yaml, as Hydra prints it)."""

from __future__ import annotations

import pathlib

import pytest
import yaml

CONF = pathlib.Path(__file__).resolve().parents[1] / "conf"
PRESETS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


@pytest.mark.parametrize("name", PRESETS)
def test_a_preset_file_says_its_device_and_time(name):
    header = [
        line
        for line in (CONF / "experiment" / f"{name}.yaml").read_text().splitlines()
        if line.startswith("#")
    ]
    text = "\n".join(header)
    assert "Sized for:" in text and "Takes:" in text


def test_help_lists_every_preset_with_its_device_and_time():
    template = yaml.safe_load((CONF / "hydra" / "default.yaml").read_text())["help"]["template"]
    rows = {line.split()[0]: line for line in template.splitlines()[1:] if line.startswith("  ")}
    for name in PRESETS:
        assert name in rows, f"{name} is not in the --help preset table"
        assert "CPU" in rows[name] or "GPU" in rows[name]
        assert any(unit in rows[name] for unit in (" s ", " min "))
