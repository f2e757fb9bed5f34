"""ALiBi: a per-head linear penalty on distance instead of position embeddings.

Press et al., 2022, "Train Short, Test Long: Attention with Linear Biases Enables Input Length
Extrapolation" (arXiv:2108.12409). Head h gets slope 2^(-8 (h + 1) / num_heads), a geometric
sequence, so some heads look far and others stay local.

The slope is computed from `h` with tensor ops in the score's dtype rather than read from a table:
the kernel evaluates it in float32, the float64 reference in float64, and no buffer has to follow
the variant across devices.
"""

from __future__ import annotations

import torch

from attngym.variants.base import Variant, positive_int, register


@register("alibi")
def alibi(num_heads: int) -> Variant:
    """Add `(kv_idx - q_idx) * slope(h)` to every score.

    Args:
        num_heads: number of query heads the slopes are spread over, > 0 (the model's heads).

    Note:
        `score + (kv_idx - q_idx) * 2 ** (-8 * (h + 1) / num_heads)`, h the query-head index: the
        bias is 0 on the diagonal, negative for earlier keys and positive for later ones (combine
        with a causal mask for the decoder form). No mask of its own.
    """
    num_heads = positive_int("num_heads", num_heads)

    def score_mod(score, b, h, q_idx, kv_idx):
        slope = torch.exp2((h + 1).to(score.dtype) * (-8.0 / num_heads))
        return score + (kv_idx - q_idx) * slope

    score_mod.__name__ = f"alibi_{num_heads}heads"
    return Variant(name="alibi", params={"num_heads": num_heads}, score_mod=score_mod)
