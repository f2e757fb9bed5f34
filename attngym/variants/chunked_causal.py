"""Chunked causal attention: causal inside fixed chunks, nothing across them.

Llama 4's local layers ("chunked attention", Meta, 2025) split the sequence into chunks of
`chunk_size` tokens; a query attends causally within its own chunk only, so memory per layer is
bounded by the chunk and global layers carry information across chunks.
"""

from __future__ import annotations

from attngym.variants.base import Variant, positive_int, register


@register("chunked_causal")
def chunked_causal(chunk_size: int) -> Variant:
    """Causal attention restricted to the query's chunk.

    Args:
        chunk_size: tokens per chunk, > 0; chunks start at position 0, the last may be shorter.

    Note:
        `q_idx // chunk_size == kv_idx // chunk_size and q_idx >= kv_idx` (positions are >= 0,
        so floor division needs no sign convention).
    """
    chunk_size = positive_int("chunk_size", chunk_size)

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx // chunk_size == kv_idx // chunk_size) & (q_idx >= kv_idx)

    mask_mod.__name__ = f"chunked_causal_{chunk_size}"
    return Variant(name="chunked_causal", params={"chunk_size": chunk_size}, mask_mod=mask_mod)
