"""`auto` on this machine, as far as `Settings` needs it when made: the device, the world size.

Below the types (settings.py), which resolve an `auto` left in a field when made; so `Auto` is
stated here, and which topologies spread the sequence over ranks (asked of their specs through
attngym.registry), which the world size, the topology rules and `ranks_asked` all need. The rest
of the resolution (block sizes, the memory fit) runs on the checked data in resolve.py.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from typing import Any, Literal

from attngym.errors import ConfigError

log = logging.getLogger(__name__)

Auto = Literal["auto"]  # resolved on the machine that runs: device, dtype, world_size
AUTO: Auto = "auto"


def _topology_specs() -> dict[str, Any]:
    """Every context-parallel topology's spec by kind (attngym.distributed's table), unbound."""
    from attngym import registry

    return {kind: registry.get("topology", kind) for kind in registry.names("topology")}


def _topology_spec(topo: Mapping[str, Any]) -> Any | None:
    """The spec a topology section runs (a `custom` one bound to its topology.scheme), or None
    for a kind that runs on one device."""
    spec = _topology_specs().get(topo["kind"])
    return None if spec is None else spec.bind(topo["scheme"], topo["scheme_args"])


def _spread(kind: str) -> bool:
    """Whether topology `kind` spreads the sequence over ranks (has a spec)."""
    return kind in _topology_specs()


def _option_names() -> list[str]:
    """Every topology's option names (their specs' options dataclasses)."""
    specs = _topology_specs().values()
    return sorted({f.name for s in specs if s.options for f in dataclasses.fields(s.options)})


def _resolve_device(name: str) -> str:
    """`device.name` resolved by attngym.device.resolve_device (the one resolver): cpu | cuda."""
    from attngym.device import resolve_device

    try:
        return resolve_device(name).type
    except ValueError as err:
        raise ConfigError("device.name", str(err)) from None


# topology.world_size=auto on a CPU: two ranks (gloo), enough to exercise every exchange.
CPU_RANKS = 2


def ranks_asked(topology: Mapping[str, Any], gpus: int) -> int:
    """How many ranks a run of this `topology` section starts, known before it runs (the SLURM
    launcher asks for resources by it): 1 on one device or simulated, else its world_size, with
    `auto` resolved as on the machine that runs it: `gpus` where it lends GPUs, else CPU_RANKS."""
    if topology.get("simulate") or not _spread(str(topology.get("kind"))):
        return 1
    size = topology.get("world_size", AUTO)
    if size == AUTO:
        return gpus if gpus > 0 else CPU_RANKS
    return int(size)


def _resolve_world_size(kind: str, value: Any, device: str) -> int:
    """auto → 1 on one device; torchrun's WORLD_SIZE when launched by it; GPU count; 2 on CPU.

    Without a launcher, more ranks than GPUs fail here (the one check of the rule) unless
    TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 lets ranks share GPUs.
    """
    if not _spread(kind):
        return 1
    env = os.environ.get("WORLD_SIZE")
    if env is not None:
        launched = int(env)
        if value != AUTO and value != launched:
            raise ConfigError(
                "topology.world_size",
                f"{value} but the launcher started {launched} ranks (WORLD_SIZE); "
                "use auto or the launcher's count",
            )
        return launched
    if device == "cuda":
        import torch

        count = torch.cuda.device_count()
        if value == AUTO:
            log.info("topology.world_size=auto: %d GPUs", count)
            if count < 1:
                raise ConfigError("topology.world_size", f"resolved to {count}; need at least 1")
            return count
        overlap = os.environ.get("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES") == "1"
        if value > count and not overlap:  # overlap: a protocol test of several ranks per GPU
            raise ConfigError(
                "topology.world_size",
                f"{value} ranks but this machine has {count} GPUs; use at most {count} "
                "(or torchrun for several nodes; TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 "
                "shares GPUs between ranks to test the copy-engine protocol)",
            )
        return value
    if value == AUTO:
        log.info("topology.world_size=auto: %d ranks on cpu", CPU_RANKS)
        return CPU_RANKS
    return value
