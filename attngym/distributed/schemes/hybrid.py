"""Hybrid context parallelism: Ulysses inside groups of ranks, ring or all-gather across them.

TransformerEngine's `cp_comm_type=a2a+p2p` and USP's (Fang and Zhao, 2024, arXiv:2405.07719)
two-level scheme, composed of the public pieces of attngym.distributed.schemes.ulysses (the
exchange, the head plan) and of the across scheme (ring_attention or allgather_attention, its spec).

Contract (W ranks, groups of a = a2a_size consecutive ranks): the all-to-all runs inside the
group, giving H/a heads of the group's part of the sequence; that part is exactly the group's
shard of the sequence cut for g = W/a ranks in the same layout (for zigzag too, see
`hybrid_attention`), so ring_attention or allgather_attention over the g ranks holding the same
head slice finishes the job, and the inverse all-to-all brings the output back. Streams, buffers
and their lifetimes are those of the two schemes it composes.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Mapping
from typing import Any, Literal, get_args

import torch

from attngym import kernels
from attngym.distributed.call.cp import CPOptions, CPStats, options_from
from attngym.distributed.model.simulate import SimulatedCall, Simulation
from attngym.distributed.model.transfer_model import Fabric, Prediction, RankWork, bottleneck
from attngym.distributed.placement import layout as layouts
from attngym.distributed.schemes.spec import TopologySpec
from attngym.distributed.schemes.ulysses import (
    alltoall_rank_ms,
    check_layout,
    check_ulysses_heads,
    exchange,
    exchange_bytes,
    head_plan,
    heads_config_error,
    price_ulysses,
    simulate_ulysses,
)
from attngym.errors import ConfigError
from attngym.variants.base import Variant

# The algorithm among hybrid attention's groups (ranks holding the same head slice).
Across = Literal["ring", "allgather"]
ACROSS = get_args(Across)
# The layouts whose group shards compose (see hybrid_attention).
HYBRID_LAYOUTS = ("contiguous", "zigzag")


# Default group -> {(ranks of the group, a2a_size): (a2a group, across group)}: kept for the life
# of the default group (a re-initialised one starts afresh).
_SUBGROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _subgroups(group_key: tuple[int, ...], a2a_size: int):
    """(a2a group, across group) of this rank: its block and its stride of `group_key`.

    The whole job: every rank creates every block and stride, in one order (new_group's plain
    protocol). A subgroup of the job (the context-parallel ranks of one data-parallel replica,
    say): only the members of each group create it (local synchronisation), so every rank of the
    job must have created the same number of groups before (PyTorch names such groups by it),
    and the default group must not be bound to a device (PyTorch then splits a communicator
    over every rank).
    """
    import torch.distributed as dist

    memo = _SUBGROUPS.setdefault(dist.group.WORLD, {})
    if (group_key, a2a_size) not in memo:
        ranks, me = list(group_key), dist.get_rank()
        blocks = [ranks[i : i + a2a_size] for i in range(0, len(ranks), a2a_size)]
        strides = [ranks[i::a2a_size] for i in range(a2a_size)]
        if len(ranks) == dist.get_world_size():
            made = [(g, dist.new_group(g)) for g in blocks + strides]
        else:
            made = [
                (g, dist.new_group(g, use_local_synchronization=True))
                for g in blocks + strides
                if me in g
            ]
        mine = [group for g, group in made if me in g]
        memo[group_key, a2a_size] = (mine[0], mine[1])  # this rank's block, then its stride
    return memo[group_key, a2a_size]


def hybrid_groups(a2a_size: int | None, group=None):
    """The (a2a group, across group) of this rank for hybrid attention; collective on the first
    call for a group and a2a_size (every rank makes it), remembered after.

    Groups are consecutive ranks of `group` (rank r's shard must be shard r of the layout, and
    consecutive shards are what compose, see hybrid_attention), checked against the NVLink domain
    (attngym.distributed.transport.domain): each a2a group must lie in one domain. a2a_size None
    takes the ranks of this rank's domain (the host where no NVLink fabric is known).

    Raises:
        ValueError: naming `a2a_size` when it does not divide the world size, or a group would
            span NVLink domains, or (None) the domains are not equal blocks of consecutive ranks.
    """
    import torch.distributed as dist

    if a2a_size is not None and (
        isinstance(a2a_size, bool) or not isinstance(a2a_size, int) or a2a_size < 1
    ):
        raise ValueError(f"a2a_size: expected a positive int or None, got {a2a_size!r}")
    # The NVLink domains are gathered (a collective, a host sync on NCCL) once per group and
    # a2a_size, not on every call: a group's ranks do not move.
    world = dist.get_world_size(group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    chosen = _HYBRID_GROUPS.setdefault(dist.group.WORLD, {})
    key = (tuple(ranks), a2a_size)
    if key not in chosen:
        chosen[key] = _hybrid_groups(a2a_size, group, ranks)
    return chosen[key]


# Default group -> {(ranks of the group, a2a_size): (a2a group, across group)}, as _SUBGROUPS.
_HYBRID_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _hybrid_groups(a2a_size: int | None, group, ranks: list[int]):
    import torch.distributed as dist

    from attngym.distributed.transport.domain import nvlink_domain

    world = len(ranks)
    if a2a_size is not None and world % a2a_size:
        raise ValueError(f"a2a_size: {a2a_size} does not divide the world size {world}")
    domains: list[str | None] = [None] * world
    dist.all_gather_object(domains, nvlink_domain(), group=group)
    if a2a_size is None:
        a2a_size = domains.count(domains[0])
        blocks_ok = all(domains[i] == domains[i - i % a2a_size] for i in range(world))
        if world % a2a_size or not blocks_ok:
            raise ValueError(
                f"a2a_size: None takes one NVLink domain per group, but the domains are not equal "
                f"blocks of consecutive ranks ({domains}); set a2a_size explicitly"
            )
    for start in range(0, world, a2a_size):
        if len(set(domains[start : start + a2a_size])) > 1:
            raise ValueError(
                f"a2a_size: the group of ranks {start}..{start + a2a_size - 1} spans NVLink "
                f"domains {sorted(set(domains[start : start + a2a_size]))}; choose a size that "
                "keeps each group inside one domain"
            )
    return _subgroups(tuple(ranks), a2a_size)


def hybrid_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    variant: Variant,
    *,
    a2a_size: int | None = None,
    across: Across = "ring",
    group=None,
    transport: str = "auto",
    layout: str = "contiguous",
    options: CPOptions | None = None,
    stats: CPStats | None = None,
    **overrides: Any,
) -> torch.Tensor:
    """Ulysses inside groups of a2a_size consecutive ranks, ring or all-gather across the groups.

    Why it composes: with W ranks in groups of a (g = W/a groups), group j holds shards
    j·a .. j·a + a - 1. Contiguous: their union is [j·S/g, (j+1)·S/g), group j's contiguous shard
    for g ranks. Zigzag (2W chunks): member i holds chunks j·a + i and 2W-1-j·a-i, so the group
    holds zigzag chunks j and 2g-1-j for g ranks, member i's pieces at positions i and 2a-1-i of
    them: the zigzag order over a ranks. So the in-group all-to-all (layout order over a ranks)
    yields the group's shard for g ranks in the same layout, of H/a heads, and ring_attention or
    allgather_attention among the g ranks with the same head slice finishes it.

    Collective over `group`. Arguments as in ulysses_attention, except that every CPOptions
    field is honoured: `backward` chooses the ring's or all-gather's backward across the groups.

    Args:
        a2a_size: ranks per all-to-all group (a divisor of the world size; a must divide H);
            None: one NVLink domain per group (hybrid_groups).
        across: ring | allgather, the algorithm among the groups.
        transport: for the all-to-all and for the ring/all-gather (auto picks per group).

    Returns:
        (B, H, S/W, D) this rank's output shard, differentiable w.r.t. q, k, v. stats.lse is
        left None.
    """
    import torch.distributed as dist

    from attngym.distributed.schemes.allgather import allgather_attention
    from attngym.distributed.schemes.ring import ring_attention

    check_layout("hybrid_attention", layout, HYBRID_LAYOUTS)
    opts = options_from(options, **overrides)
    if across not in ACROSS:
        raise ValueError(f"across: expected one of {', '.join(ACROSS)}, got {across!r}")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("hybrid attention needs an initialised process group")
    world = dist.get_world_size(group)
    layouts.check_seq_len(q.shape[2] * world, world, layout)
    variant.check_seq_len(q.shape[2] * world)
    a2a_group, across_group = hybrid_groups(a2a_size, group)
    fn = ring_attention if across == "ring" else allgather_attention

    tables = kernels.offsets_as_tables(opts.kernel_options)

    def attend(q_h, k_h, v_h, variant_d, head_offset):
        heads = q_h.shape[1] if tables else None
        shifted, _ = head_plan(variant_d, head_offset, heads, None, None, "across", q.device)
        return fn(
            q_h,
            k_h,
            v_h,
            shifted,
            group=across_group,
            transport=transport,
            layout=layout,
            options=opts,
            stats=stats,
        )

    out = exchange(
        q,
        k,
        v,
        variant,
        attend,
        group=a2a_group,
        transport=transport,
        layout=layout,
        timeout_s=opts.timeout_s,
        stats=stats,
    )
    if stats is not None:
        # The across call's lse is of this rank's head slice over its group's sequence, not of
        # this rank's shard: like ulysses_attention, hybrid reports none.
        stats.lse = None
    return out


def _across(options: Mapping[str, Any]) -> TopologySpec:
    """The spec of hybrid's algorithm among the groups (a composition calls the other scheme's
    public pieces, importing its module directly)."""
    if options["across"] == "ring":
        from attngym.distributed.schemes.ring import RING

        return RING
    from attngym.distributed.schemes.allgather import ALLGATHER

    return ALLGATHER


def simulate_hybrid(sc: SimulatedCall) -> Simulation:
    """The across scheme over the P / a2a_size groups on one group's head slice (H / a2a_size
    heads; every member of a group does the same work), and the in-group exchange's bytes as
    Ulysses counts them over a2a_size ranks; one group: Ulysses itself."""
    P = sc.world_size
    a2a_size = simulated_a2a_size(sc.scheme_options["a2a_size"], P, sc.domain_size)
    if a2a_size is None or P % a2a_size:
        raise ValueError(
            f"a2a_size: simulated hybrid needs a divisor of world_size={P} (no NVLink domains to "
            f"take it from), got {a2a_size!r}"
        )
    b, h, seq_len, d = sc.q.shape
    check_ulysses_heads(h, sc.k.shape[1], a2a_size)
    groups = P // a2a_size
    if groups == 1:
        return simulate_ulysses(sc.replace(world_size=a2a_size))
    replicas = math.lcm(sc.k.shape[1], a2a_size) // sc.k.shape[1]
    k_rep, v_rep = (t.repeat_interleave(replicas, dim=1) for t in (sc.k, sc.v))
    ha, ra = h // a2a_size, k_rep.shape[1] // a2a_size
    across = _across(sc.scheme_options)
    inner = across.simulate(
        sc.replace(
            q=sc.q[:, :ha].contiguous(), k=k_rep[:, :ra].contiguous(),
            v=v_rep[:, :ra].contiguous(), world_size=groups,
            grad_out=None if sc.grad_out is None else sc.grad_out[:, :ha].contiguous(),
            scheme_options=across.option_values({}),
        )
    )  # fmt: skip
    qkv, out = exchange_bytes(b, h, k_rep.shape[1], seq_len // P, d, sc.q.element_size())
    keep = (a2a_size - 1) / a2a_size
    inner.extra["exchange"] = RankWork(
        fwd_ms=(), fwd_bytes=(qkv * keep,), tail_fwd_bytes=out * keep
    )
    inner.extra["across"] = across
    inner.extra["a2a_size"] = a2a_size
    inner.extra.pop("alternatives", None)  # the across scheme's own: hybrid runs it at defaults
    inner.stride = a2a_size  # the across scheme's ranks, a2a_size apart
    inner.bytes_moved += int((qkv + out) * keep)
    inner.pairs_computed *= a2a_size
    inner.pairs_skipped *= a2a_size
    inner.world_size = P
    return inner


def simulated_a2a_size(a2a_size: int | None, world_size: int, domain_size: int | None):
    """The group size simulated: the one given, else one NVLink domain of the fabric (all the
    ranks when they fit in one), else None."""
    if a2a_size is not None or domain_size is None:
        return a2a_size
    return min(world_size, domain_size)


def price_hybrid(sim: Simulation, fab: Fabric, backward: bool) -> Prediction:
    """The in-group all-to-alls (their bytes, no compute) around the across scheme's call,
    priced as that scheme prices it over the groups; one group: Ulysses' price."""
    if "across" not in sim.extra:
        return price_ulysses(sim, fab, backward)
    across = sim.extra["across"].price(sim, fab, backward)
    exchange = sim.extra["exchange"]
    crossing = fab.collective_crossing(sim.extra["a2a_size"])
    extra_fwd = alltoall_rank_ms(exchange, fab, False, crossing)
    extra_both = alltoall_rank_ms(exchange, fab, True, crossing)
    # The in-group exchanges lengthen each rank's device timeline; its host time stays.
    fwd_only = sim.extra["across"].price(sim, fab, False) if backward else across
    fwd = [max(h, d + extra_fwd) for h, d in zip(fwd_only.rank_host_ms, fwd_only.rank_device_ms,
                                                   strict=True)]  # fmt: skip
    device = tuple(d + (extra_both if backward else extra_fwd) for d in across.rank_device_ms)
    totals = tuple(max(h, d) for h, d in zip(across.rank_host_ms, device, strict=True))
    slowest = max(range(len(totals)), key=totals.__getitem__)
    return Prediction(
        fwd_ms=max(fwd),
        fwd_bwd_ms=max(totals) if backward else None,
        rank_ms=totals,
        rank_compute_ms=across.rank_compute_ms,
        bottleneck=bottleneck(totals[slowest], across.rank_compute_ms, device[slowest]),
        rank_host_ms=across.rank_host_ms,
        rank_device_ms=device,
    )


