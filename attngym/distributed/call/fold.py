"""A call's batch and heads folded into its rows, its costliest block rows first.

flex runs one program per (query block row, batch, head), the rows fastest: all of the first
head's rows, then the next head's. On a rank's shard of packed documents the rows differ in cost
by 10x and more (a long document's last rows read all its keys, a short one's a few blocks), and
a shard holds about one program per SM and head, so every head's longest row starts when that
head's turn comes, the last head's at the end: the call waits for it alone. Simulated as flex's
programs taken in grid order by 132 SMs, the all-gather's ranks on `balanced` ran 1.10-1.43x
max over min on 16 batches of packed documents where their blocks say 1.00-1.03x, the measured
1.11-1.31x's pattern batch by batch (experiments/workloads, "The longest rows last").

Folded, the call is one of B·H·S/P rows (q viewed as (1, 1, B·H·S/P, D), its block rows in any
order: a gathered copy) against B·G·Skv keys (k and v viewed so, no copy), the block mask moved
to match (each row's key blocks shifted to its batch and head's keys) and the variant read
through tables (a folded row's batch, head and position; a key's position). Its block rows are
sorted costliest first, over every head at once, so the longest rows start first, as a
longest-processing-time-first schedule takes them. The kernel computes the same blocks; the fold
adds gathers of q, out, dout and dq and a block mask B·H times the rows and columns.

Measured (one H100, experiments/workloads/row_order.py and run.sh), about half of what the
simulation promised (batch 0's heaviest rank from 1.49x to 1.04x the ideal) is kept: the slowest
rank of batch 0 on `balanced` went from 1.39 to 1.18 times the ideal (the fold as made here, q
already folded), every rank now alike (5.15-5.64 ms); in the all-gather, gathers included, 3
batches' efficiency was 0.738, 0.809 and 0.621 against 0.675, 0.717 and 0.668 unfolded: a batch
of many short documents is slower folded, so the simulation names the unfolded call to
`topology=auto` (AllGatherOptions.fold).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from attngym.distributed.placement.layout import block_row_prices
from attngym.variants.base import Variant

# Fold a call (the all-gather's fold=None, on CUDA) when its longest block row costs at least
# this many times its mean: packed documents' balanced ranks 2.6-7.8 on the batches measured
# folded; a window's rows cost alike, and a causal mask's rows at most 2x on a rank (zigzag's
# first), whose calls were measured unfolded and are left so.
SPREAD = 2.5
_TABLES = ("fold_b", "fold_h", "fold_q", "fold_kv")


@dataclasses.dataclass(frozen=True, eq=False)
class Fold:
    """A folded call: `rows[i]` is the flat (B·H·Sq) query row of folded row i, `back` its
    inverse; `variant` and `block_mask` are the folded call's; `shape` is (B, H, G, Sq, Skv)."""

    rows: torch.Tensor
    back: torch.Tensor
    variant: Variant
    block_mask: object
    shape: tuple[int, int, int, int, int]


def worth_it(block_mask) -> bool:
    """Whether the call's longest block row costs SPREAD times its mean (or more), priced by
    layout.block_row_prices."""
    if block_mask is None:
        return False
    price = block_row_prices(block_mask)
    return bool(price.max() >= SPREAD * price.mean().clamp(min=1e-9))


