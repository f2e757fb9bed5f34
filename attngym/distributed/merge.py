"""The one LSE merge: combine attention partials computed over disjoint key sets.

If `(out_i, lse_i)` is attention of the same queries over key set K_i (lse natural base, -inf
where a row saw no key), attention over the union of the K_i is

    lse = log Σ_i exp(lse_i),    out = Σ_i w_i · out_i,    w_i = exp(lse_i − lse).

Rows where every lse_i is -inf stay out = 0, lse = -inf (no NaN). Context-parallel forward merges
with `merge`; backward splits the output gradient with the same weights (`weights`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def weights(lse_i: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """w_i = exp(lse_i − lse) with 0 wherever lse_i is -inf (including rows where lse is -inf).

    Args:
        lse_i: (B, H, S) partial log-sum-exp.
        lse: (B, H, S) merged log-sum-exp.

    Returns:
        (B, H, S) weights in lse's dtype.
    """
    empty = torch.isneginf(lse_i)
    diff = torch.where(empty, torch.zeros_like(lse_i), lse_i - torch.where(empty, 0.0, lse))
    return torch.where(empty, torch.zeros_like(diff), torch.exp(diff))


def merge(
    outs: Sequence[torch.Tensor],
    lses: Sequence[torch.Tensor],
    *,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partials `(out_i, lse_i)` over disjoint key sets into `(out, lse)`.

    Computed in the lse dtype (float32, or float64 for float64 inputs), so chaining merges step by
    step loses nothing when `out_dtype` keeps the accumulator in that precision.

    Args:
        outs: partial outputs, each (B, H, S, D).
        lses: partial log-sum-exps, each (B, H, S); -inf on rows with no key.
        out_dtype: dtype of the merged out; default outs[0].dtype.

    Returns:
        out: (B, H, S, D) in out_dtype; lse: (B, H, S) in the lse dtype, -inf where all were.
    """
    if len(outs) != len(lses) or not outs:
        raise ValueError(
            f"merge needs as many outs as lses (>= 1), got {len(outs)} and {len(lses)}"
        )
    acc_dtype = lses[0].dtype
    out_dtype = outs[0].dtype if out_dtype is None else out_dtype
    lse_nBHS = torch.stack([lse.to(acc_dtype) for lse in lses])
    lse = torch.logsumexp(lse_nBHS, dim=0)  # -inf where every partial is -inf
    out = torch.zeros_like(outs[0], dtype=acc_dtype)
    for out_i, lse_i in zip(outs, lse_nBHS, strict=True):
        out = out + weights(lse_i, lse).unsqueeze(-1) * out_i.to(acc_dtype)
    return out.to(out_dtype), lse