@dataclasses.dataclass(frozen=True)
class HybridOptions:
    """hybrid's own options: topology.options.<field>, hybrid_attention's keywords."""

    a2a_size: int | None = None
    """Ranks per all-to-all group, consecutive ranks dividing world_size and shape.heads; None
    takes one NVLink domain per group, found on the ranks."""
    across: Across = "ring"
    """The algorithm among the groups (the ranks holding the same head slice)."""


def _hybrid_groups_split(
    *,
    heads: int,
    kv_heads: int | None,
    world_size: int | None,
    options: Mapping[str, Any],
    simulate: bool,
    domain_size: int | None = None,
    **_: Any,
) -> None:
    """Hybrid: the all-to-all groups split the ranks and the query heads evenly (K/V heads are
    repeated as Ulysses does). a2a_size None is judged on the ranks, where the NVLink domains
    are known (hybrid_sequence_shards); simulated ranks take the fabric's domain (domain_size)
    or need it given."""
    key = "topology.options.a2a_size"
    a2a_size = options["a2a_size"]
    if simulate and world_size is not None:
        a2a_size = simulated_a2a_size(a2a_size, world_size, domain_size)
    if a2a_size is None:
        if simulate:
            raise ConfigError(
                key,
                "topology.simulate=true with topology=hybrid needs the group size, got null "
                "(topology.fabric has no NVLink domains to take it from: give it, or use "
                "fabric=hgx_h200 or nvl72)",
            )
        return
    if world_size is not None and world_size % a2a_size:
        raise ConfigError(
            key,
            f"{a2a_size} does not divide topology.world_size={world_size}; use a divisor of "
            f"{world_size} (or null: one NVLink domain per group)",
        )
    if heads % a2a_size:
        raise ConfigError(
            key,
            f"{a2a_size} does not divide shape.heads={heads}; each group splits the heads over "
            "its ranks, use a common divisor of the heads and the world size",
        )
    try:
        check_ulysses_heads(heads, kv_heads, a2a_size)
    except ValueError as err:
        raise heads_config_error(err) from None


