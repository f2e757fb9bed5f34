"""The one LSE merge: combine attention partials computed over disjoint key sets.

If `(out_i, lse_i)` is attention of the same queries over key set K_i (lse natural base, -inf
where a row saw no key), attention over the union of the K_i is

    lse = log Σ_i exp(lse_i),    out = Σ_i w_i · out_i,    w_i = exp(lse_i − lse).

Rows where every lse_i is -inf stay out = 0, lse = -inf (no NaN). `merge` combines a list
(differentiable); context-parallel calls hold a rank's partials and merge several in one pass
(accumulate.Accumulator, compiled on CUDA: `compiled_sums`); backward splits the output
gradient with the same weights (`weights`).
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


def merged_weights(lses: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(lse, [w_i]) of partials with log-sum-exps `lses`, in one pass over them: lse in the
    dtype of lses[0], each w_i (B, H, S, 1), 0 where lse_i is -inf (and on rows no partial
    reached, whose lse is -inf)."""
    dtype = lses[0].dtype
    lses = [x.to(dtype) for x in lses]
    top = functools.reduce(torch.maximum, lses)
    top = torch.where(torch.isneginf(top), 0.0, top)  # a row no partial reached: all e_i = 0
    e = [torch.exp(x - top) for x in lses]
    total = functools.reduce(torch.add, e)
    seen = total > 0
    lse = torch.where(seen, top + torch.log(torch.where(seen, total, 1.0)), float("-inf"))
    share = torch.where(seen, 1.0 / torch.where(seen, total, 1.0), 0.0)
    return lse, [(x * share).unsqueeze(-1) for x in e]


def weighted_sum(
    tensors: Sequence[torch.Tensor],
    ws: Sequence[torch.Tensor] | None,
    sum_dtype: torch.dtype,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Σ_i w_i · x_i (each w_i 1 when `ws` is None), added in `sum_dtype` in order, rounded once
    to `dtype`: a new tensor, or written into `out` and returned. `out` may be one of the x_i
    itself, but compiled, not another view of its storage (Inductor mishandles that). The
    merge's second half, and the whole of a gradient's sum."""
    total = None  # added into in place, so eager allocates nothing more than the sum
    for i, x in enumerate(tensors):
        if total is None:
            total = x.to(sum_dtype, copy=True) if ws is None else x * ws[i].to(sum_dtype)
        elif ws is None:
            total.add_(x)
        else:
            total.addcmul_(x, ws[i])
    if out is None:
        return total.to(dtype)
    return out.copy_(total)


@functools.cache
def compiled_sums():
    """`merged_weights` and `weighted_sum` compiled (dynamic=False: one graph per count, shape
    and dtype): each one kernel that reads its inputs once and writes its result, where eager
    runs an unvectorised kernel per cast and per add (about half the memory's speed on an
    H200), and about ten small launches per partial for the weights."""
    return torch.compile(merged_weights, dynamic=False), torch.compile(weighted_sum, dynamic=False)


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
    lse, ws = merged_weights(lses)
    dtype = outs[0].dtype if out_dtype is None else out_dtype
    return weighted_sum(outs, ws, lse.dtype, dtype), lse
