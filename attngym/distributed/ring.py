"""Ring attention: each rank keeps its q shard while the K/V shards travel around the ring.

Contract (P ranks, this rank r, a channel from `transport`):
    * Forward, step i = 0 .. P-1: rank r holds the K/V shard of rank (r - i) mod P (its own at
      i = 0, else `recv(i)`). It first pushes that shard on (`send(kv, i)`, for i < P-1), then
      computes its q chunks against it, so the transfer for step i + 1 overlaps the compute of
      step i. After the compute the slot is released (`release(i)`): the onward push out of it is
      queued, so the slot may be overwritten. Partials are folded in with merge.merge_into.
    * Backward computes each (q chunk, kv chunk) pair's gradient from the merged out and lse
      (CPOptions.backward: flex's backward op, or the pair's forward re-run; see cp.py). K/V
      travel again on the same channel; dK/dV travel on a second
      channel one push behind them: a rank adds its contribution to the dK/dV of the shard it holds
      and pushes the sum on, so after P pushes every shard's dK/dV is back home.
    * Fully masked (q chunk, kv chunk) pairs are skipped (cp.pairs: the decision and the pair's
      BlockMask live as long as the Variant object).
    * In flight at any time: one K/V push, one dK/dV push (backward), one receive per slot.

Tensors: q_BHSD (B, H, S/P, D) and k/v_BGSD (B, G, S/P, D) are this rank's shards in `layout`;
every chunk the layout gives a rank (one for contiguous, two for zigzag, some for balanced) is
evaluated at its global positions (attend_chunk q_offset / kv_offset).
"""

from __future__ import annotations

from typing import Any

import torch

from attngym.distributed.cp import (
    Accumulator,
    CPCall,
    CPOptions,
    CPStats,
    Saved,
    StepClock,
    backward_pairs,
    forward_pairs,
    run,
    shards_meet,
)
from attngym.distributed.layout import Layout
from attngym.variants.base import Variant

__all__ = ["CPOptions", "CPStats", "ring_attention"]


def _channel(call: CPCall, like: torch.Tensor, dtype: torch.dtype, tag: str, hops: int = -1):
    """The cached channel for `tag`: pushes `hops` ranks back (-1: to the next rank, the ring)."""
    from attngym.distributed.transport import cached

    P, r = call.world_size, call.rank
    return cached(
        call.transport.channel,
        tuple(like.shape),
        2,
        dtype=dtype,
        device=like.device,
        timeout_s=call.options.timeout_s,
        group=call.group,
        tag=tag,
        src=(r + hops) % P,
        dst=(r - hops) % P,
    )


