"""A variant read through position maps: local query rows and keys at given global positions.

The all-gather attends a rank's shard rows to keys gathered from several shards, and PyTorch's CP
(torch_cp) rewrites its mask the same way, so both read each local index through a map to its
global position: an added offset (a 0-d tensor) where the rows are one run, else a position
table. The variant's closed-form block rule reads global positions; `mapped_block_rule` moves it
to the local indices, so such block masks are built without evaluating every pair.
"""

from __future__ import annotations

import dataclasses

import torch

from attngym import kernels
from attngym.variants.base import Variant


def at_positions(
    variant: Variant,
    q_positions: torch.Tensor,
    kv_positions: torch.Tensor,
    device,
    name: str,
    *,
    tables: bool = False,
    offsets_as_tables: bool = False,
) -> Variant:
    """The variant over local query rows and keys at these global positions.

    Query row i is global position q_map(i), key j is kv_map(j) (key j is at kv_positions[j]);
    each map is an offset (a 0-d tensor) or a position table, so the callbacks stay tensor-only
    and one compiled kernel serves every rank. A map that is the identity (offset 0) is left
    out, so at world size 1 the callbacks are the variant's own and the kernel is the one-device
    call's (an added 0 still costs a load and an add per score). `tables`: always a table
    lookup (PyTorch's CP form, for its contender); `offsets_as_tables`: a map that is an offset
    other than 0 is a table too (kernels.offsets_as_tables). The block rule is moved with them
    (`mapped_block_rule`).
    """
    q_at = _mapper(_index_map(q_positions, tables, offsets_as_tables), device, "q")
    kv_at = _mapper(_index_map(kv_positions, tables, offsets_as_tables), device, "kv")
    if q_at is None and kv_at is None:
        # The variant's own callbacks and buffers; a copy, so that a memo keyed weakly by the
        # variant (the all-gather's) holds no reference to its key.
        return dataclasses.replace(variant, name=name)
    score_mod, mask_mod = kernels.mapped_mods(variant, q_at or _identity, kv_at or _identity)
    return dataclasses.replace(
        variant,
        name=name,
        score_mod=score_mod,
        mask_mod=mask_mod,
        buffers={},
        bind=None,
        seq_len=None,
        block_rule=mapped_block_rule(
            variant.block_rule, q_positions.to(device), kv_positions.to(device)
        ),
    )


@dataclasses.dataclass(frozen=True)
class BackwardMaps:
    """How a mapped call's query rows and keys reach their global positions, as flex's backward
    op takes them (flex_backward.attend_backward): both as offsets when each side is one run of
    positions, else both as int32 tables."""

    q_offset: int = 0
    kv_offset: int = 0
    q_positions: torch.Tensor | None = None
    kv_positions: torch.Tensor | None = None


def backward_maps(q_positions: torch.Tensor, kv_positions: torch.Tensor) -> BackwardMaps:
    """The BackwardMaps of queries at `q_positions` against keys at `kv_positions`."""
    q_map, kv_map = _index_map(q_positions), _index_map(kv_positions)
    if isinstance(q_map, int) and isinstance(kv_map, int):
        return BackwardMaps(q_map, kv_map)
    return BackwardMaps(
        q_positions=q_positions.to(torch.int32), kv_positions=kv_positions.to(torch.int32)
    )


def mapped_block_rule(rule, q_positions: torch.Tensor, kv_positions: torch.Tensor):
    """The variant's block rule (Variant.block_rule, over global positions) for callbacks that
    read local indices through position tables: a block whose rows (or keys) are consecutive
    positions is classed by the rule at those positions; any other block is partial, so its
    mask is evaluated entry by entry (exact, never skipped). The chunked layouts' blocks are all
    consecutive when the chunks are whole blocks. None when the variant has no rule."""
    if rule is None:
        return None

    def local_rule(q_lo, q_hi, kv_lo, kv_hi):
        q_first, q_last = q_positions[q_lo], q_positions[q_hi]
        kv_first, kv_last = kv_positions[kv_lo], kv_positions[kv_hi]
        classes = rule(q_first, q_last, kv_first, kv_last)
        runs = _consecutive(q_positions, q_lo, q_hi) & _consecutive(kv_positions, kv_lo, kv_hi)
        return torch.where(runs, classes, torch.ones_like(classes))

    return local_rule


def _consecutive(positions: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Per block [lo, hi]: whether positions rise by exactly 1 from each row to the next."""
    steps = torch.diff(positions, prepend=positions[:1] - 1) == 1  # steps[i]: i-1 -> i is +1
    broken = torch.cumsum(~steps, dim=0)  # breaks up to and including row i
    return broken[hi] == broken[lo]


def _identity(idx):
    return idx


def _mapper(index_map, device, role: str):
    """A local index's global position: a table lookup, an added offset, or None (offset 0)."""
    if isinstance(index_map, torch.Tensor):
        table = index_map

        def at(idx):
            return table[idx]

    elif index_map == 0:
        return None
    else:
        offset = kernels.position(index_map, torch.device(device), role)

        def at(idx):
            return idx + offset

    return at


def _index_map(positions: torch.Tensor, tables: bool = False, offsets_as_tables: bool = False):
    """How a local index becomes a global position: an int offset, or the table itself (always
    with `tables`; for any offset but 0 with `offsets_as_tables`)."""
    if tables:
        return positions
    start = int(positions[0])
    run = torch.arange(start, start + positions.numel(), device=positions.device)
    if torch.equal(positions, run) and (not offsets_as_tables or start == 0):
        return start
    # int32 under FLASH, as kernels.position_table's
    return positions.to(torch.int32) if offsets_as_tables else positions
