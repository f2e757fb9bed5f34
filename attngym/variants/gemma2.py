"""Gemma 2's local attention layers: a causal sliding window with tanh soft-capping.

Gemma 2 (Gemma Team, 2024, arXiv:2408.00118) alternates global layers with local ones that attend
a 4096-token window, and caps every attention logit with `50 * tanh(score / 50)`. The variant is
the composition of the catalogue's `sliding_window` and `softcap`, named and checked as one.
"""

from __future__ import annotations

import dataclasses

from attngym.variants.base import Variant, compose, register
from attngym.variants.sliding_window import sliding_window
from attngym.variants.softcap import softcap


@register("gemma2")
def gemma2(window_size: int = 4096, soft_cap: float = 50.0) -> Variant:
    """A causal sliding window whose scores are soft-capped.

    Args:
        window_size: the look-back in tokens, > 0 (Gemma 2: 4096).
        soft_cap: the logit cap, > 0 (Gemma 2: 50).

    Note:
        As `sliding_window` (`0 <= q_idx - kv_idx <= window_size`) composed with `softcap`
        (`soft_cap * tanh(score / soft_cap)` on the scaled score).
    """
    window, cap = sliding_window(window_size), softcap(soft_cap)
    both = compose(window, cap)
    return dataclasses.replace(both, name="gemma2", params={**window.params, **cap.params})
