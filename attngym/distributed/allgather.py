"""All-gather attention: each rank gathers every K/V shard once, then attends its q shard to all.

Contract (P ranks, this rank r, an all-gather from `transport`):
    * Forward: `start([k, v])` issues the gather; while it is in flight the rank attends its q
      chunks to its own K/V shard (already local); `wait` returns the gathered (2, B, G, S, D)
      buffer, rank p's shard at rows [p·S/P, (p+1)·S/P) in layout order, and the rank attends to
      the other shards. Partials are folded in with merge.merge_into. The gathered buffer is dropped
      before returning; only the local shards, out and lse are saved.
    * Backward gathers K/V again the same way, recomputes each (q chunk, kv chunk) pair with
      autograd (weights w_i = exp(lse_i - lse)), accumulates dK/dV for the whole sequence and
      returns this rank's part of their sum over ranks with `reduce_scatter`.
    * One gather is outstanding at a time; fully masked pairs are skipped (the decision is kept
      as in ring.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from attngym.distributed.ring import (
    Accumulator,
    CPConfig,
    CPStats,
    StepClock,
    apply,
    backward_pairs,
    forward_pairs,
)
from attngym.variants.base import Variant


def _gather(cfg: CPConfig, k: torch.Tensor):
    from attngym.distributed.transport import cached

    return cached(
        cfg.transport.allgather,
        tuple(k.shape),
        2,
        2,
        dtype=k.dtype,
        device=k.device,
        timeout_s=cfg.timeout_s,
        group=cfg.group,
    )


def _others(cfg: CPConfig) -> list[int]:
    return [p for p in range(cfg.world_size) if p != cfg.rank]


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cfg: CPConfig):
        stats, clock = cfg.stats, StepClock(cfg.stats, q.device)
        s = k.shape[2]
        acc = Accumulator(q, v.shape[-1])
        ag = _gather(cfg, k) if cfg.world_size > 1 else None
        if ag is not None:
            ag.start([k, v])
            if stats is not None:
                stats.bytes_sent += 2 * k.numel() * k.element_size() * (cfg.world_size - 1)
        clock.start()
        forward_pairs(cfg, acc, q, k, v, cfg.rank)  # overlaps the gather
        clock.stop(stats.step_compute_ms if stats else [])
        if ag is not None:
            clock.start()
            kv = ag.wait([k, v])
            clock.stop(stats.step_wait_ms if stats else [])
            clock.start()
            for p in _others(cfg):
                rows = slice(p * s, (p + 1) * s)
                forward_pairs(cfg, acc, q, kv[0][:, :, rows], kv[1][:, :, rows], p)
            clock.stop(stats.step_compute_ms if stats else [])
            del kv
        out = acc.out.to(q.dtype)
        if stats is not None:
            stats.lse = acc.lse
        ctx.save_for_backward(q, k, v, out, acc.lse)
        ctx.cfg = cfg
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        cfg: CPConfig = ctx.cfg
        acc_dtype = lse.dtype
        saved = (q, out.to(acc_dtype), lse, dout.to(acc_dtype))
        s, P = k.shape[2], cfg.world_size
        dq_acc = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
        dkv_all = torch.zeros(
            (2, *k.shape[:2], s * P, k.shape[3]), dtype=acc_dtype, device=q.device
        )
        own = slice(cfg.rank * s, (cfg.rank + 1) * s)
        ag = _gather(cfg, k) if P > 1 else None
        if ag is not None:
            ag.start([k, v])
        backward_pairs(cfg, saved, k, v, cfg.rank, dq_acc, dkv_all[:, :, :, own])
        if ag is None:
            return dq_acc.to(q.dtype), dkv_all[0].to(k.dtype), dkv_all[1].to(v.dtype), None
        kv = ag.wait([k, v])
        for p in _others(cfg):
            rows = slice(p * s, (p + 1) * s)
            backward_pairs(
                cfg, saved, kv[0][:, :, rows], kv[1][:, :, rows], p, dq_acc, dkv_all[:, :, :, rows]
            )
        del kv
        if cfg.stats is not None:
            cfg.stats.bytes_sent += dkv_all.numel() * dkv_all.element_size() * (P - 1) // P
        dkv = ag.reduce_scatter(dkv_all)
        return dq_acc.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


def allgather_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    variant: Variant,
    *,
    group=None,
    transport: str = "auto",
    layout: str = "contiguous",
    backend: str = "auto",
    block_size: tuple[int, int] = (128, 128),
    kernel_options: Mapping[str, Any] | None = None,
    scale: float | None = None,
    timeout_s: float = 60.0,
    stats: CPStats | None = None,
    compile: bool = True,
    compile_mode: str = "default",
) -> torch.Tensor:
    """Attention of this rank's q shard over the whole sequence, K/V all-gathered once.

    Collective: every rank of `group` calls it with its shards (same shapes, same arguments).
    The arguments are those of `ring_attention`.

    Args:
        q: (B, H, S/P, D) this rank's query shard in `layout`.
        k, v: (B, G, S/P, D) this rank's key/value shards, G dividing H (GQA).
        variant: the attention variant, evaluated at global positions.
        group, transport, layout, backend, block_size, kernel_options, scale, timeout_s, stats,
            compile, compile_mode: as in ring_attention.

    Returns:
        (B, H, S/P, D) this rank's output shard, in q's dtype; differentiable w.r.t. q, k, v.
    """
    return apply(_AllGatherAttention, **locals())
