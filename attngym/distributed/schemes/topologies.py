"""The context-parallel topologies by name: the one table the run layer asks.

Each entry is the TopologySpec its algorithm module exports, registered in attngym.registry
under kind "topology" as the spec object itself (`registry.get("topology", "ring")` is RING; it is
not a factory, so `registry.build` does not apply). The context-parallel task registers one task
per name here, and the config checks a topology through its spec.

A new topology: its module in attngym/distributed/ exporting its function and its spec (its
options, rules, simulation and pricing with it), one entry in TOPOLOGIES here, its
conf/topology/<name>.yaml, and its tests. `custom` is a user's scheme, bound from
topology.scheme (TopologySpec.bind; attngym.distributed.schemes.custom); `auto` picks one of the
others and runs it (TopologySpec.chooses; attngym.distributed.schemes.auto,
attngym.runner.tasks.cp_auto).
"""

from __future__ import annotations

from attngym import registry
from attngym.distributed.schemes.allgather import ALLGATHER
from attngym.distributed.schemes.auto import AUTO
from attngym.distributed.schemes.custom import CUSTOM
from attngym.distributed.schemes.hybrid import HYBRID
from attngym.distributed.schemes.ring import RING
from attngym.distributed.schemes.spec import TopologySpec
from attngym.distributed.schemes.ulysses import ULYSSES

TOPOLOGIES: dict[str, TopologySpec] = {
    spec.name: spec for spec in (RING, ALLGATHER, ULYSSES, HYBRID, CUSTOM, AUTO)
}

for _spec in TOPOLOGIES.values():
    registry.register("topology", _spec.name)(_spec)