def fold(
    variant: Variant,
    q_positions: torch.Tensor,
    kv_positions: torch.Tensor,
    block_mask,
    shape: Sequence[int],
    exact: bool = True,
) -> Fold | None:
    """The Fold of a call of queries at `q_positions` against keys at `kv_positions` (global
    positions, local order) with `block_mask` (the call's own), for q (B, H, Sq, D) and k, v
    (B, G, Skv, D) given as `shape` (B, H, G); None where a block would straddle two heads (Sq
    or Skv not whole blocks). `exact`: the mask itself hides the pairs of two batches or heads
    (a kernel that evaluates it everywhere, the dense reference); else only the block mask
    does (flex reads the mask inside the blocks it keeps, each of one batch and head)."""
    B, H, G = (int(x) for x in shape)
    Sq, Skv = q_positions.numel(), kv_positions.numel()
    bq, bkv = block_mask.BLOCK_SIZE
    if Sq % bq or Skv % bkv:
        return None
    device = block_mask.kv_num_blocks.device
    Rb, C = Sq // bq, Skv // bkv
    price = block_row_prices(block_mask)  # (Bm, Hm, Rb)
    flat = torch.arange(B * H * Rb, device=device)
    b, h, r = flat // (H * Rb), (flat // Rb) % H, flat % Rb
    Bm, Hm = price.shape[:2]
    order = torch.argsort(price[b % Bm, h % Hm, r], descending=True, stable=True)
    b, h, r = b[order], h[order], r[order]
    shift = ((b * G + h // (H // G)) * C).view(-1, 1)  # the row's keys in the folded keys

    def moved(num, idx):
        idx = torch.nn.functional.pad(idx[b % Bm, h % Hm, r] + shift, (0, C * (B * G - 1)))
        return num[b % Bm, h % Hm, r].view(1, 1, -1).int(), idx.view(1, 1, len(order), -1).int()

    within = torch.arange(bq, device=device)
    rows = (((b * H + h) * Rb + r) * bq).view(-1, 1).add(within).flatten()
    q_at = (r * bq).view(-1, 1).add(within).flatten()
    tables = {
        "fold_b": b.repeat_interleave(bq).int(),
        "fold_h": h.repeat_interleave(bq).int(),
        "fold_q": q_positions.to(device)[q_at].int(),
        "fold_kv": kv_positions.to(device).int(),
    }
    folded = _folded_variant(variant.to(device), tables, G * Skv, Skv, H // G, exact)
    kv = moved(block_mask.kv_num_blocks, block_mask.kv_indices)
    full = (None, None)
    if block_mask.full_kv_num_blocks is not None:
        full = moved(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
    from torch.nn.attention.flex_attention import BlockMask

    mask = BlockMask.from_kv_blocks(
        *kv, *full, BLOCK_SIZE=(bq, bkv), mask_mod=folded.mask_mod,
        seq_lengths=(B * H * Sq, B * G * Skv),
    )  # fmt: skip
    return Fold(rows, torch.argsort(rows), folded, mask, (B, H, G, Sq, Skv))


def _folded_variant(
    variant: Variant, tables: dict, batch_keys: int, keys: int, group: int, exact: bool
):
    """The variant over folded rows and keys: folded row i is batch fold_b[i], head fold_h[i],
    position fold_q[i]; folded key j is batch j // batch_keys, kv head (j // keys) % G, position
    fold_kv[j % keys]; with `exact`, a pair of another batch or head is masked."""
    names = sorted(variant.buffers)

    def bind(buffers):
        inner_score, inner_mask = (
            variant.bind({n: buffers[n] for n in names})
            if names
            else (variant.score_mod, variant.mask_mod)
        )
        fb, fh, fq, fkv = (buffers[n] for n in _TABLES)

        def mask_mod(b, h, q, kv):
            bb, hh = fb[q], fh[q]
            kept = inner_mask(bb, hh, fq[q], fkv[kv % keys]) if inner_mask else None
            if not exact:
                return kv >= 0 if kept is None else kept
            same = (kv // batch_keys == bb) & ((kv % batch_keys) // keys == hh // group)
            return same if kept is None else same & kept

        score_mod = None
        if inner_score is not None:

            def score_mod(score, b, h, q, kv):
                return inner_score(score, fb[q], fh[q], fq[q], fkv[kv % keys])

        return score_mod, mask_mod

    buffers = {**variant.buffers, **tables}
    score_mod, mask_mod = bind(buffers)
    return dataclasses.replace(
        variant, name=f"{variant.name}.folded", score_mod=score_mod, mask_mod=mask_mod,
        buffers=buffers, bind=bind, seq_len=None, sdpa=None, varlen=None, block_rule=None,
    )  # fmt: skip


def rows_in(f: Fold, x: torch.Tensor) -> torch.Tensor:
    """(B, H, Sq, ...) -> the folded call's (1, 1, B·H·Sq, ...), its rows in the fold's order."""
    B, H, _, Sq, _ = f.shape
    return x.reshape(B * H * Sq, *x.shape[3:]).index_select(0, f.rows).unsqueeze(0).unsqueeze(0)


def rows_out(f: Fold, x: torch.Tensor) -> torch.Tensor:
    """The folded call's (1, 1, B·H·Sq, ...) -> (B, H, Sq, ...)."""
    B, H, _, Sq, _ = f.shape
    return x[0, 0].index_select(0, f.back).reshape(B, H, Sq, *x.shape[3:])


def keys_in(x: torch.Tensor) -> torch.Tensor:
    """(B, G, Skv, D) -> the folded call's (1, 1, B·G·Skv, D): a view where x is contiguous."""
    return x.reshape(1, 1, -1, x.shape[-1])


def keys_out(f: Fold, x: torch.Tensor) -> torch.Tensor:
    """The folded call's (1, 1, B·G·Skv, D) keys' gradient -> (B, G, Skv, D)."""
    B, _, G, _, Skv = f.shape
    return x.reshape(B, G, Skv, x.shape[-1])
