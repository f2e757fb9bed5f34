"""Full and causal attention: the two variants plain SDPA also runs (`is_causal`)."""

from __future__ import annotations

import torch

from attngym.variants.base import Variant, Varlen, register


def _causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@register("full")
def full() -> Variant:
    """Every query attends to every key: no score_mod, no mask_mod."""
    return Variant(name="full", sdpa="full", varlen=Varlen())


@register("causal")
def causal() -> Variant:
    """Autoregressive attention.

    Note:
        A query attends to its own position and every earlier one: `q_idx >= kv_idx`.
    """
    return Variant(
        name="causal",
        mask_mod=_causal_mask,
        sdpa="causal",
        varlen=Varlen(right=0),
        block_rule=causal_blocks,
    )


def causal_blocks(q_lo, q_hi, kv_lo, kv_hi):
    """Block classes of q_idx >= kv_idx (Variant.block_rule)."""
    return classes(q_hi >= kv_lo, kv_hi <= q_lo)


def classes(any_kept, all_kept):
    """Block classes (uint8: 0 empty, 1 partial, 2 full) from whether any / every pair is kept."""
    return any_kept.to(torch.uint8) + (any_kept & all_kept).to(torch.uint8)
