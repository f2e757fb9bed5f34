"""Dense attention for any score_mod / mask_mod: the oracle every test and validation compares to.

It materialises the (B, H, Sq, Skv) score matrix in float64 (or float32 on request), so it is exact
enough to judge bf16 kernels and small enough for the shapes tests use. It is differentiable on any
device, which also makes it the CPU backward kernel (FlexAttention has none on CPU).

Conventions, the same as FlexAttention's:
    score = (q @ k^T) * scale, then score_mod, then mask_mod (masked -> -inf);
    lse = logsumexp(score) over keys, natural base (e), of the scaled, modified scores;
    a row with no key left gives out = 0 and lse = -inf.

Shapes: q_BHSD (B, H, Sq, D); k_BGSD, v_BGSD (B, G, Skv, D) with G dividing H (GQA: query head h
reads kv head h // (H / G)); v may have its own last dim Dv.
"""

from __future__ import annotations

import math

import torch

from attngym.device import settle_cpu_math
from attngym.variants.base import MaskMod, ScoreMod


def index_grids(
    batch: int,
    heads: int,
    q_positions: torch.Tensor,
    kv_positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Broadcastable (b, h, q_idx, kv_idx) grids: (B,1,1,1), (1,H,1,1), (1,1,Sq,1), (1,1,1,Skv)."""
    device = q_positions.device
    b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
    h = torch.arange(heads, device=device).view(1, -1, 1, 1)
    return b, h, q_positions.view(1, 1, -1, 1), kv_positions.view(1, 1, 1, -1)


def dense_mask(
    mask_mod: MaskMod | None,
    batch: int,
    heads: int,
    q_positions: torch.Tensor,
    kv_positions: torch.Tensor,
) -> torch.Tensor:
    """The boolean mask (B or 1, H or 1, Sq, Skv) that mask_mod describes at these positions."""
    shape = (1, 1, q_positions.numel(), kv_positions.numel())
    if mask_mod is None:
        return torch.ones(shape, dtype=torch.bool, device=q_positions.device)
    b, h, q_idx, kv_idx = index_grids(batch, heads, q_positions, kv_positions)
    keep = mask_mod(b, h, q_idx, kv_idx)
    return torch.broadcast_to(keep, torch.broadcast_shapes(keep.shape, shape))


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    score_mod: ScoreMod | None = None,
    mask_mod: MaskMod | None = None,
    *,
    scale: float | None = None,
    q_positions: torch.Tensor | None = None,
    kv_positions: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention returning `(out_BHSD, lse_BHS)` computed in `dtype`.

    Args:
        q: (B, H, Sq, D) queries.
        k: (B, G, Skv, D) keys, G dividing H.
        v: (B, G, Skv, Dv) values.
        score_mod: `(score, b, h, q_idx, kv_idx) -> score`, evaluated on broadcast index grids.
        mask_mod: `(b, h, q_idx, kv_idx) -> bool`; False drops the key.
        scale: score scale; default 1 / sqrt(D).
        q_positions: (Sq,) global positions of the query rows; default arange(Sq). Passing a
            subset of rows validates a sample of a long sequence without Sq x Skv memory.
        kv_positions: (Skv,) global positions of the keys; default arange(Skv).
        dtype: compute dtype, float64 (default) or float32.

    Returns:
        out: (B, H, Sq, Dv) in `dtype`; lse: (B, H, Sq) in `dtype`, natural log, -inf on empty rows.
    """
    if dtype not in (torch.float64, torch.float32):
        raise ValueError(f"dtype must be torch.float64 or torch.float32, got {dtype}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D (B, H, S, D); got {q.shape}, {k.shape}, {v.shape}")
    batch, heads, seq_q, head_dim = q.shape
    kv_heads, seq_kv = k.shape[1], k.shape[2]
    if heads % kv_heads:
        raise ValueError(f"kv heads ({kv_heads}) must divide query heads ({heads})")
    if q_positions is None:
        q_positions = torch.arange(seq_q, device=q.device)
    if kv_positions is None:
        kv_positions = torch.arange(seq_kv, device=q.device)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    settle_cpu_math()  # the same bits in every process (see its docstring)

    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if kv_heads != heads:
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)

    score = (q @ k.transpose(-2, -1)) * scale  # (B, H, Sq, Skv)
    if score_mod is not None:
        b, h, q_idx, kv_idx = index_grids(batch, heads, q_positions, kv_positions)
        score = torch.broadcast_to(score_mod(score, b, h, q_idx, kv_idx), score.shape).to(dtype)
    if mask_mod is not None:
        keep = dense_mask(mask_mod, batch, heads, q_positions, kv_positions)
        score = score.masked_fill(~keep, float("-inf"))

    # Empty rows: take the logsumexp of zeros instead, so neither the value nor its gradient is NaN,
    # then report -inf there (FlexAttention's convention).
    empty = torch.isneginf(score).all(dim=-1, keepdim=True)
    safe_lse = torch.where(empty, 0.0, score).logsumexp(dim=-1, keepdim=True)
    probs = torch.exp(score - safe_lse)  # masked entries: exp(-inf) = 0
    out = probs @ v
    lse = safe_lse.masked_fill(empty, float("-inf")).squeeze(-1)
    return out, lse
