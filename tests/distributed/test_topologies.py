"""Each topology's spec: the config rules it judges without hardware, and the library function
refusing what its spec refuses. Every rejection has its accepted neighbour."""

from __future__ import annotations

import pytest
import torch

from attngym import registry, variants
from attngym.distributed.schemes.topologies import TOPOLOGIES
from attngym.errors import ConfigError

GOOD = dict(heads=4, kv_heads=2, seq_len=512, world_size=2, layout="zigzag", options={})
SHAPE = ("heads", "kv_heads", "seq_len")


def check(name: str, **change):
    """The spec's check of GOOD with `change` (simulate= and fabric= go to the topology)."""
    given = {**GOOD, **change}
    topology = {k: v for k, v in given.items() if k not in SHAPE}
    registry.get("topology", name).check(topology, {k: given[k] for k in SHAPE})


@pytest.mark.parametrize("name", sorted(TOPOLOGIES))
@pytest.mark.parametrize("world_size", [2, None])  # None: `auto`, judged once resolved
def test_every_topology_accepts_a_good_config(name, world_size):
    check(name, world_size=world_size)
    check(name, world_size=world_size, layout="contiguous")


@pytest.mark.parametrize("name", ["ring", "allgather"])
def test_sequence_parallel_topologies_take_the_balanced_layout(name):
    check(name, layout="balanced")


@pytest.mark.parametrize("name", ["ulysses", "hybrid"])
def test_head_parallel_topologies_refuse_the_balanced_layout(name):
    with pytest.raises(ConfigError, match=rf"topology.layout: .*{name} 'balanced'.*zigzag"):
        check(name, layout="balanced")


@pytest.mark.parametrize("name", sorted(TOPOLOGIES))
def test_an_unknown_layout_is_refused_with_the_choices(name):
    with pytest.raises(ConfigError, match=r"topology.layout: .*'zigzga'.*did you mean 'zigzag'"):
        check(name, layout="zigzga")


# auto's candidates judge the sequence length each (a candidate that refuses is left out).
@pytest.mark.parametrize("name", sorted(n for n, s in TOPOLOGIES.items() if not s.chooses))
def test_seq_len_must_split_into_the_layouts_pieces_once_world_size_is_known(name):
    with pytest.raises(ConfigError, match=r"shape.seq_len: seq_len=6 must be divisible by 4"):
        check(name, seq_len=6)  # zigzag over 2 ranks: 4 chunks
    check(name, seq_len=6, layout="contiguous")  # 2 chunks of 3
    check(name, seq_len=6, world_size=None)  # not judged before world_size is known


def test_ulysses_splits_the_heads_over_the_ranks():
    with pytest.raises(ConfigError, match=r"shape.heads: 4 query heads cannot be split over 3"):
        check("ulysses", world_size=3, seq_len=768)
    check("ulysses", world_size=3, seq_len=768, heads=6, kv_heads=3)
    check("ulysses", world_size=None, heads=3, kv_heads=3)  # judged once world_size is known
    with pytest.raises(ConfigError, match=r"shape.kv_heads: 3 must be a positive divisor of"):
        check("ulysses", kv_heads=3)
    check("ulysses", kv_heads=None)  # as many as the query heads


def test_ring_and_allgather_take_any_heads_over_the_ranks():
    for name in ("ring", "allgather"):
        check(name, world_size=3, seq_len=768)  # 4 heads, 3 ranks: sequence-parallel


@pytest.mark.parametrize(
    ("options", "key", "match"),
    [
        ({"a2a_size": 3}, "topology.options.a2a_size", "3 does not divide topology.world_size=4"),
        (
            {"a2a_size": 4, "heads": 2},
            "topology.options.a2a_size",
            "4 does not divide shape.heads=2",
        ),
        ({"a2a_size": 2, "kv_heads": 3}, "shape.kv_heads", "3 must be a positive divisor"),
    ],
)
def test_hybrid_refuses_groups_that_do_not_split(options, key, match):
    heads = options.pop("heads", 4)
    kv_heads = options.pop("kv_heads", 2)
    with pytest.raises(ConfigError, match=rf"{key}: {match}") as err:
        check("hybrid", world_size=4, heads=heads, kv_heads=kv_heads, options=options)
    assert err.value.key == key


@pytest.mark.parametrize(
    "options",
    [
        {"a2a_size": 2, "across": "allgather"},
        {"a2a_size": 4, "across": "ring"},
        {"a2a_size": None},  # one NVLink domain per group, judged on the ranks
        {},  # the function's defaults
    ],
)
def test_hybrid_accepts_groups_that_split(options):
    check("hybrid", world_size=4, options=options)


def test_hybrid_judges_the_group_size_against_the_ranks_only_once_known():
    check("hybrid", world_size=None, options={"a2a_size": 3}, heads=6, kv_heads=3)
    with pytest.raises(
        ConfigError, match="topology.options.a2a_size: 3 does not divide topology.world"
    ):
        check("hybrid", world_size=4, options={"a2a_size": 3}, heads=6, kv_heads=3)


def test_options_of_another_topology_are_not_a_topologys_business():
    check("ring", options={"a2a_size": 3, "across": "allgather"})


@pytest.mark.parametrize("fn", ["ulysses_attention", "hybrid_attention"])
def test_head_parallel_functions_refuse_a_balanced_layout_by_name(fn):
    """Before anything else (no process group here): the layout, what it got and the choices."""
    import attngym.distributed

    q = torch.zeros(1, 2, 8, 4)
    with pytest.raises(
        ValueError, match=rf"^layout: {fn} takes one of contiguous, zigzag.*'balanced'"
    ):
        getattr(attngym.distributed, fn)(q, q, q, variants.get("causal"), layout="balanced")
    # An allowed layout passes that check and meets the next one.
    with pytest.raises(RuntimeError, match="initialised process group"):
        getattr(attngym.distributed, fn)(q, q, q, variants.get("causal"), layout="zigzag")


def test_each_spec_states_its_transfer_timer_and_sequence_shards():
    from types import SimpleNamespace

    topology, shape = SimpleNamespace(world_size=4), {"heads": 4, "kv_heads": None}
    shards = {
        name: spec.sequence_shards(topology, shape)
        for name, spec in TOPOLOGIES.items()
        if name != "hybrid" and not spec.chooses
    }
    # ulysses: whole sequence per rank; a user's scheme: one shard per rank
    assert shards == {"ring": 4, "allgather": 4, "ulysses": 1, "custom": 4}
    assert TOPOLOGIES["hybrid"].transfer_ms(None, None, 1.0, 1) is None  # no one step to time
    assert all(TOPOLOGIES[n].timer is not None for n in ("ring", "allgather", "ulysses"))


def test_the_spec_module_imports_nothing_heavy_at_module_level():
    """Its checks need no torch (the sequence-length rule imports the layout module inside)."""
    import ast
    from pathlib import Path

    import attngym.distributed.schemes.spec as spec

    tree = ast.parse(Path(spec.__file__).read_text())
    top = {
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for node in tree.body
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert top == {"__future__", "dataclasses", "collections.abc", "typing", "attngym.errors"}
