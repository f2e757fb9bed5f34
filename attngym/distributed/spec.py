"""What the rest of attngym knows of a context-parallel topology: one `TopologySpec` per algorithm.

Each algorithm module states its own (ring.RING, allgather.ALLGATHER, ulysses.ULYSSES and
ulysses.HYBRID): the library function, the layouts and topology.* options it takes, the rules a
config must meet before any rank starts, how its step's transfer is timed alone and how many
sequence shards its ranks attend apart. attngym.distributed.topologies lists them, and the config
checks, the context-parallel task, the scripts and the tests ask that table, never the name.

Importing this module is light (no torch): the checks need no hardware and no process group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from attngym.errors import ConfigError, choice_error

# (heads=, kv_heads=, seq_len=, world_size=, layout=, options=) -> None; raises ConfigError.
Rule = Callable[..., None]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TopologySpec:
    """One context-parallel algorithm as the run layer sees it.

    Attributes:
        name: the topology.kind that selects it (and its task's name).
        attention: the library function: (q, k, v, variant, *, group, transport, layout,
            options or CPOptions fields as keywords, stats, **this spec's options) -> out shard.
        layouts: the layouts it takes (attngym.distributed.layout).
        options: its own topology.* keys, passed to `attention` as keywords of the same name.
        rules: its config rules beyond the layout and the sequence length (see `check`).
        timer: (transport, k_s, timeout_s, repeats) -> ms of each step's transfer alone, on the
            ranks (collective); None where no one step moves the data alone (hybrid).
        shards: (settings) -> the sequence shards the ranks attend apart, on the ranks (may be
            collective); None: one per rank.
        pair_kernels: it runs one kernel per (q chunk, kv chunk) pair, so its `balanced`
            placement prices pieces per pair kernel (layout.PairKernels); else by the blocks of
            one call per rank.
    """

    name: str
    attention: Callable[..., Any]
    layouts: tuple[str, ...]
    options: tuple[str, ...] = ()
    rules: tuple[Rule, ...] = ()
    timer: Callable[..., list[float]] | None = None
    shards: Callable[[Any], int] | None = None
    pair_kernels: bool = False

    def check(
        self,
        *,
        heads: int,
        kv_heads: int | None,
        seq_len: int,
        world_size: int | None,
        layout: str,
        options: Mapping[str, Any],
    ) -> None:
        """Every rule of this topology that needs no hardware and no process group.

        Args:
            heads, kv_heads: shape.heads and shape.kv_heads (None: as many as heads).
            seq_len: shape.seq_len.
            world_size: topology.world_size; None while it is `auto` (the rules that need it
                are judged once it is resolved).
            layout: topology.layout.
            options: topology.<key> for this spec's `options` (a key left out takes the
                function's default; keys it does not name are not its business).

        Raises:
            ConfigError: naming the dotted key (topology.layout, shape.heads, shape.kv_heads,
                topology.a2a_size, topology.across, shape.seq_len), the value and what is allowed.
        """
        if layout not in self.layouts:
            raise ConfigError(
                "topology.layout", choice_error(f"layout for {self.name}", layout, self.layouts)
            )
        mine = {key: options[key] for key in self.options if key in options}
        for rule in self.rules:
            rule(
                heads=heads,
                kv_heads=kv_heads,
                seq_len=seq_len,
                world_size=world_size,
                layout=layout,
                options=mine,
            )
        if world_size is not None:
            from attngym.distributed.layout import check_seq_len

            try:
                check_seq_len(seq_len, world_size, layout)
            except ValueError as err:
                raise ConfigError("shape.seq_len", str(err)) from None

    def placement(
        self, layout: str, world_size: int, seq_len: int, variant, *, batch_heads: int, device
    ) -> Any:
        """What this topology's calls and the run's shards are given for `layout`: the name, or
        for `balanced` the one Layout planned for this topology's kernels (a call given the name
        would plan by blocks; shard, unshard and the call must see the same placement)."""
        if layout != "balanced":
            return layout
        from attngym.distributed import layout as layouts

        kernels = layouts.pair_kernels(batch_heads, device) if self.pair_kernels else None
        return layouts.resolve(layout, world_size, seq_len, variant, device, kernels)

    def transfer_ms(self, transport, k_s, timeout_s: float, repeats: int) -> list[float] | None:
        """Each step's transfer alone, in ms, `repeats` times over (collective on the ranks), with
        this rank's K shard `k_s` standing for K and V; None where the topology has no one step
        to time."""
        if self.timer is None:
            return None
        return self.timer(transport, k_s, timeout_s, repeats)

    def sequence_shards(self, settings: Any) -> int:
        """How many shards of the sequence the ranks attend apart (load_imbalance is judged among
        them), from the run's settings; on the ranks, and collective for hybrid. 1: every rank
        attends the whole sequence for some heads, balanced whatever the layout."""
        if self.shards is None:
            return settings.topology.world_size
        return self.shards(settings)
