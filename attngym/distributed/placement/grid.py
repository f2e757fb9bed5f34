"""The whole sequence's block grid: which (q block, kv block) tiles a variant keeps, for any mask.

Every plan of a sequence-sharded scheme is a question about this one grid: which chunk pairs are
skipped and their block masks (`GridPlans`), which K/V rows a rank reads from another
(`kv_bytes_needed`), how a placement balances (attngym.distributed.placement.layout). It is built
once per variant, sequence length, block size and device (`block_grid`, memoised), so a user's own
mask, which has no closed-form block rule, is evaluated once over the sequence and never again per
pair, per rank or per step:

    * a variant with a block rule (causal, windows, documents, and their compositions): the rule
      over the block ranges, a few operations per tile;
    * any other mask: `create_block_mask` eagerly over bands of query rows, each band at most
      kernels.COMPILED_MASK_ENTRIES entries (no compile: a compiled creation costs seconds per
      new shape, and a whole 128K x 128K mask evaluated at once would need 16 GiB).

Like every block mask here, the grid is the mask at batch 0 and head 0.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from attngym import kernels
from attngym.variants.base import Variant

# Variant -> {(seq_len, block_size, device): (partial, full)}.
_GRIDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Variant -> {(seq_len, block_size, device): GridPlans}.
_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def block_grid(
    variant: Variant, seq_len: int, block_size, device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(partial, full): (S/bq, S/bkv) bool grids of the tiles the variant's mask keeps partly
    and wholly, on `device`; None for a variant without a mask (every tile full). Memoised."""
    if variant.mask_mod is None:
        return None
    key = (seq_len, tuple(block_size), str(torch.device(device)))
    per = _GRIDS.setdefault(variant, {})
    if key not in per:
        per[key] = _build_grid(variant, seq_len, tuple(block_size), torch.device(device))
    return per[key]