def hybrid_sequence_shards(topology: Mapping[str, Any], shape: Mapping[str, Any]) -> int:
    """The groups of a hybrid run (collective: a2a_size None is resolved from the NVLink domains):
    every member of a group attends the group's whole shard for its head slice. A group size the
    domains or the heads refuse is a ConfigError on every rank alike (exit 2, as before launch)."""
    import torch.distributed as dist

    options = HYBRID.option_values(topology["options"])
    try:
        a2a_group, across_group = hybrid_groups(options["a2a_size"])
        check_ulysses_heads(shape["heads"], shape["kv_heads"], dist.get_world_size(a2a_group))
    except ValueError as err:
        raise heads_config_error(err) from None
    return dist.get_world_size(across_group)


def hybrid_option_sets(topology: Mapping[str, Any], shape: Mapping[str, Any]) -> list[dict]:
    """What auto tries: on a fabric without NVLink domains to fix the groups, every group size
    dividing the ranks and the heads (2 .. P/2) with each across scheme; else the defaults."""
    from attngym.distributed.model.transfer_model import domain_size

    if domain_size(topology["fabric"]) is not None:
        return [{}]
    P, heads = topology["world_size"], shape["heads"]
    sizes = [a for a in range(2, P) if P % a == 0 and heads % a == 0]
    return [{"a2a_size": a, "across": across} for a in sizes for across in ACROSS]


# Two levels of transfers (all-to-all in a group, ring or all-gather across): no one step to time
# alone.
HYBRID = TopologySpec(
    name="hybrid",
    attention=hybrid_attention,
    layouts=HYBRID_LAYOUTS,
    options=HybridOptions,
    rules=(_hybrid_groups_split,),
    shards=hybrid_sequence_shards,
    simulate=simulate_hybrid,
    price=price_hybrid,
    option_sets=hybrid_option_sets,
    pickable=True,
)
