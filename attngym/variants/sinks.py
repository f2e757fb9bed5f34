"""Sliding window with attention sinks: the first tokens stay visible to every query.

StreamingLLM (Xiao et al., 2023, "Efficient Streaming Language Models with Attention Sinks",
arXiv:2309.17453) observed that models park attention mass on the first few tokens; keeping those
"sinks" next to a causal window preserves quality when the window slides past them.
"""

from __future__ import annotations

from attngym.variants.base import Variant, positive_int, register


@register("sliding_window_sinks")
def sliding_window_sinks(window_size: int, num_sinks: int) -> Variant:
    """Causal sliding window plus the first `num_sinks` tokens.

    Args:
        window_size: look-back of the window, > 0 (as in `sliding_window`).
        num_sinks: how many leading tokens every later query also attends to, > 0.

    Note:
        Causal, and `q_idx - kv_idx <= window_size or kv_idx < num_sinks`: a sink is visible only
        to queries at or after it.
    """
    window_size = positive_int("window_size", window_size)
    num_sinks = positive_int("num_sinks", num_sinks)

    def mask_mod(b, h, q_idx, kv_idx):
        in_window = q_idx - kv_idx <= window_size
        return (q_idx >= kv_idx) & (in_window | (kv_idx < num_sinks))

    mask_mod.__name__ = f"sliding_window_{window_size}_sinks_{num_sinks}"
    return Variant(
        name="sliding_window_sinks",
        params={"window_size": window_size, "num_sinks": num_sinks},
        mask_mod=mask_mod,
    )