def _build_grid(variant: Variant, seq_len: int, block, device) -> tuple[torch.Tensor, ...]:
    bq, bkv = block
    if variant.device is not None and variant.device != device:
        variant = variant.to(device)  # its lookup tables where the mask is evaluated
    if variant.block_rule is not None:  # read off the rule: no BlockMask to build and read back
        classes = kernels.rule_classes(variant.block_rule, seq_len, seq_len, 0, 0, block, device)
        return classes == 1, classes == 2
    from torch.nn.attention.flex_attention import create_block_mask

    band = max(bq, kernels.COMPILED_MASK_ENTRIES // seq_len // bq * bq)
    partial, full = [], []
    for start in range(0, seq_len, band):
        rows = min(band, seq_len - start)
        _, mask_mod = kernels.shifted_mods(variant, start, 0, device)
        with torch.no_grad():
            mask = create_block_mask(
                mask_mod, None, None, rows, seq_len, device=device, BLOCK_SIZE=block,
                _compile=False,
            )  # fmt: skip
        p, f = _grid_of(mask, -(-seq_len // bkv))
        partial.append(p)
        full.append(f)
    return torch.cat(partial), torch.cat(full)


def _grid_of(mask, n_kv: int) -> tuple[torch.Tensor, torch.Tensor]:
    partial = dense_blocks(mask.kv_num_blocks, mask.kv_indices, n_kv)
    full = (
        torch.zeros_like(partial)
        if mask.full_kv_num_blocks is None
        else dense_blocks(mask.full_kv_num_blocks, mask.full_kv_indices, n_kv)
    )
    return partial, full


def dense_blocks(num: torch.Tensor, idx: torch.Tensor, n_kv: int) -> torch.Tensor:
    """(rows, n_kv) bool: the blocks a (1, 1, rows) count and (1, 1, rows, K) index table keep."""
    num, idx = num[0, 0].long(), idx[0, 0].long()
    valid = torch.arange(idx.shape[-1], device=idx.device)[None, :] < num[:, None]
    out = torch.zeros((idx.shape[0], n_kv + 1), dtype=torch.bool, device=idx.device)
    out.scatter_(1, torch.where(valid, idx, n_kv), True)
    return out[:, :n_kv]


def kv_bytes_needed(
    variant: Variant, layout, block_size, device, *, kv_row_bytes: int
) -> int | None:
    """The most K/V bytes any rank's queries read from the other ranks' shards in `layout`
    (whole kv blocks of the grid): what a scheme moving only what the mask reads would move in
    one forward. kv_row_bytes: the bytes of one sequence row of K and V together (2·B·G·D·itemsize).
    None when the layout's chunks are not whole blocks."""
    bq, bkv = block_size
    seq_len = layout.seq_len
    chunks = [layout.chunks(r) for r in range(layout.world_size)]
    if any(o % b or n % b for c in chunks for o, n in c for b in (bq, bkv)):
        return None
    grid = block_grid(variant, seq_len, block_size, device)
    shape = (-(-seq_len // bq), -(-seq_len // bkv))
    kept = torch.ones(shape, dtype=torch.bool) if grid is None else (grid[0] | grid[1]).cpu()
    most = 0
    for mine in chunks:
        q_blocks = torch.cat([torch.arange(o // bq, (o + n) // bq) for o, n in mine])
        read = kept[q_blocks].any(0)
        for o, n in mine:  # the rank's own keys do not travel
            read[o // bkv : (o + n) // bkv] = False
        most = max(most, int(read.sum()) * bkv)
    return most * kv_row_bytes


def plans_for(variant: Variant, seq_len: int, block_size, device) -> GridPlans:
    """The GridPlans of this variant, sequence and block size on `device` (memoised)."""
    key = (seq_len, tuple(block_size), str(torch.device(device)))
    per = _PLANS.setdefault(variant, {})
    if key not in per:
        per[key] = GridPlans(variant, seq_len, block_size, device)
    return per[key]


class GridPlans:
    """Chunk-pair plans cut from the whole sequence's grid, a CPCall's `plans`.

    A pair whose chunks start and end on block boundaries has exactly the blocks of the grid's
    sub-grid (full blocks full, partial ones partial), so its BlockMask is built from them
    (kernels.block_mask_of_grid with the variant's mask at the pair's offsets) instead of
    evaluating the mask again: the O(P²) pair plans of ring and all-gather cost tensor slicing,
    not mask evaluation; pairs whose blocks are all full share one BlockMask per shape. Other
    pairs (unaligned chunks) return None and are built as usual. The skip decision (no kept
    block) is the flex block mask's, for the reference backend too: like every block mask here
    it is evaluated at batch 0 and head 0.
    """

    def __init__(self, variant: Variant, seq_len: int, block_size, device):
        self.variant, self.block, self.device = variant, tuple(block_size), torch.device(device)
        self.seq_len = seq_len
        # (rows, cols) -> the BlockMask of a pair whose blocks are all full: one object for every
        # such pair, as flex never evaluates the mask on a full block (its mask_mod, at the first
        # such pair's offsets, is never called).
        self.all_full: dict[tuple, Any] = {}
        # The whole problem's forward that simulated ranks start a backward from, per inputs
        # (simulate.SequenceRanks._merged): one for every candidate topology=auto simulates.
        self.merged: dict[tuple, Any] = {}
        # (q chunks, kv chunks) -> `kept`'s answer: asked again (a CUDA graph's capture replays
        # the warm-up's calls, where no host copy may run) it is read, not reduced anew.
        self.kept_pairs: dict[tuple, torch.Tensor] = {}
        grid = block_grid(variant, seq_len, self.block, self.device)
        self.usable = grid is not None
        if self.usable:  # else no mask: every pair full, built as usual
            self.partial, self.full = grid

    def sub_mask(self, q_positions: torch.Tensor, kv_positions: torch.Tensor, mask_mod):
        """The BlockMask of queries at `q_positions` against keys at `kv_positions` (global
        positions in local order; mask_mod reads local indices), cut from the grid when every
        block of both is one whole grid block; else None (build it from the mask)."""
        bq, bk = self.block
        rows, cols = _whole_blocks(q_positions, bq), _whole_blocks(kv_positions, bk)
        if not self.usable or rows is None or cols is None:
            return None
        return kernels.block_mask_of_grid(
            self.partial[rows][:, cols], self.full[rows][:, cols], block_size=self.block,
            mask_mod=mask_mod, seq_lengths=(q_positions.numel(), kv_positions.numel()),
        )  # fmt: skip

    @property
    def whole(self):
        """The whole sequence's BlockMask (None without a mask), from the grid."""
        if not self.usable:
            return None
        _, mask_mod = kernels.shifted_mods(self.variant, 0, 0, self.device)
        return kernels.block_mask_of_grid(
            self.partial, self.full, block_size=self.block, mask_mod=mask_mod,
            seq_lengths=(self.seq_len, self.seq_len),
        )  # fmt: skip

    def _answers(self, q_chunks, kv_chunks, block_size, device) -> bool:
        """Whether the grid decides these chunks' pairs: whole blocks inside the sequence, at
        the grid's block size and device."""
        bq, bk = self.block
        aligned = all(x % bq == 0 for c in q_chunks for x in c) and all(
            x % bk == 0 for c in kv_chunks for x in c
        )
        inside = max(sum(c) for c in (*q_chunks, *kv_chunks)) <= self.seq_len
        same = tuple(block_size) == self.block and torch.device(device) == self.device
        return self.usable and aligned and inside and same

    def kept(self, q_chunks, kv_chunks, block_size, device) -> torch.Tensor | None:
        """kept[i, j] (bool, on the CPU): whether the mask keeps any block of (q_chunks[i],
        kv_chunks[j]), every pair of the two lists in one reduction over the grid and one copy
        to the host (a pair at a time is a device sync each, and PyTorch's per-document
        balancers give a rank a hundred chunks at 128K); None where the grid does not decide
        them (`__call__`'s conditions). Memoised."""
        if not q_chunks or not kv_chunks:
            return torch.zeros((len(q_chunks), len(kv_chunks)), dtype=torch.bool)
        if not self._answers(q_chunks, kv_chunks, block_size, device):
            return None
        key = (tuple(map(tuple, q_chunks)), tuple(map(tuple, kv_chunks)))
        if key not in self.kept_pairs:
            self.kept_pairs[key] = self._kept(q_chunks, kv_chunks)
        return self.kept_pairs[key]

    def _kept(self, q_chunks, kv_chunks) -> torch.Tensor:
        rows, row_of = _blocks_of(q_chunks, self.block[0], self.device)
        cols, col_of = _blocks_of(kv_chunks, self.block[1], self.device)
        tiles = (self.partial[rows][:, cols] | self.full[rows][:, cols]).to(torch.int32)
        per_row = torch.zeros((len(q_chunks), cols.numel()), dtype=torch.int32, device=self.device)
        per_row.index_add_(0, row_of, tiles)
        out = torch.zeros((len(q_chunks), len(kv_chunks)), dtype=torch.int32, device=self.device)
        out.index_add_(1, col_of, per_row)
        return (out > 0).cpu()

    def __call__(self, batch, heads, q_chunk, kv_chunk, block_size, backend, device):
        if not self._answers((q_chunk,), (kv_chunk,), block_size, device):
            return None
        bq, bk = self.block
        rows = slice(q_chunk[0] // bq, (q_chunk[0] + q_chunk[1]) // bq)
        cols = slice(kv_chunk[0] // bk, (kv_chunk[0] + kv_chunk[1]) // bk)
        partial, full = self.partial[rows, cols], self.full[rows, cols]
        if not bool((partial | full).any()):
            return True, None
        if backend == "reference":
            return False, None
        whole_full = not bool(partial.any()) and bool(full.all())
        if whole_full and partial.shape in self.all_full:
            return False, self.all_full[partial.shape]
        _, mask_mod = kernels.shifted_mods(self.variant, q_chunk[0], kv_chunk[0], device)
        block_mask = kernels.block_mask_of_grid(
            partial, full, block_size=self.block, mask_mod=mask_mod,
            seq_lengths=(q_chunk[1], kv_chunk[1]),
        )  # fmt: skip
        if whole_full:
            self.all_full[partial.shape] = block_mask
        return False, block_mask


def _blocks_of(chunks, block: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The grid blocks of (offset, length) chunks of whole blocks, in order, and the index of
    the chunk each belongs to."""
    blocks = [torch.arange(o // block, (o + n) // block) for o, n in chunks]
    owner = [torch.full((b.numel(),), i) for i, b in enumerate(blocks)]
    return torch.cat(blocks).to(device), torch.cat(owner).to(device)


def _whole_blocks(positions: torch.Tensor, block: int) -> torch.Tensor | None:
    """The grid block of each `block` consecutive positions, when each run is one whole block
    (starts on a block boundary, consecutive); else None."""
    if positions.numel() % block:
        return None
    runs = positions.view(-1, block)
    first = runs[:, :1]
    steps = torch.arange(block, device=positions.device)
    if bool((first % block).any()) or not bool((runs == first + steps).all()):
        return None
    return (first[:, 0] // block).to(torch.long)
