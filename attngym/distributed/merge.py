"""The one LSE merge: combine attention partials computed over disjoint key sets.

If `(out_i, lse_i)` is attention of the same queries over key set K_i (lse natural base, -inf
where a row saw no key), attention over the union of the K_i is

    lse = log Σ_i exp(lse_i),    out = Σ_i w_i · out_i,    w_i = exp(lse_i − lse).

Rows where every lse_i is -inf stay out = 0, lse = -inf (no NaN). Context-parallel forward folds
each chunk pair's partial into its accumulator with `merge_into` (compiled on CUDA:
`compiled_merge_into`); `merge` combines a list;
backward splits the output gradient with the same weights (`weights`).
"""

from __future__ import annotations

import functools
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


def _fold_weights(
    lse: torch.Tensor, lse_i: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(merged lse, weight of the running out, weight of out_i) for folding one partial in."""
    lse_i = lse_i.to(lse.dtype)
    new = torch.logaddexp(lse, lse_i)  # -inf where both are
    return new, weights(lse, new).unsqueeze(-1), weights(lse_i, new).unsqueeze(-1)


def merge_into(
    out: torch.Tensor, lse: torch.Tensor, out_i: torch.Tensor, lse_i: torch.Tensor
) -> None:
    """Fold one partial `(out_i, lse_i)` into the running `(out, lse)`, in place (no autograd).

    This is what a context-parallel step pays per chunk pair, so it touches `out` in two passes
    (scale by w_old, add w_i · out_i) and allocates nothing of its size; `out` and `lse` may be
    views (rows of a larger accumulator).

    Args:
        out: (B, H, S, D) accumulator in lse's dtype; 0 where lse is -inf.
        lse: (B, H, S) running log-sum-exp (float32 or float64); -inf on rows with no key yet.
        out_i: (B, H, S, D) partial output, any float dtype.
        lse_i: (B, H, S) partial log-sum-exp; -inf on rows with no key.
    """
    new, w, w_i = _fold_weights(lse, lse_i)
    out.mul_(w).addcmul_(out_i, w_i)
    lse.copy_(new)


@functools.cache
def compiled_merge_into():
    """`merge_into` compiled (dynamic=False): the weights and both passes over `out` become one
    or two fused kernels instead of about ten elementwise launches per chunk pair. Inductor
    writes the mutated views in place; one graph per chunk shape."""
    return torch.compile(merge_into, dynamic=False)


def merge(
    outs: Sequence[torch.Tensor],
    lses: Sequence[torch.Tensor],
    *,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partials `(out_i, lse_i)` over disjoint key sets into `(out, lse)`; differentiable.

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
    out = torch.zeros_like(outs[0], dtype=acc_dtype)
    lse = torch.full_like(lses[0], float("-inf"), dtype=acc_dtype)
    for out_i, lse_i in zip(outs, lses, strict=True):
        lse, w, w_i = _fold_weights(lse, lse_i)
        out = torch.addcmul(out * w, out_i.to(acc_dtype), w_i)
    return out.to(outs[0].dtype if out_dtype is None else out_dtype), lse
