"""The two ways in: `check_config` (values only, no hardware) and `from_config` (the same
checks, then `auto` resolved on this machine, the rules on resolved values and the memory fit),
over the rule lists `VALUE_RULES` and `RESOLVED_RULES`; a workload's batches.

Apart from the types and the rules so that the order in which a config is judged reads in one
place.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from attngym.errors import ConfigError
from attngym.runner.config.flash import (
    _flash_is_installed,
    _flash_needs_16_bit,
    _flash_needs_compile,
    _flash_on_this_device,
    _triton_backward_has_a_kernel,
    _triton_backward_tiles_nest,
    _triton_tiles_divide_blocks,
)
from attngym.runner.config.machine import AUTO, _resolve_device, _resolve_world_size
from attngym.runner.config.settings import BLOCK_SIZE_RESOLVERS, TUNED, Settings
from attngym.runner.config.topology import (
    _cuda_graph,
    _kv_heads_divide_heads,
    _simulation,
    _topology_rules,
)
from attngym.runner.config.walker import _build, _check_keys, _check_section, plain

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from attngym.variants.base import Variant


def _workload(data: dict[str, Any]) -> None:
    """workload=documents: its batches can be made (a file read, its lines checked) and the
    attention entry has documents for them to set; the run's own entry becomes its first
    batch's (a factory of yours that takes doc_lengths needs no value of them in the config)."""
    spec = data["workload"]
    if spec["name"] == "none":
        return
    from attngym import workload
    from attngym.variants.spec import with_documents

    top = spec["max_len"]
    if top is not None and top < spec["min_len"]:
        raise ConfigError("workload.max_len", f"{top} is below min_len ({spec['min_len']})")
    try:
        first = workload_batches(data)[0]
    except workload.WorkloadError as err:
        raise ConfigError(f"workload.{err.key}", str(err)) from None
    data["attention"] = with_documents(data["attention"], first)


def workload_batches(data: Mapping[str, Any]) -> list[tuple[int, ...]]:
    """The document lengths of every batch of the config's workload (attngym.workload.batches);
    [] for workload=none."""
    from attngym import workload

    spec = data["workload"]
    if spec["name"] == "none":
        return []
    params = {k: v for k, v in spec.items() if k not in ("name", "distribution", "batches")}
    return workload.batches(spec["distribution"], count=spec["batches"],
                            seq_len=data["shape"]["seq_len"], **params)  # fmt: skip


# The rules on values alone, in this order (check_config and from_config).
VALUE_RULES: tuple[Callable[[dict[str, Any]], None], ...] = (
    _kv_heads_divide_heads,
    _workload,
    _topology_rules,
    _simulation,
    _flash_needs_16_bit,
    _flash_needs_compile,
)
# The rules on resolved values (from_config): those `auto` deferred, and the device's own.
RESOLVED_RULES: tuple[Callable[[dict[str, Any]], None], ...] = (
    _flash_needs_16_bit,
    _triton_tiles_divide_blocks,
    _triton_backward_tiles_nest,
    _triton_backward_has_a_kernel,
    _topology_rules,
    _cuda_graph,
    _flash_on_this_device,
    _flash_is_installed,
)


def _check_values(data: dict[str, Any]) -> Variant:
    """Every check that needs no hardware, on `data` (defaults written in); the built Variant."""
    _check_keys(data)
    _check_section(Settings, data)
    for rule in VALUE_RULES:
        rule(data)
    from attngym.variants.spec import build_variant

    shape = data["shape"]
    return build_variant(
        data["attention"], key="attention", seq_len=shape["seq_len"], heads=shape["heads"]
    )


