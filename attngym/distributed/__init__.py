"""Context-parallel FlexAttention: layouts, transports, ring and all-gather attention, launch.

Importing this package is light: no symmetric memory, cuda.bindings or pynvml. The copy-engine
classes and the NVLink-domain helpers are imported when first used.

Public API:
    shard, unshard, plan, load_imbalance, Layout   sequence layouts (contiguous, zigzag,
                                        double_zigzag, balanced, or a balancer of your own)
    P2PChannel, P2PAllGather, P2PAllToAll    the transport interface over NCCL / gloo
    CopyEngineChannel, CopyEngineAllGather, CopyEngineAllToAll   the same over symmetric memory
    in_one_nvlink_domain, nvlink_domain
    ring_attention, allgather_attention context-parallel attention of sharded q, k, v
    CPOptions, CPStats                  their options and statistics (attngym.distributed.call.cp)
    ulysses_attention, hybrid_attention head-parallel (all-to-all) and all-to-all + ring/all-gather
    check_ulysses_heads                 the heads check a config can run before any tensor work
    TopologySpec, TOPOLOGIES            what the run layer knows of each scheme, by name
    attend_chunk, merge, all_gather     the pieces a scheme of your own is written with (a q chunk
                                        over a kv chunk at global positions, the lse merge, the
                                        K/V all-gather; the channels above for a ring)
"""

from __future__ import annotations

import importlib
from typing import Any

from attngym.distributed import transport  # noqa: F401  (registers kind "transport")
from attngym.distributed.call.cp import CPOptions, CPStats, attend_chunk
from attngym.distributed.call.merge import merge
from attngym.distributed.placement.layout import Layout, load_imbalance, plan, shard, unshard
from attngym.distributed.schemes.allgather import allgather_attention
from attngym.distributed.schemes.hybrid import hybrid_attention
from attngym.distributed.schemes.ring import ring_attention
from attngym.distributed.schemes.spec import TopologySpec
from attngym.distributed.schemes.topologies import TOPOLOGIES
from attngym.distributed.schemes.ulysses import check_ulysses_heads, ulysses_attention
from attngym.distributed.transport import all_gather
from attngym.distributed.transport.p2p import P2PAllGather, P2PAllToAll, P2PChannel

_LAZY = {
    "CopyEngineAllGather": "attngym.distributed.transport.copy_engine",
    "CopyEngineAllToAll": "attngym.distributed.transport.copy_engine",
    "CopyEngineChannel": "attngym.distributed.transport.copy_engine",
    "in_one_nvlink_domain": "attngym.distributed.transport.domain",
    "nvlink_domain": "attngym.distributed.transport.domain",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "TOPOLOGIES",
    "CPOptions",
    "CPStats",
    "CopyEngineAllGather",
    "CopyEngineAllToAll",
    "CopyEngineChannel",
    "Layout",
    "P2PAllGather",
    "P2PAllToAll",
    "P2PChannel",
    "TopologySpec",
    "all_gather",
    "allgather_attention",
    "attend_chunk",
    "check_ulysses_heads",
    "hybrid_attention",
    "in_one_nvlink_domain",
    "load_imbalance",
    "merge",
    "nvlink_domain",
    "plan",
    "ring_attention",
    "shard",
    "ulysses_attention",
    "unshard",
]
