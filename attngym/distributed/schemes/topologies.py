"""The context-parallel topologies by name: the one table the run layer asks.

Each entry is the TopologySpec its algorithm module exports, registered in attngym.registry
under kind "topology" as the spec object itself (`registry.get("topology", "ring")` is RING; it is
not a factory, so `registry.build` does not apply). The context-parallel task registers one task
per name here, and the config checks a topology through its spec.

A new topology is its module in attngym/distributed/schemes/ exporting its function and its
spec (its options, rules, simulation and pricing with it), its conf/topology/<name>.yaml and its
tests: the table is read from the modules of this folder, so nothing here changes. The order is
the schemes' (alphabetical; auto tries the pickable in it), then `custom`, a user's scheme bound
from topology.scheme (TopologySpec.bind; attngym.distributed.schemes.custom), then `auto`, which
picks one of the others and runs it (TopologySpec.chooses; attngym.distributed.schemes.auto,
attngym.runner.tasks.cp_auto).
"""

from __future__ import annotations

import importlib
import pkgutil

from attngym import registry
from attngym.distributed import schemes
from attngym.distributed.schemes.spec import TopologySpec


def _specs() -> list[TopologySpec]:
    """Every TopologySpec a module of this folder exports (once each, whoever imports it)."""
    found: dict[str, TopologySpec] = {}
    for info in sorted(pkgutil.iter_modules(schemes.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{schemes.__name__}.{info.name}")
        for value in vars(module).values():
            if isinstance(value, TopologySpec):
                found.setdefault(value.name, value)
    return sorted(found.values(), key=lambda s: (s.chooses, s.binder is not None, s.name))


TOPOLOGIES: dict[str, TopologySpec] = {spec.name: spec for spec in _specs()}

for _spec in TOPOLOGIES.values():
    registry.register("topology", _spec.name)(_spec)
