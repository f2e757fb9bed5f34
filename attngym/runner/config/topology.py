"""Rules between fields of the shape and the topology: kv heads against heads, the topology's
own rules (its spec's `check`), simulated ranks, CUDA graphs.

One function each, on the checked data (a value still `auto` is judged once resolved), listed in
resolve.py's VALUE_RULES and RESOLVED_RULES. What a topology takes is asked of its spec through
attngym.registry: no kind is matched by name here, and nothing of attngym.distributed imported.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from attngym.errors import ConfigError, choice_error
from attngym.runner.config.machine import (
    AUTO,
    _option_names,
    _spread,
    _topology_spec,
    _topology_specs,
)
from attngym.runner.config.settings import MAX_SIMULATED_RANKS, Topology
from attngym.runner.config.walker import _check_section


def _kv_heads_divide_heads(data: dict[str, Any]) -> None:
    """GQA: every key/value head serves the same number of query heads."""
    heads, kv_heads = data["shape"]["heads"], data["shape"]["kv_heads"]
    if kv_heads is not None and heads % kv_heads:
        raise ConfigError(
            "shape.kv_heads",
            f"{kv_heads} does not divide shape.heads={heads}; use a divisor of {heads}",
        )


def _topology_rules(data: dict[str, Any]) -> None:
    """The topology's own rules (its spec's check: layouts, its options, heads, seq_len against
    the ranks once they are known; a `custom` one bound to its scheme first); one rank, and any
    topology's layout, on one device."""
    topo, shape = data["topology"], data["shape"]
    _check_option_keys(topo["options"])
    kind, world_size, layout = topo["kind"], topo["world_size"], topo["layout"]
    spec = _topology_spec(topo)
    if spec is not None:
        if spec.options is not None:
            _check_section(spec.options, topo["options"], "topology.options.")
        spec.check(topo, shape)
        return
    if world_size not in (1, AUTO):
        raise ConfigError(
            "topology.world_size", f"must be 1 (or auto) for topology {kind}, got {world_size}"
        )
    default = next(f.default for f in dataclasses.fields(Topology) if f.name == "layout")
    if layout != default and not any(s.takes_layout(layout) for s in _topology_specs().values()):
        # unused here; a sweep may set it for every topology alike
        layouts = sorted({name for s in _topology_specs().values() for name in s.layouts})
        raise ConfigError("topology.layout", choice_error("layout", layout, layouts))


def _check_option_keys(options: Mapping[str, Any]) -> None:
    """Every key of topology.options is some topology's option (a sweep may set one topology's
    options for all); else the one it most likely means."""
    known = _option_names()
    for key in options:
        if key not in known:
            raise ConfigError(
                f"topology.options.{key}", choice_error("topology option", key, known)
            )


def _simulation(data: dict[str, Any]) -> None:
    """topology.simulate: a context-parallel topology, an explicit number of ranks, a fabric
    with its numbers (custom) or a measured transport (h200_nvlink); what the scheme itself
    needs to be simulated is its spec's check."""
    topo = data["topology"]
    custom = topo["fabric"] == "custom"
    for key in ("fabric_gbps", "fabric_latency_us"):
        if not custom and topo[key] is not None:
            raise ConfigError(
                f"topology.{key}", f"is read only with topology.fabric=custom, got {topo[key]!r}"
            )
    if not topo["simulate"]:
        return
    if not _spread(topo["kind"]):
        raise ConfigError(
            "topology.simulate",
            f"simulates the ranks of a context-parallel topology, not topology={topo['kind']}",
        )
    size = topo["world_size"]
    if size == AUTO or not 2 <= size <= MAX_SIMULATED_RANKS:
        raise ConfigError(
            "topology.world_size",
            f"topology.simulate=true takes the ranks to simulate, 2 to {MAX_SIMULATED_RANKS}, "
            f"got {size!r}",
        )
    if custom and (not topo["fabric_gbps"] or topo["fabric_latency_us"] is None):
        raise ConfigError(
            "topology.fabric_gbps",
            "topology.fabric=custom needs topology.fabric_gbps > 0 and "
            f"topology.fabric_latency_us, got {topo['fabric_gbps']!r} and "
            f"{topo['fabric_latency_us']!r}",
        )
    measured = ("h200_nvlink", "hgx_h200")
    if topo["fabric"] in measured and topo["transport"] not in (AUTO, "copy_engine", "nccl"):
        raise ConfigError(
            "topology.transport",
            f"fabric={topo['fabric']} is measured for copy_engine and nccl (auto: copy_engine "
            f"inside one NVLink domain, nccl across), got {topo['transport']!r}",
        )


def _cuda_graph(data: dict[str, Any]) -> None:
    """topology.cuda_graph: a context-parallel call on CUDA, its transfers on the device (gloo
    moves tensors through the host, which a CUDA graph cannot capture)."""
    topo, device = data["topology"], str(data["device"]["name"])
    if not topo["cuda_graph"]:
        return
    if not _spread(topo["kind"]):
        raise ConfigError(
            "topology.cuda_graph",
            f"captures a context-parallel call, not topology={topo['kind']}; use "
            "topology.cuda_graph=false",
        )
    if not device.startswith("cuda"):
        raise ConfigError(
            "topology.cuda_graph",
            f"captures CUDA work, but device={device}; use device=cuda or "
            "topology.cuda_graph=false",
        )
    if topo["transport"] == "gloo" and not topo["simulate"]:
        raise ConfigError(
            "topology.transport",
            "gloo moves tensors through the host, which a CUDA graph cannot capture; with "
            "topology.cuda_graph=true use copy_engine, nccl or auto",
        )
