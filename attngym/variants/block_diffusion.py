"""Block diffusion's training mask: noised and clean copies of a sequence, side by side.

BD3-LM (Arriola et al., 2025, "Block Diffusion: Interpolating Between Autoregressive and Diffusion
Language Models", arXiv:2503.09573, section 3.1) trains on `x_t ++ x_0`, the noised tokens followed
by the clean ones, both split into blocks of `block_size`. Noised tokens see their own noised block
(block diagonal) and the clean tokens of earlier blocks (offset block causal); clean tokens see
clean tokens of their own and earlier blocks (block causal) and never the noised ones.
"""

from __future__ import annotations

from attngym.variants.base import Variant, positive_int, register


@register("block_diffusion")
def block_diffusion(clean_length: int, block_size: int) -> Variant:
    """The BD3-LM training mask over `2 * clean_length` tokens.

    Args:
        clean_length: the length L of the clean sequence x_0 (and of its noised copy x_t), > 0.
        block_size: the diffusion block size L', 0 < block_size <= clean_length; the last block
            is shorter when it does not divide clean_length.

    Note:
        Positions `[0, L)` are x_t and `[L, 2L)` are x_0; position p is in block
        `(p % L) // block_size`. The mask is `same block and same half`, or `q in x_t, kv in x_0
        and block(q) > block(kv)`, or `both in x_0 and block(q) >= block(kv)`. The variant's
        `seq_len` is `2 * clean_length` (attention-gym's `seq_len` argument is L).
    """
    clean_length = positive_int("clean_length", clean_length)
    block_size = positive_int("block_size", block_size)
    if block_size > clean_length:
        raise ValueError(
            f"block_size must be at most clean_length={clean_length}, got {block_size!r}"
        )

    def mask_mod(b, h, q_idx, kv_idx):
        q_noised, kv_noised = q_idx < clean_length, kv_idx < clean_length
        q_block = (q_idx % clean_length) // block_size
        kv_block = (kv_idx % clean_length) // block_size
        block_diagonal = (q_block == kv_block) & (q_noised == kv_noised)
        offset_block_causal = (q_block > kv_block) & q_noised & ~kv_noised
        block_causal = (q_block >= kv_block) & ~q_noised & ~kv_noised
        return block_diagonal | offset_block_causal | block_causal

    mask_mod.__name__ = f"block_diffusion_{clean_length}_block_{block_size}"
    return Variant(
        name="block_diffusion",
        params={"clean_length": clean_length, "block_size": block_size},
        mask_mod=mask_mod,
        seq_len=2 * clean_length,
    )
