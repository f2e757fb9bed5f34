"""What a context-parallel run (attngym.tasks.context_parallel) and its simulated ranks
(attngym.tasks.cp_simulate) take alike from the settings: the run's TopologySpec, its kernel
choices, its device, the scheme's metrics and the imbalance of the placement it uses."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from attngym import registry
from attngym.config import Settings
from attngym.distributed.cp import CPOptions
from attngym.inputs import torch_dtype

if TYPE_CHECKING:
    from attngym.distributed.spec import TopologySpec


def spec_of(settings: Settings) -> TopologySpec:
    """The run's topology spec (attngym.distributed.topologies, from the registry; `custom`
    bound to topology.scheme)."""
    topo = settings.topology
    return registry.get("topology", topo.kind).bind(topo.scheme, topo.scheme_args)


def scheme_options(settings: Settings) -> dict[str, Any]:
    """The topology's own options (its attention function's keywords), its defaults filled."""
    return spec_of(settings).option_values(settings.topology.options)


def cp_options(settings: Settings) -> CPOptions:
    """The run's kernel choices, as every scheme's call takes them."""
    return CPOptions(
        block_size=tuple(settings.block_size),
        kernel_options=settings.kernel_options or None,
        timeout_s=settings.topology.timeout_s,
        compile=settings.compile,
        compile_mode=settings.compile_mode,
    )


def scheme_metrics(settings: Settings) -> dict[str, Any]:
    """The topology's options, and a custom topology's scheme path, as metrics."""
    topo = settings.topology
    bound = registry.get("topology", topo.kind).binder is not None
    return {**scheme_options(settings), **({"scheme": topo.scheme} if bound else {})}


def rank_device(settings: Settings) -> torch.device:
    """This process's device for the run: its current GPU (a rank's, which launch sets), else
    the CPU."""
    if settings.device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def placement_imbalance(spec, settings: Settings, layout, variant, shards: int, device) -> dict:
    """load_imbalance (blocks) and load_time_imbalance (the placement's predicted time for this
    scheme's kernels) of the placement the CP call uses among `shards` sequence shards (1.0 for
    head-parallel schemes, whose every rank attends the whole sequence)."""
    from attngym.distributed import layout as layouts

    if shards == 1:
        return {"load_imbalance": 1.0, "load_time_imbalance": 1.0}
    shape, seq_len = settings.shape, settings.shape.seq_len
    used = layouts.plan(layout, shards, seq_len)
    kernels = spec.kernel_pricing(shape.batch * shape.heads, device)
    return {
        "load_imbalance": layouts.load_imbalance(
            used, variant, shards, seq_len, settings.block_size, device
        ),
        "load_time_imbalance": layouts.time_imbalance(
            used, variant, shards, seq_len, settings.block_size, device, kernels
        ),
    }


def kv_needed(settings: Settings, layout, variant, shards: int, device) -> dict:
    """bytes_needed: the most K/V bytes any rank's queries read from other ranks' shards (whole
    blocks of the mask), beside bytes_moved; None for head-parallel schemes (every rank attends
    the whole sequence) and layouts whose chunks are not whole blocks."""
    from attngym.distributed import layout as layouts
    from attngym.distributed.grid import kv_bytes_needed

    shape = settings.shape
    if shards != settings.topology.world_size:
        return {"bytes_needed": None}
    itemsize = torch.empty((), dtype=torch_dtype(settings.dtype)).element_size()
    kv_heads = shape.kv_heads or shape.heads
    row = 2 * shape.batch * kv_heads * shape.head_dim * itemsize
    used = layouts.plan(layout, shards, shape.seq_len)
    needed = kv_bytes_needed(variant, used, settings.block_size, device, kv_row_bytes=row)
    return {"bytes_needed": needed}
