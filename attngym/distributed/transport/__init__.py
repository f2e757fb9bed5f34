"""Which transport moves the K/V shards: one place resolves `auto|copy_engine|nccl|gloo`.

    copy_engine  CopyEngineChannel / AllGather / AllToAll / Exchange (symmetric memory, CUDA,
                 one NVLink domain)
    nccl         P2PChannel / AllGather / AllToAll / Exchange over NCCL (CUDA)
    gloo         P2PChannel / AllGather / AllToAll / Exchange over gloo (CPU)
    auto         copy_engine on CUDA ranks inside one NVLink domain, nccl on other CUDA ranks, gloo
                 on CPU; the choice is logged.

An explicit choice never falls back: copy_engine on CPU or across NVLink domains, nccl on CPU and
gloo on CUDA raise ConfigError naming the key (`transport`, or `topology.transport` from a task).
Each transport is registered in attngym.registry under kind "transport"; its factory returns its
classes. Transport objects hold buffers (symmetric memory is a collective allocation), so
`cached` keeps one per (class, shapes, dtype, device, group) for the life of the process group.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from attngym import registry
from attngym.errors import ConfigError, choice_error

log = logging.getLogger(__name__)

TRANSPORTS = ("auto", "copy_engine", "nccl", "gloo")


@dataclasses.dataclass(frozen=True)
class Transport:
    """A resolved transport: its name and the classes sharing the copy-engine interface."""

    name: str
    channel: type
    allgather: type
    alltoall: type | None = None  # the all-to-all (Ulysses); every registered transport has one
    exchange: type | None = None  # the uneven exchange (the all-gather's exact K/V); likewise


@registry.register("transport", "copy_engine")
def copy_engine_transport() -> Transport:
    """Copy-engine pushes into symmetric memory (CUDA, one NVLink domain)."""
    from attngym.distributed.transport.copy_engine import (
        CopyEngineAllGather,
        CopyEngineAllToAll,
        CopyEngineChannel,
        CopyEngineExchange,
    )

    return Transport(
        "copy_engine", CopyEngineChannel, CopyEngineAllGather, CopyEngineAllToAll,
        CopyEngineExchange,
    )  # fmt: skip


@registry.register("transport", "nccl")
def nccl_transport() -> Transport:
    """torch.distributed P2P and collectives over NCCL (CUDA)."""
    from attngym.distributed.transport.p2p import P2PAllGather, P2PAllToAll, P2PChannel, P2PExchange

    return Transport("nccl", P2PChannel, P2PAllGather, P2PAllToAll, P2PExchange)


@registry.register("transport", "gloo")
def gloo_transport() -> Transport:
    """torch.distributed P2P and collectives over gloo (CPU)."""
    from attngym.distributed.transport.p2p import P2PAllGather, P2PAllToAll, P2PChannel, P2PExchange

    return Transport("gloo", P2PChannel, P2PAllGather, P2PAllToAll, P2PExchange)


def check_transport(name: str, device: torch.device | str, *, key: str = "transport") -> None:
    """The checks that need no collective: a known name that can move tensors on `device`.

    Raises:
        ConfigError(key, ...): unknown name, or a transport that cannot run on this device type.
    """
    if name not in TRANSPORTS:
        raise ConfigError(key, choice_error("transport", name, TRANSPORTS))
    kind = torch.device(device).type
    allowed = {"cuda": ("auto", "copy_engine", "nccl"), "cpu": ("auto", "gloo")}.get(kind)
    if allowed is None:
        raise ConfigError(key, f"no transport for device type {kind!r}; use cpu or cuda")
    if name not in allowed:
        raise ConfigError(
            key,
            f"transport {name!r} cannot move {kind} tensors; on {kind} choose one of: "
            f"{', '.join(allowed)}",
        )


def resolve_transport(
    name: str, device: torch.device | str, group=None, *, key: str = "transport"
) -> Transport:
    """Resolve `name` for `device`; collective on CUDA for auto/copy_engine (NVLink check).

    Args:
        name: auto | copy_engine | nccl | gloo.
        device: where the shards live.
        group: the ranks that exchange shards (default: the world).
        key: the config key named in errors.

    Returns:
        The Transport (its channel and all-gather classes).
    """
    check_transport(name, device, key=key)
    memo = (name, torch.device(device).type, id(group))
    if memo in _RESOLVED:
        return registry.build("transport", _RESOLVED[memo])
    chosen = name
    if torch.device(device).type == "cpu":
        chosen = "gloo"
    elif name in ("auto", "copy_engine"):
        from attngym.distributed.transport.domain import in_one_nvlink_domain

        one_domain = in_one_nvlink_domain(group)
        if name == "copy_engine" and not one_domain:
            raise ConfigError(
                key,
                "transport 'copy_engine' needs every rank in one NVLink domain and these ranks "
                "span several; choose one of: auto, nccl",
            )
        chosen = "copy_engine" if one_domain else "nccl"
    if chosen == "nccl" and _cuda_backend(group) != "nccl":
        raise ConfigError(
            key,
            "transport 'nccl' needs one GPU per rank (an NCCL group), and these ranks share GPUs "
            "over gloo; choose copy_engine (several ranks on one GPU is a protocol test only)",
        )
    if name == "auto":
        log.info("transport=auto resolved to %r on %s", chosen, torch.device(device).type)
    _RESOLVED[memo] = chosen
    return registry.build("transport", chosen)


def _cuda_backend(group) -> str:
    """The process group's backend for CUDA tensors ("nccl", or "gloo" when ranks share a GPU)."""
    import torch.distributed as dist

    backend = dist.get_backend(group)
    if ":" in backend:  # "cpu:gloo,cuda:nccl"
        return dict(part.split(":") for part in backend.split(","))["cuda"]
    return backend


