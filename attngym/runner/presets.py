"""Presets (conf/experiment/<name>.yaml) and the machine each is sized for.

A preset's header says, in comments a person reads, the device it is sized for (`# Sized for:`)
and, for one sized for a GPU, the overrides that size it down for a CPU (`# CPU smoke run:`).
On a CPU, a GPU-sized preset would run for hours; it is refused before any work, in one line that
names those overrides, unless the command line sets every key they set (the user sized it).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from attngym.errors import ConfigError

SIZED_FOR = "# Sized for:"
CPU_SMOKE_RUN = "# CPU smoke run:"


def _header(conf_dir: Path, name: str) -> list[str]:
    path = conf_dir / "experiment" / f"{name}.yaml"
    return [line for line in path.read_text().splitlines() if line.startswith("#")]


def _after(lines: list[str], prefix: str) -> str | None:
    return next((line[len(prefix) :].strip() for line in lines if line.startswith(prefix)), None)


def check_fits_machine(conf_dir: Path, name: str | None, device: str, overrides: Iterable[str]):
    """Refuse a GPU-sized preset on a CPU unless the command line sizes it down.

    Args:
        conf_dir: the config folder (its experiment/ holds the presets).
        name: the preset chosen with +experiment=NAME, or None.
        device: the resolved device, cpu or cuda.
        overrides: the job's command-line overrides.

    Raises:
        ConfigError("experiment", ...): naming the overrides of the preset's CPU smoke run, or
        saying it runs on a GPU only.
    """
    if name is None or device != "cpu":
        return
    header = _header(conf_dir, name)
    # The machine alone: "one 80+ GB GPU (H100/H200). Takes: ~40 minutes there (80 jobs; ..."
    # goes on over lines a person reads; the sentence after the machine is not a reason.
    sized = (_after(header, SIZED_FOR) or "").split(" Takes:")[0].rstrip(".")
    cpu_at, gpu_at = sized.find("CPU"), sized.find("GPU")
    if cpu_at >= 0 and (gpu_at < 0 or cpu_at < gpu_at):
        return  # sized for a CPU first ("a 2-core CPU or a GPU box"), not "a GPU, no CPU run"
    smoke = _after(header, CPU_SMOKE_RUN)
    if smoke is None:
        raise ConfigError("experiment", f"{name} is sized for {sized}; run it on a GPU")
    given = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    needed = [o for o in smoke.split() if o.split("=", 1)[0] not in {"device", *given}]
    if needed:
        raise ConfigError(
            "experiment",
            f"{name} is sized for {sized} and would take hours on this CPU; size it "
            f"down as its CPU smoke run does: add {' '.join(needed)}",
        )
