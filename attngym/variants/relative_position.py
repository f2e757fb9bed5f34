"""Relative-position bias: the score grows with how far back the key is.

The simplest relative-position score_mod (the FlexAttention announcement's first example), in the
spirit of Shaw et al., 2018, "Self-Attention with Relative Position Representations"
(arXiv:1803.02155), with a fixed unit bias per token of distance instead of a learned table. It
exercises a score_mod that depends on both indices.
"""

from __future__ import annotations

from attngym.variants.base import Variant, register


def _relative_position(score, b, h, q_idx, kv_idx):
    return score + (q_idx - kv_idx)


@register("relative_position")
def relative_position() -> Variant:
    """Add the signed distance `q_idx - kv_idx` to every score.

    Note:
        `score + (q_idx - kv_idx)`: +1 per token the key lies before the query, negative for later
        keys. No mask of its own; the bias is unbounded, so long sequences make softmax peaky.
    """
    return Variant(name="relative_position", score_mod=_relative_position)