def ring_steps(call: CPCall, q: torch.Tensor) -> int:
    """How many ring steps the mask needs: 1 + the farthest hop at which a shard is still read.

    Shard s visits ranks s + 1, s + 2, ... (mod P); past the last one whose queries meet it
    nothing downstream reads it, so the ring stops there (every rank computes the same plan).
    Causal masks need all P steps; local masks (sliding_window, chunked_causal, natten, short
    documents) often far fewer at P > 2.
    """
    P = call.world_size
    last = 0
    for s in range(P):
        for hop in range(P - 1, last, -1):
            if shards_meet(call, q, (s + hop) % P, s):
                last = hop
                break
    return last + 1


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cfg: CPCall):
        P, r = cfg.world_size, cfg.rank
        steps = ring_steps(cfg, q)
        stats, clock = cfg.stats, StepClock(cfg.stats, q.device)
        acc = Accumulator.of(cfg, q, v.shape[-1])
        kv = torch.stack([k, v])
        chan = _channel(cfg, k, k.dtype, "kv") if steps > 1 else None
        for i in range(steps):
            if i > 0:
                clock.start()
                kv = chan.recv(i)
                clock.stop("step_wait_ms")
            if i < steps - 1:
                chan.send(kv, i)  # the transfer of step i + 1 overlaps this step's compute
                if stats is not None:
                    stats.bytes_sent += kv.numel() * kv.element_size()
            clock.start()
            forward_pairs(cfg, acc, q, kv[0], kv[1], (r - i) % P)
            clock.stop("step_compute_ms")
            if i > 0:
                chan.release(i)
        if chan is not None:
            chan.join()
        out = acc.out.to(q.dtype)
        if stats is not None:
            stats.lse = acc.lse
        ctx.save_for_backward(q, k, v, out, acc.lse)
        ctx.cfg, ctx.steps = cfg, steps
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        cfg: CPCall = ctx.cfg
        P, r, steps = cfg.world_size, cfg.rank, ctx.steps
        acc_dtype = lse.dtype
        saved = Saved(q, out, lse, dout)
        dq_acc = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
        kv = torch.stack([k, v])
        if steps == 1:  # no shard leaves its rank
            dkv = torch.zeros(kv.shape, dtype=acc_dtype, device=q.device)
            backward_pairs(cfg, saved, k, v, r, dq_acc, dkv)
            return dq_acc.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None
        kv_chan = _channel(cfg, k, k.dtype, "kv")
        dkv_chan = _channel(cfg, k, acc_dtype, "dkv")
        # The last push takes each shard's dK/dV home: one more ring hop after all P steps, else
        # straight back over the steps - 1 hops it travelled (a channel to that peer).
        home = dkv_chan if steps == P else _channel(cfg, k, acc_dtype, "dkv_home", hops=steps - 1)
        stats = cfg.stats
        for i in range(steps):
            if i > 0:
                kv = kv_chan.recv(i)
            if i < steps - 1:
                kv_chan.send(kv, i)
            dkv = torch.zeros(kv.shape, dtype=acc_dtype, device=q.device)
            backward_pairs(cfg, saved, kv[0], kv[1], (r - i) % P, dq_acc, dkv)
            if i > 0:
                dkv = dkv + dkv_chan.recv(i)  # the shard's dK/dV so far, one push behind K/V
            if i < steps - 1 or home is dkv_chan:
                dkv_chan.send(dkv, i)  # with steps == P, the push at i = P - 1 reaches home
            else:
                home.send(dkv, 0)
            if stats is not None:
                stats.bytes_sent += kv.numel() * kv.element_size() * (i < steps - 1)
                stats.bytes_sent += dkv.numel() * dkv.element_size()
            if i > 0:
                kv_chan.release(i)
                dkv_chan.release(i)
        last = steps if home is dkv_chan else 1
        dkv = home.recv(last).clone()
        home.release(last)
        for chan in {id(c): c for c in (kv_chan, dkv_chan, home)}.values():
            chan.join()
        return dq_acc.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    variant: Variant,
    *,
    group=None,
    transport: str = "auto",
    layout: str | Layout = "contiguous",
    options: CPOptions | None = None,
    stats: CPStats | None = None,
    **overrides: Any,
) -> torch.Tensor:
    """Attention of this rank's q shard over the whole sequence, K/V passed around a ring.

    Collective: every rank of `group` calls it with its shards (same shapes, same arguments).

    Args:
        q: (B, H, S/P, D) this rank's query shard in `layout`.
        k, v: (B, G, S/P, D) this rank's key/value shards, G dividing H (GQA).
        variant: the attention variant, evaluated at global positions. Pass it already on q's
            device to reuse its chunk block masks across calls (see the module docstring).
        group: process group of the P ranks (default: the world).
        transport: auto | copy_engine | nccl | gloo (see attngym.distributed.transport).
        layout: contiguous | zigzag | balanced, or a Layout (see attngym.distributed.layout).
        options: kernel and backward choices (CPOptions; default CPOptions()).
        stats: filled with pair counts, bytes and per-step timings when given.
        **overrides: any CPOptions field on top of `options` (backend, block_size,
            kernel_options, scale, timeout_s, compile, compile_mode, backward).

    Returns:
        (B, H, S/P, D) this rank's output shard, in q's dtype; differentiable w.r.t. q, k, v.
    """
    return run(
        _RingAttention,
        q,
        k,
        v,
        variant,
        group=group,
        transport=transport,
        layout=layout,
        options=options,
        stats=stats,
        **overrides,
    )
