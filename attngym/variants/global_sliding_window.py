"""Longformer's global + sliding-window attention: a local band plus a few global tokens.

Longformer (Beltagy et al., 2020, "Longformer: The Long-Document Transformer", arXiv:2004.05150)
gives every token a symmetric window and marks a few task tokens (CLS, the question) global: they
attend to every position and every position attends to them. attention-gym's
`generate_global_sliding_window` takes the marks as a boolean tensor the length of the sequence;
here they are a list of positions, checked, and held as a buffer that `.to(device)` moves.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from attngym.variants.base import Variant, positive_int, register


def _global_sliding_window_mods(global_positions: torch.Tensor, window_size: int, tag: str):
    def mask_mod(b, h, q_idx, kv_idx):
        local = (q_idx - kv_idx).abs() <= window_size
        q_global = (q_idx.unsqueeze(-1) == global_positions).any(dim=-1)
        kv_global = (kv_idx.unsqueeze(-1) == global_positions).any(dim=-1)
        return local | q_global | kv_global

    mask_mod.__name__ = tag
    return mask_mod


@register("global_sliding_window")
def global_sliding_window(window_size: int, global_tokens: Sequence[int]) -> Variant:
    """Bidirectional sliding window plus global tokens.

    Args:
        window_size: how far a query may look in either direction, > 0.
        global_tokens: the positions of the global tokens, distinct integers >= 0 (at least one;
            without any, use bidirectional_sliding_window).

    Note:
        `|q_idx - kv_idx| <= window_size`, or either position is global: a global token attends
        to every key and is attended by every query, in both directions (compose with `causal`
        for a decoder). Positions beyond the sequence mark nothing.
    """
    window_size = positive_int("window_size", window_size)
    if isinstance(global_tokens, str | bytes) or not isinstance(global_tokens, Sequence):
        raise ValueError(f"global_tokens must be a list of positions, got {global_tokens!r}")
    if len(global_tokens) == 0:
        raise ValueError(
            "global_tokens must name at least one position, got []; without global tokens the "
            "mask is bidirectional_sliding_window"
        )
    try:
        positions = [
            positive_int(f"global_tokens[{i}]", p, allow_zero=True)
            for i, p in enumerate(global_tokens)
        ]
    except ValueError as err:
        raise ValueError(f"{err} (global_tokens={list(global_tokens)!r})") from None
    if len(set(positions)) != len(positions):
        raise ValueError(f"global_tokens must be distinct positions, got {positions!r}")

    tag = f"global_sliding_window_{window_size}_{len(positions)}global"
    table = torch.tensor(positions)

    def bind(buffers: Mapping[str, torch.Tensor]):
        return None, _global_sliding_window_mods(buffers["global_positions"], window_size, tag)

    _, mask_mod = bind({"global_positions": table})
    return Variant(
        name="global_sliding_window",
        params={"window_size": window_size, "global_tokens": positions},
        mask_mod=mask_mod,
        buffers={"global_positions": table},
        bind=bind,
    )
