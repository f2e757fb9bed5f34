"""Full and causal attention: the two variants plain SDPA also runs (`is_causal`)."""

from __future__ import annotations

from attngym.variants.base import Variant, register


def _causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@register("full")
def full() -> Variant:
    """Every query attends to every key: no score_mod, no mask_mod."""
    return Variant(name="full", sdpa="full")


@register("causal")
def causal() -> Variant:
    """Autoregressive attention.

    Note:
        A query attends to its own position and every earlier one: `q_idx >= kv_idx`.
    """
    return Variant(name="causal", mask_mod=_causal_mask, sdpa="causal")
