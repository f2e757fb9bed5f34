"""Tanh soft-capping of attention logits.

Gemma 2 (Gemma Team, 2024, arXiv:2408.00118) and Grok-1 bound the logits smoothly with
`cap * tanh(score / cap)`, which keeps training stable without a hard clip; FlexAttention fuses it
as a score_mod.
"""

from __future__ import annotations

import torch

from attngym.variants.base import Variant, positive_float, register


@register("softcap")
def softcap(soft_cap: float) -> Variant:
    """Squash every score into (-soft_cap, soft_cap).

    Args:
        soft_cap: the bound, a positive number (Gemma 2 uses 50 for attention).

    Note:
        `soft_cap * tanh(score / soft_cap)` applied to the scaled score (after `q @ k^T * scale`),
        the same for every position and head. No mask of its own.
    """
    soft_cap = positive_float("soft_cap", soft_cap)

    def score_mod(score, b, h, q_idx, kv_idx):
        return soft_cap * torch.tanh(score / soft_cap)

    score_mod.__name__ = f"softcap_{soft_cap:g}"
    return Variant(name="softcap", params={"soft_cap": soft_cap}, score_mod=score_mod)
