"""What a context-parallel run is, worked out once from the settings: `CPRun`.

The CP task (attngym.runner.tasks.context_parallel), its simulated ranks
(attngym.runner.tasks.cp_simulate) and auto's candidates (attngym.runner.tasks.cp_auto) make one
`CPRun.of(settings)` when they start and hand it down: the bound TopologySpec, the scheme's option
values, the kernel choices, and how the placement is planned and judged. The library is asked with
plain sections (the topology and shape as mappings), never with the Settings.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from attngym import registry
from attngym.distributed.call.cp import CPOptions
from attngym.distributed.schemes.spec import TopologySpec
from attngym.inputs import torch_dtype
from attngym.runner.config import Settings


@dataclasses.dataclass(frozen=True, kw_only=True)
class CPRun:
    """One context-parallel run as every phase sees it (made by `of`, one per process).

    Attributes:
        settings: the run's checked settings.
        spec: the topology's spec from the registry (`custom` bound to topology.scheme).
        scheme_options: the topology's own options (its attention function's keywords), its
            defaults filled.
        options: the run's kernel choices, as every scheme's call takes them.
        bound: the spec was bound from topology.scheme (a user's scheme: its path is a metric).
    """

    settings: Settings
    spec: TopologySpec
    scheme_options: dict[str, Any]
    options: CPOptions
    bound: bool

    @classmethod
    def of(cls, settings: Settings) -> CPRun:
        topo = settings.topology
        entry = registry.get("topology", topo.kind)
        spec = entry.bind(topo.scheme, topo.scheme_args)
        return cls(
            settings=settings,
            spec=spec,
            scheme_options=spec.option_values(topo.options),
            options=CPOptions(
                block_size=tuple(settings.block_size),
                kernel_options=settings.kernel_options or None,
                timeout_s=topo.timeout_s,
                compile=settings.compile,
                compile_mode=settings.compile_mode,
            ),
            bound=entry.binder is not None,
        )

    def on_rank(self) -> torch.device:
        """This process's device for the run: its current GPU (a rank's, which launch sets),
        else the CPU."""
        if self.settings.device == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def check(self) -> None:
        """The topology's rules (TopologySpec.check) on the run's sections, and its layouts' on
        the variant (documents: the variant names its documents), auto's candidates too."""
        from attngym.distributed.placement import layout as layouts

        topo, variant = self.settings.topology, self.settings.variant
        self.spec.check(topo, self.settings.shape)
        layouts.check_applies(topo.layout, variant)
        for layout in topo.options.get("layouts") or ():
            layouts.check_applies(layout, variant, key="topology.options.layouts")

    def metrics(self) -> dict[str, Any]:
        """The topology's options, and a custom topology's scheme path, as metrics."""
        scheme = {"scheme": self.settings.topology.scheme} if self.bound else {}
        return {**self.scheme_options, **scheme}

    def sequence_shards(self) -> int:
        """The sequence shards the ranks attend apart (TopologySpec.sequence_shards; on the
        ranks, collective for hybrid)."""
        return self.spec.sequence_shards(self.settings.topology, self.settings.shape)

    def placement(self, variant, device, world_size: int | None = None) -> Any:
        """The layout the shards and every call get (TopologySpec.placement) over `world_size`
        ranks (default topology.world_size)."""
        s = self.settings
        return self.spec.placement(
            s.topology.layout, world_size or s.topology.world_size, s.shape.seq_len, variant,
            batch_heads=s.shape.batch * s.shape.heads, device=device, block_size=s.block_size,
        )  # fmt: skip

    def placement_imbalance(self, layout, variant, shards: int, device) -> dict[str, float]:
        """load_imbalance (blocks) and load_time_imbalance (the placement's predicted time for
        this scheme's kernels) of the placement the CP call uses among `shards` sequence shards
        (1.0 for head-parallel schemes, whose every rank attends the whole sequence)."""
        from attngym.distributed.placement import layout as layouts

        if shards == 1:
            return {"load_imbalance": 1.0, "load_time_imbalance": 1.0}
        s = self.settings
        seq_len = s.shape.seq_len
        used = layouts.plan(layout, shards, seq_len)
        kernels = self.spec.kernel_pricing(s.shape.batch * s.shape.heads, device)
        return {
            "load_imbalance": layouts.load_imbalance(
                used, variant, shards, seq_len, s.block_size, device
            ),
            "load_time_imbalance": layouts.time_imbalance(
                used, variant, shards, seq_len, s.block_size, device, kernels
            ),
        }

    def kv_needed(self, layout, variant, shards: int, device) -> dict[str, int | None]:
        """bytes_needed: the most K/V bytes any rank's queries read from other ranks' shards
        (whole blocks of the mask), beside bytes_moved; None for head-parallel schemes (every
        rank attends the whole sequence) and layouts whose chunks are not whole blocks."""
        from attngym.distributed.placement import layout as layouts
        from attngym.distributed.placement.grid import kv_bytes_needed

        s, shape = self.settings, self.settings.shape
        if shards != s.topology.world_size:
            return {"bytes_needed": None}
        itemsize = torch.empty((), dtype=torch_dtype(s.dtype)).element_size()
        kv_heads = shape.kv_heads or shape.heads
        row = 2 * shape.batch * kv_heads * shape.head_dim * itemsize
        used = layouts.plan(layout, shards, shape.seq_len)
        needed = kv_bytes_needed(variant, used, s.block_size, device, kv_row_bytes=row)
        return {"bytes_needed": needed}
