"""What the rest of attngym knows of a context-parallel topology: one `TopologySpec` per scheme.

Each scheme's module states its own (ring.RING, allgather.ALLGATHER, ulysses.ULYSSES and
hybrid.HYBRID; a user's scheme through attngym.distributed.schemes.custom): the library function,
the layouts and the typed options it takes, the rules a config must meet before any rank starts, how
its step's transfer is timed alone, how many sequence shards its ranks attend apart, and how its
ranks are simulated and priced. attngym.distributed.schemes.topologies lists them, and the config
checks, the context-parallel task, the simulated ranks, the scripts and the tests ask that table,
never the name.

Importing this module is light (no torch): the checks need no hardware and no process group.
The library never reads the run layer's Settings: a spec is asked with the topology and shape
sections as plain mappings (the config's dicts) or objects with those fields (`section`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from attngym.errors import ConfigError, choice_error

# (heads=, kv_heads=, seq_len=, world_size=, layout=, options=, simulate=) -> None; raises
# ConfigError naming the dotted key.
Rule = Callable[..., None]
# (topology, shape), each a mapping of its config section's fields.
Sections = Callable[[Mapping[str, Any], Mapping[str, Any]], Any]


def section(fields: Any) -> Mapping[str, Any]:
    """A config section as a mapping: the config's own dict, or an object with the fields."""
    return fields if isinstance(fields, Mapping) else vars(fields)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TopologySpec:
    """One context-parallel scheme as the run layer sees it.

    Attributes:
        name: the topology.kind that selects it (and its task's name).
        attention: the library function, called on every rank with this rank's shards:
            (q, k, v, variant, *, group, layout, transport, options (CPOptions), stats,
            **its options) -> this rank's output shard, differentiable.
        layouts: the layouts it takes by name (attngym.distributed.placement.layout).
        user_layouts: it also takes a user's balancer (topology.layout=module.function).
        options: its own typed config, a dataclass whose fields are `topology.options.<field>`
            (checked by the config's walker from their types) and reach `attention` as keywords
            of the same name; None: it has none.
        rules: its config rules beyond the layout and the sequence length (see `check`).
        timer: (transport, k_s, timeout_s, repeats) -> ms of each step's transfer alone, on the
            ranks (collective); None where no one step moves the data alone (hybrid).
        shards: (topology, shape) -> the sequence shards the ranks attend apart, on the ranks
            (may be collective); None: one per rank.
        pair_kernels: it runs one kernel per (q chunk, kv chunk) pair, so its `balanced`
            placement prices pieces per pair kernel (layout.PairKernels); else by the blocks of
            one call per rank.
        step_kernels: it runs one kernel per (q shard, kv shard) pair, a ring step over shards
            of several chunks, so its `balanced` placement prices those (PairKernels.shards).
        simulate: (simulate.SimulatedCall) -> simulate.Simulation: every rank's work, timed on
            one device through the call's clock; None: it cannot be simulated.
        price: (Simulation, transfer_model.Fabric, backward) -> transfer_model.Prediction: the
            call on a fabric, its transfers overlapped as the scheme overlaps them.
        binder: (scheme, scheme_args) -> the TopologySpec a run of those settings uses (the
            `custom` entry binds a user's scheme); None: this spec itself.
        chooses: it picks another topology for each run, which then runs (`auto`: the run
            layer's attngym.runner.tasks.cp_auto simulates and prices the candidates); its own
            `attention` is never called.
        fills_stats: its calls count their pairs and bytes into the CPStats they are given;
            False for a user's scheme function, which may not: counts it left at 0 are not
            reported (null), not measured zeros.
        pickable: `auto` simulates it as a candidate (`auto.candidates`).
        option_sets: (topology, shape) -> the options `auto` tries it with, each a mapping of
            its option fields (the rest at their defaults); None: its defaults only.
    """

    name: str
    attention: Callable[..., Any]
    layouts: tuple[str, ...]
    user_layouts: bool = False
    options: type | None = None
    rules: tuple[Rule, ...] = ()
    timer: Callable[..., list[float]] | None = None
    shards: Sections | None = None
    pair_kernels: bool = False
    step_kernels: bool = False
    simulate: Callable[..., Any] | None = None
    price: Callable[..., Any] | None = None
    binder: Callable[..., TopologySpec] | None = None
    chooses: bool = False
    fills_stats: bool = True
    pickable: bool = False
    option_sets: Sections | None = None

    def bind(
        self, scheme: Any = None, scheme_args: Mapping[str, Any] | None = None
    ) -> TopologySpec:
        """The spec a run with topology.scheme / topology.scheme_args uses (read by `custom`
        only; the built-ins ignore them, so one sweep may set them for every topology)."""
        if self.binder is None:
            return self
        return self.binder(scheme, dict(scheme_args or {}))

    def option_values(self, given: Mapping[str, Any] | None) -> dict[str, Any]:
        """This spec's options from topology.options (already type-checked), its defaults for
        those left out; keys of other topologies' options are not its business."""
        if self.options is None:
            return {}
        given = given or {}
        fields = [f.name for f in dataclasses.fields(self.options)]
        return dataclasses.asdict(self.options(**{k: given[k] for k in fields if k in given}))

    def takes_layout(self, layout: Any) -> bool:
        """Whether `layout` (a name, or a user's balancer path) is one this scheme takes."""
        from attngym.distributed.placement.layout import is_user_layout

        return layout in self.layouts or (self.user_layouts and is_user_layout(layout))

    def check(self, topology: Any, shape: Any) -> None:
        """Every rule of this topology that needs no hardware and no process group.

        Args:
            topology: the topology section (`section`): world_size (an int; None or `auto` while
                unresolved: the rules that need it are judged once it is), layout, options (this
                spec's keys; one left out takes its default), simulate and fabric (simulated
                ranks: its NVLink domains size hybrid's groups); simulate and fabric may be left
                out (false).
            shape: the shape section: heads, kv_heads (None: as many as heads), seq_len.

        Raises:
            ConfigError: naming the dotted key (topology.layout, shape.heads, shape.kv_heads,
                topology.options.<key>, topology.simulate, shape.seq_len), the value and what
                is allowed.
        """
        topology, shape = section(topology), section(shape)
        world_size = topology["world_size"]
        world_size = world_size if isinstance(world_size, int) else None
        layout, simulate = topology["layout"], bool(topology.get("simulate", False))
        heads, kv_heads, seq_len = shape["heads"], shape["kv_heads"], shape["seq_len"]
        fabric = topology.get("fabric") if simulate else None
        if not self.takes_layout(layout):
            allowed = (*self.layouts, "module.function") if self.user_layouts else self.layouts
            raise ConfigError(
                "topology.layout", choice_error(f"layout for {self.name}", layout, allowed)
            )
        if simulate and not self.chooses and (self.simulate is None or self.price is None):
            missing = " and ".join(
                name for name in ("simulate", "price") if getattr(self, name) is None
            )
            raise ConfigError(
                "topology.simulate",
                f"topology {self.name} declares no {missing}: simulated ranks need a "
                "TopologySpec with simulate= and price= (README: Your own scheme)",
            )
        from attngym.distributed.model.transfer_model import domain_size

        mine = self.option_values(topology.get("options"))
        for rule in self.rules:
            rule(
                heads=heads,
                kv_heads=kv_heads,
                seq_len=seq_len,
                world_size=world_size,
                layout=layout,
                options=mine,
                simulate=simulate,
                domain_size=None if fabric is None else domain_size(fabric),
            )
        if world_size is not None and not self.chooses:  # the picks check theirs
            from attngym.distributed.placement.layout import check_seq_len

            try:
                check_seq_len(seq_len, world_size, layout)
            except ValueError as err:
                raise ConfigError("shape.seq_len", str(err)) from None

    def placement(
        self,
        layout: str,
        world_size: int,
        seq_len: int,
        variant,
        *,
        batch_heads: int,
        device,
        block_size=(128, 128),
    ) -> Any:
        """What this topology's calls and the run's shards are given for `layout`: the name of
        a fixed one (contiguous, zigzag, double_zigzag), or the one Layout planned for this
        topology (balanced, priced for its kernels; a user's balancer, called once): shard,
        unshard and the call must see the same placement."""
        from attngym.distributed.placement import layout as layouts

        if layout in layouts.FIXED_LAYOUTS:
            return layout

        kernels = self.kernel_pricing(batch_heads, device)
        try:
            return layouts.resolve(
                layout, world_size, seq_len, variant, device, kernels, block_size=block_size
            )
        except ConfigError as err:  # a user's balancer: named by its config key
            if err.key != "layout":
                raise
            raise ConfigError("topology.layout", str(err).removeprefix("layout: ")) from err

    def kernel_pricing(self, batch_heads: int, device):
        """How `balanced` prices this topology's kernels on `device` (layout.PairKernels), or
        None: by the blocks of one call per rank."""
        from attngym.distributed.placement import layout as layouts

        if not (self.pair_kernels or self.step_kernels):
            return None
        return layouts.pair_kernels(batch_heads, device, shards=self.step_kernels)

    def transfer_ms(self, transport, k_s, timeout_s: float, repeats: int) -> list[float] | None:
        """Each step's transfer alone, in ms, `repeats` times over (collective on the ranks), with
        this rank's K shard `k_s` standing for K and V; None where the topology has no one step
        to time."""
        if self.timer is None:
            return None
        return self.timer(transport, k_s, timeout_s, repeats)

    def sequence_shards(self, topology: Any, shape: Any) -> int:
        """How many shards of the sequence the ranks attend apart (the imbalance is judged among
        them), from the topology and shape sections; on the ranks, and collective for hybrid.
        1: every rank attends the whole sequence for some heads, balanced whatever the layout."""
        topology, shape = section(topology), section(shape)
        if self.shards is None:
            return topology["world_size"]
        return self.shards(topology, shape)

    def options_to_try(self, topology: Any, shape: Any) -> list[dict[str, Any]]:
        """The option sets `auto` simulates this scheme with (`option_sets`; its defaults)."""
        if self.option_sets is None:
            return [{}]
        return [dict(own) for own in self.option_sets(section(topology), section(shape))]
