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


def test_a_gpu_sized_preset_on_a_cpu_is_refused_naming_the_overrides_that_fit():
    from attngym.errors import ConfigError
    from attngym.runner.presets import check_fits_machine

    with pytest.raises(ConfigError) as info:
        check_fits_machine(CONF, "flex_vs_sdpa", "cpu", ["device=cpu"])
    message = str(info.value)
    assert info.value.key == "experiment" and "\n" not in message
    assert "shape.seq_len=512" in message and "device=cpu" not in message
    smoke = ["attention=causal", "shape.seq_len=512", "shape.head_dim=64", "shape.batch=2"]
    smoke += ["benchmark.warmup=1", "benchmark.repeats=3"]
    check_fits_machine(CONF, "flex_vs_sdpa", "cpu", smoke)  # sized down: accepted
    check_fits_machine(CONF, "flex_vs_sdpa", "cuda", [])  # where it is sized for
    check_fits_machine(CONF, "variant_gallery", "cpu", [])  # sized for a CPU
    with pytest.raises(ConfigError, match="run it on a GPU"):
        check_fits_machine(CONF, "block_size_sweep", "cpu", [])


@pytest.mark.parametrize("name", PRESETS)
def test_a_refusal_names_the_whole_machine_and_nothing_cut(name):
    # The header's sentence goes on over lines; the refusal quotes the machine alone, whole.
    from attngym.errors import ConfigError
    from attngym.runner.presets import check_fits_machine

    try:
        check_fits_machine(CONF, name, "cpu", [])
    except ConfigError as err:
        sized = str(err).split("is sized for ", 1)[1].split(" and would", 1)[0].split(";")[0]
        assert sized.count("(") == sized.count(")"), sized
        assert "Takes" not in sized and not sized.endswith((",", "(", "and", "cold")), sized
