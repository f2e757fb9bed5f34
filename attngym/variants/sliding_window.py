"""Sliding-window attention: each query sees a band of nearby keys.

Local attention bounds the cost per query and is the building block of long-context models:
causal windows as in Longformer (Beltagy et al., 2020, arXiv:2004.05150) and Mistral 7B
(Jiang et al., 2023, arXiv:2310.06825); Longformer's dilated windows widen the receptive field at
the same cost; the bidirectional band is Longformer's encoder-side local attention.
"""

from __future__ import annotations

from attngym.variants.base import Variant, Varlen, positive_int, register
from attngym.variants.causal import classes


@register("sliding_window")
def sliding_window(window_size: int) -> Variant:
    """Causal sliding window.

    Args:
        window_size: how many earlier tokens a query may look back, > 0.

    Note:
        The window size is the look-back: a query attends to itself and the `window_size` tokens
        before it, `0 <= q_idx - kv_idx <= window_size` (so `window_size + 1` keys in all).
    """
    window_size = positive_int("window_size", window_size)

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= window_size)

    def block_rule(q_lo, q_hi, kv_lo, kv_hi):
        # q - kv over a block pair spans [q_lo - kv_hi, q_hi - kv_lo]; kept where in [0, w].
        low, high = q_lo - kv_hi, q_hi - kv_lo
        return classes((high >= 0) & (low <= window_size), (low >= 0) & (high <= window_size))

    mask_mod.__name__ = f"sliding_window_{window_size}"
    return Variant(
        name="sliding_window",
        params={"window_size": window_size},
        mask_mod=mask_mod,
        varlen=Varlen(left=window_size, right=0),
        block_rule=block_rule,
    )


@register("bidirectional_sliding_window")
def bidirectional_sliding_window(window_size: int) -> Variant:
    """Non-causal band: keys on both sides of the query, for encoders.

    Args:
        window_size: how far a query may look in either direction, > 0.

    Note:
        `|q_idx - kv_idx| <= window_size`: `2 * window_size + 1` keys away from the edges.
    """
    window_size = positive_int("window_size", window_size)

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= window_size

    mask_mod.__name__ = f"bidirectional_sliding_window_{window_size}"
    return Variant(
        name="bidirectional_sliding_window",
        params={"window_size": window_size},
        mask_mod=mask_mod,
        varlen=Varlen(left=window_size, right=window_size),
    )


@register("dilated_sliding_window")
def dilated_sliding_window(window_size: int, dilation: int) -> Variant:
    """Bidirectional window that keeps every `dilation`-th key.

    Args:
        window_size: how far (in tokens) a query may look in either direction, > 0.
        dilation: the stride between kept keys, > 0 (1 is the plain bidirectional band).

    Note:
        `|q_idx - kv_idx| <= window_size` and `(q_idx - kv_idx) % dilation == 0`: the distance is
        measured in tokens, not in dilated steps, and the query always sees itself.
    """
    window_size = positive_int("window_size", window_size)
    dilation = positive_int("dilation", dilation)

    def mask_mod(b, h, q_idx, kv_idx):
        distance = (q_idx - kv_idx).abs()  # non-negative, so % needs no sign convention
        return (distance <= window_size) & (distance % dilation == 0)

    mask_mod.__name__ = f"dilated_sliding_window_{window_size}_dilation_{dilation}"
    return Variant(
        name="dilated_sliding_window",
        params={"window_size": window_size, "dilation": dilation},
        mask_mod=mask_mod,
    )