# Resolutions per (name, device type, group): the NVLink check is a collective, done once.
_RESOLVED: dict[tuple, str] = {}

_CACHE: dict[tuple, Any] = {}


def cached(cls: type, *args: Any, group=None, tag: str = "", **kwargs: Any) -> Any:
    """One transport object per (class, arguments, group, tag), built on first use.

    `tag` tells apart objects with equal arguments used for different streams of data (the ring's
    K/V and dK/dV channels).

    Every rank of `group` must ask for the same objects in the same order (construction may be
    collective). `clear_cache()` drops them, e.g. before the process group is destroyed.
    """
    key = (cls, args, tuple(sorted(kwargs.items(), key=lambda kv: kv[0])), id(group), tag)
    if key not in _CACHE:
        _CACHE[key] = cls(*args, group=group, **kwargs)
    return _CACHE[key]


def clear_cache() -> None:
    """Forget cached channels, all-gathers and resolutions (before a group is destroyed)."""
    _CACHE.clear()
    _RESOLVED.clear()


def all_gather(
    parts: list[torch.Tensor], *, group=None, transport: str = "auto", timeout_s: float = 60.0
) -> torch.Tensor:
    """Every rank's `parts` (tensors of one shape (B, G, n, D)) gathered along the sequence in
    rank order: one (len(parts), B, G, P·n, D) tensor, differentiable (its backward reduce-
    scatters the gradients home). The all-gather the built-in schemes use, for a scheme of
    your own; collective over `group` (default: the world), on the resolved `transport`."""
    like = parts[0]
    chosen = resolve_transport(transport, like.device, group)
    gather = cached(
        chosen.allgather, tuple(like.shape), len(parts), 2, dtype=like.dtype, device=like.device,
        timeout_s=timeout_s, group=group,
    )  # fmt: skip
    gather.start(list(parts))
    out = gather.wait(list(parts))
    saved = torch.is_grad_enabled() and any(p.requires_grad for p in parts)
    if getattr(gather, "OUTPUT_REUSED", True) and saved:
        out = out.clone()  # the transport's buffer belongs to its next call; autograd keeps this
    return out