def check_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Check every value that can be judged without hardware; return the plain dict, defaults
    filled in.

    Args:
        cfg: the composed config as a nested mapping (attngym.runner.overrides.to_plain of Hydra's
        config).

    Raises:
        ConfigError: the first bad value, named by its dotted key.
    """
    data = plain(cfg)
    _check_values(data)
    return data


def _resolve_blocks(
    data: dict[str, Any], device: str, dtype: str, kernel_options: dict[str, Any], variant: str
) -> tuple[tuple[int, int], dict[str, Any]]:
    """The block size on this device (a `flash` or `tuned` name resolved) and the kernel
    options (`tuned` adds the table's, yours win)."""
    names = (data["block_size"]["q"], data["block_size"]["kv"])
    if TUNED in names:
        from attngym import tuning
        from attngym.device import device_info

        blocks, kernel_options = tuning.resolve(
            variant,
            data["shape"]["head_dim"],
            device_info(device)["capability"],
            kernel_options,
            dtype=dtype,
            topology=data["topology"]["kind"],
        )
        return (blocks[0], blocks[1]), kernel_options
    blocks = []
    for side, value in zip(("q", "kv"), names, strict=True):
        if isinstance(value, str):
            value = BLOCK_SIZE_RESOLVERS[value](device)[0 if side == "q" else 1]
            log.info("block_size.%s=%s: %d on %s", side, data["block_size"][side], value, device)
        blocks.append(int(value))
    return (blocks[0], blocks[1]), kernel_options


def _resolve(data: dict[str, Any], variant: str) -> None:
    """Write the machine's values over `auto` and the named block sizes in the checked `data`:
    device, dtype, topology.world_size, block_size (and the kernel options `tuned` adds for the
    `variant` so named, a user's own too)."""
    device = data["device"]["name"] = _resolve_device(data["device"]["name"])
    if data["dtype"] == AUTO:
        from attngym.device import auto_dtype

        data["dtype"] = auto_dtype(device)
    topo = data["topology"]
    if not topo["simulate"]:  # simulated ranks: any number, whatever the GPUs
        topo["world_size"] = _resolve_world_size(topo["kind"], topo["world_size"], device)
    (q, kv), kernel_options = _resolve_blocks(
        data, device, data["dtype"], data["kernel_options"], variant
    )
    data["block_size"] = {"q": q, "kv": kv}
    data["kernel_options"] = kernel_options


def _check_fits(
    data: dict[str, Any], device: str, dtype: str, world_size: int, block_size: tuple[int, int]
) -> dict[str, str]:
    """The run fits the device's memory (and, on a CPU, its cores: one process per rank), judged
    from the shape by attngym.estimate before any tensor exists; the baselines that alone would
    not fit, with why (they are skipped, the run goes on)."""
    from attngym.estimate import available_memory, estimate, format_bytes

    shape = data["shape"]
    have = None  # measured by estimate: free memory
    if "LOCAL_RANK" in os.environ:  # under torchrun: this rank's own GPU, judged as every rank is
        if device == "cuda":
            device = f"cuda:{os.environ['LOCAL_RANK']}"
        have = available_memory(device, total=True)
    result = estimate(
        batch=shape["batch"],
        heads=shape["heads"],
        kv_heads=shape.get("kv_heads"),
        seq_len=shape["seq_len"],
        head_dim=shape["head_dim"],
        dtype=dtype,
        device=device,
        passes=data["passes"],
        baselines=data["baselines"],
        validate_rows=data["validate_rows"] if data["validate"] else 0,
        world_size=world_size,
        block_size=block_size,
        max_mask_bytes=data["baseline_max_mask_bytes"],
        available_bytes=have,
    )
    if not result.fits:
        raise ConfigError(result.key, result.problem.removeprefix(f"{result.key}: "))
    log.info(
        "memory estimate: ~%s of %s %s",
        format_bytes(result.needed_bytes),
        "?" if result.available_bytes is None else format_bytes(result.available_bytes),
        "available"
        if have is None
        else "in all (each rank of torchrun or SLURM judges by the total)",
    )
    return dict(result.skipped_baselines)


def from_config(cfg: Mapping[str, Any]) -> Settings:
    """Check the config, resolve `auto` values on this machine, return the run's Settings.

    Args:
        cfg: the composed config as a nested mapping (attngym.runner.overrides.to_plain of Hydra's
        config).

    Raises:
        ConfigError: a bad value (see check_config) or one this machine cannot run.
    """
    data = plain(cfg)
    variant = _check_values(data)
    _resolve(data, variant.name)
    for rule in RESOLVED_RULES:
        rule(data)
    blocks = (data["block_size"]["q"], data["block_size"]["kv"])
    topo = data["topology"]
    # Simulated ranks hold the whole problem on this one device, as the one-device run does.
    ranks = 1 if topo["simulate"] else topo["world_size"]
    skipped = _check_fits(data, data["device"]["name"], data["dtype"], ranks, blocks)
    return _build(Settings, data, variant=variant, skipped_baselines=skipped)
