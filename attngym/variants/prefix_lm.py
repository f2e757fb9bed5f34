"""Prefix-LM attention: a bidirectional prefix followed by causal generation.

From T5's prefix language model objective (Raffel et al., 2020, arXiv:1910.10683) and UniLM (Dong et
al., 2019, arXiv:1905.03197): the prompt is encoded with full attention, the continuation is
decoded causally while still seeing the whole prompt.
"""

from __future__ import annotations

from attngym.variants.base import Variant, positive_int, register


@register("prefix_lm")
def prefix_lm(prefix_length: int) -> Variant:
    """Full attention to the first `prefix_length` tokens, causal elsewhere.

    Args:
        prefix_length: length of the bidirectional prefix, >= 0 (0 and 1 are plain causal).

    Note:
        `kv_idx < prefix_length or q_idx >= kv_idx`: prefix tokens also see each other in both
        directions, and every query sees the whole prefix.
    """
    prefix_length = positive_int("prefix_length", prefix_length, allow_zero=True)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx < prefix_length) | (q_idx >= kv_idx)

    mask_mod.__name__ = f"prefix_lm_{prefix_length}"
    return Variant(
        name="prefix_lm",
        params={"prefix_length": prefix_length},
        mask_mod=mask_mod,
        sdpa="causal" if prefix_length <= 1 else None,  # a prefix of 0 or 1 adds no key
    )
