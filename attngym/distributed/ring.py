"""Ring attention: each rank keeps its q shard while the K/V shards travel around the ring.

Contract (P ranks, this rank r, a channel from `transport`):
    * Forward, step i = 0 .. P-1: rank r holds the K/V shard of rank (r - i) mod P (its own at
      i = 0, else `recv(i)`). It first pushes that shard on (`send(kv, i)`, for i < P-1), then
      computes its q chunks against it, so the transfer for step i + 1 overlaps the compute of
      step i. After the compute the slot is released (`release(i)`): the onward push out of it is
      queued, so the slot may be overwritten. Partials are folded in with merge.merge_into.
    * Backward recomputes each (q chunk, kv chunk) pair with autograd and weights its gradient with
      w_i = exp(lse_i - lse). K/V travel again on the same channel; dK/dV travel on a second
      channel one push behind them: a rank adds its contribution to the dK/dV of the shard it holds
      and pushes the sum on, so after P pushes every shard's dK/dV is back home.
    * Fully masked (q chunk, kv chunk) pairs are skipped. The decision (and, for flex, the chunk
      pair's BlockMask) is kept per Variant object in a weak-keyed table: it lives exactly as long
      as the variant, so calls with one variant on its device reuse it and nothing outlives it.
    * In flight at any time: one K/V push, one dK/dV push (backward), one receive per slot.

Tensors: q_BHSD (B, H, S/P, D) and k/v_BGSD (B, G, S/P, D) are this rank's shards in `layout`;
every chunk the layout gives a rank (one for contiguous, two for zigzag) is evaluated at its
global positions (attend_chunk q_offset / kv_offset).
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from collections.abc import Mapping
from typing import Any

import torch

from attngym import kernels, reference
from attngym.distributed import layout as layouts
from attngym.distributed.merge import merge_into, weights
from attngym.variants.base import Variant


@dataclasses.dataclass
class CPStats:
    """What one context-parallel call did, filled when passed as `stats=` (for tasks and tests).

    Timing a step synchronises the device around it on CUDA, so a call with stats measures steps,
    not the overlapped whole; time the whole without stats.
    """

    pairs_computed: int = 0  # (q chunk, kv chunk) pairs attended
    pairs_skipped: int = 0  # pairs skipped as fully masked
    bytes_sent: int = 0  # bytes this rank pushed or contributed to a gather
    step_compute_ms: list[float] = dataclasses.field(default_factory=list)
    step_wait_ms: list[float] = dataclasses.field(default_factory=list)  # blocked on a transfer
    lse: torch.Tensor | None = None  # (B, H, S/P) merged log-sum-exp of the last forward


@dataclasses.dataclass(frozen=True, eq=False)
class CPConfig:
    """The non-tensor arguments of one context-parallel call."""

    variant: Variant
    group: Any
    transport: Any  # transport.Transport
    layout: str
    backend: str  # resolved: flex | reference
    block_size: tuple[int, int]
    kernel_options: Mapping[str, Any] | None
    scale: float | None
    compile: bool
    compile_mode: str
    timeout_s: float
    rank: int
    world_size: int
    seq_len: int
    stats: CPStats | None


def prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    variant: Variant,
    *,
    group,
    transport: str,
    layout: str,
    backend: str,
    block_size,
    kernel_options,
    scale,
    timeout_s: float,
    stats: CPStats | None,
    compile: bool = True,
    compile_mode: str = "default",
) -> CPConfig:
    """Check the shards and arguments (ValueError naming the parameter) and resolve the choices."""
    import torch.distributed as dist

    from attngym.distributed.transport import resolve_transport

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("context-parallel attention needs an initialised process group")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D (B, H, S/P, D); got {q.shape}, {k.shape}, {v.shape}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {k.shape} and {v.shape}")
    b, h, s, d = q.shape
    if k.shape[0] != b or k.shape[2] != s or k.shape[3] != d:
        raise ValueError(f"k/v shape {tuple(k.shape)} does not match q shape {tuple(q.shape)}")
    if h % k.shape[1]:
        raise ValueError(f"kv heads ({k.shape[1]}) must divide query heads ({h})")
    if not (q.dtype == k.dtype == v.dtype and q.device == k.device == v.device):
        raise ValueError("q, k, v must share one dtype and one device")
    if len(tuple(block_size)) != 2:
        raise ValueError(f"block_size must be (q, kv), got {block_size!r}")
    world_size = dist.get_world_size(group)
    seq_len = s * world_size
    layouts.check_seq_len(seq_len, world_size, layout)
    variant.check_seq_len(seq_len)
    if variant.device is not None and variant.device != q.device:
        variant = variant.to(q.device)
    return CPConfig(
        variant=variant,
        group=group,
        transport=resolve_transport(transport, q.device, group),
        layout=layout,
        backend=kernels.resolve_backend(backend, q.device),
        block_size=tuple(int(x) for x in block_size),
        kernel_options=kernel_options,
        scale=scale,
        compile=bool(compile),
        compile_mode=compile_mode,
        timeout_s=float(timeout_s),
        rank=dist.get_rank(group),
        world_size=world_size,
        seq_len=seq_len,
        stats=stats,
    )


# Variant -> {(batch, heads, q chunk, kv chunk, block size, backend, device): (skip, block_mask)}.
# Weak keys: an entry (with its device BlockMasks) goes when its Variant is collected, so a caller
# whose variant prepare() moves to the device on every call builds per call and leaks nothing.
_PLANS: weakref.WeakKeyDictionary[Variant, dict[tuple, tuple[bool, Any]]] = (
    weakref.WeakKeyDictionary()
)


def _pair_plan(
    variant: Variant,
    batch: int,
    heads: int,
    q_chunk: tuple[int, int],
    kv_chunk: tuple[int, int],
    block_size: tuple[int, int],
    backend: str,
    device: torch.device,
):
    """(skip, block_mask) for one chunk pair: skip when the variant masks every entry.

    Reference backend: the exact dense mask over (B, H) decides (the mask is small there). Flex:
    the block mask the kernel uses anyway decides, and is kept for it. Memoised in _PLANS.
    """
    plans = _PLANS.setdefault(variant, {})
    key = (batch, heads, q_chunk, kv_chunk, block_size, backend, device)
    if key not in plans:
        plans[key] = _build_pair_plan(
            variant, batch, heads, q_chunk, kv_chunk, block_size, backend, device
        )
    return plans[key]


def _build_pair_plan(variant, batch, heads, q_chunk, kv_chunk, block_size, backend, device):
    if variant.mask_mod is None:
        return False, None
    if backend == "reference":
        q_pos = torch.arange(q_chunk[0], q_chunk[0] + q_chunk[1], device=device)
        kv_pos = torch.arange(kv_chunk[0], kv_chunk[0] + kv_chunk[1], device=device)
        keep = reference.dense_mask(variant.mask_mod, batch, heads, q_pos, kv_pos)
        return not bool(keep.any()), None
    block_mask = kernels.make_block_mask(
        variant,
        q_chunk[1],
        kv_chunk[1],
        q_offset=q_chunk[0],
        kv_offset=kv_chunk[0],
        block_size=block_size,
        device=device,
    )
    return kernels.block_mask_is_empty(block_mask), block_mask


def pairs(cfg: CPConfig, q: torch.Tensor, kv_rank: int):
    """The (q rows, kv rows, q chunk, kv chunk, block_mask) pairs to compute against kv_rank.

    Rows are local slices of this rank's q shard and of kv_rank's shard; chunks are global
    (offset, length). Skipped pairs are counted in cfg.stats.
    """
    q_chunks = layouts.chunks(cfg.rank, cfg.world_size, cfg.seq_len, cfg.layout)
    kv_chunks = layouts.chunks(kv_rank, cfg.world_size, cfg.seq_len, cfg.layout)
    out = []
    q_start = 0
    for qc in q_chunks:
        kv_start = 0
        for kc in kv_chunks:
            skip, block_mask = _pair_plan(
                cfg.variant,
                q.shape[0],
                q.shape[1],
                qc,
                kc,
                cfg.block_size,
                cfg.backend,
                q.device,
            )
            if cfg.stats is not None:
                cfg.stats.pairs_skipped += int(skip)
                cfg.stats.pairs_computed += int(not skip)
            if not skip:
                out.append(
                    (
                        slice(q_start, q_start + qc[1]),
                        slice(kv_start, kv_start + kc[1]),
                        qc,
                        kc,
                        block_mask,
                    )
                )
            kv_start += kc[1]
        q_start += qc[1]
    return out


def _attend(cfg: CPConfig, q, k, v, qc, kc, block_mask):
    return kernels.attend_chunk(
        q,
        k,
        v,
        cfg.variant,
        q_offset=qc[0],
        kv_offset=kc[0],
        backend=cfg.backend,
        block_size=cfg.block_size,
        block_mask=block_mask,
        kernel_options=cfg.kernel_options,
        scale=cfg.scale,
        compile=cfg.compile,
        compile_mode=cfg.compile_mode,
    )


class Accumulator:
    """Running merge of partial (out, lse) per q row of this rank's shard, in the lse dtype."""

    def __init__(self, q: torch.Tensor, dv: int):
        self.acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        b, h, s, _ = q.shape
        self.out = torch.zeros((b, h, s, dv), dtype=self.acc_dtype, device=q.device)
        self.lse = torch.full((b, h, s), float("-inf"), dtype=self.acc_dtype, device=q.device)

    def add(self, rows: slice, out_i: torch.Tensor, lse_i: torch.Tensor) -> None:
        merge_into(self.out[:, :, rows], self.lse[:, :, rows], out_i, lse_i)


def forward_pairs(cfg: CPConfig, acc: Accumulator, q, k, v, kv_rank: int) -> None:
    """Attend this rank's q chunks to kv_rank's K/V shard and merge into `acc`."""
    for q_rows, kv_rows, qc, kc, block_mask in pairs(cfg, q, kv_rank):
        out_i, lse_i = _attend(
            cfg, q[:, :, q_rows], k[:, :, kv_rows], v[:, :, kv_rows], qc, kc, block_mask
        )
        acc.add(q_rows, out_i, lse_i)


def backward_pairs(
    cfg: CPConfig, saved, k, v, kv_rank: int, dq_acc: torch.Tensor, dkv_acc: torch.Tensor
) -> None:
    """Add the gradients of the pairs against kv_rank's shard: dq into dq_acc, dK/dV into dkv_acc.

    Args:
        saved: (q, out, lse, dout) of this rank: (B, H, S/P, D) x3 and lse (B, H, S/P).
        k, v: kv_rank's shard (B, G, S/P, D).
        dq_acc: (B, H, S/P, D) float accumulator of this rank's dq.
        dkv_acc: (2, B, G, S/P, D) float accumulator of kv_rank's dK, dV.
    """
    q, out, lse, dout = saved
    for q_rows, kv_rows, qc, kc, block_mask in pairs(cfg, q, kv_rank):
        with torch.enable_grad():
            q_i = q[:, :, q_rows].detach().requires_grad_()
            k_i = k[:, :, kv_rows].detach().requires_grad_()
            v_i = v[:, :, kv_rows].detach().requires_grad_()
            out_i, lse_i = _attend(cfg, q_i, k_i, v_i, qc, kc, block_mask)
            w = weights(lse_i.detach().to(lse.dtype), lse[:, :, q_rows])
            dout_r = dout[:, :, q_rows]
            g_out = (w.unsqueeze(-1) * dout_r).to(out_i.dtype)
            g_lse = w * (dout_r * (out_i.detach().to(lse.dtype) - out[:, :, q_rows])).sum(-1)
            dq, dk, dv = torch.autograd.grad(
                [out_i, lse_i], [q_i, k_i, v_i], [g_out, g_lse.to(lse_i.dtype)]
            )
        dq_acc[:, :, q_rows] += dq
        dkv_acc[0, :, :, kv_rows] += dk
        dkv_acc[1, :, :, kv_rows] += dv


class StepClock:
    """Per-step host timings for CPStats (synchronising the device when stats are wanted)."""

    def __init__(self, stats: CPStats | None, device: torch.device):
        self.stats, self.device = stats, device
        self.t = 0.0

    def start(self) -> None:
        if self.stats is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.t = time.perf_counter()

    def stop(self, into: list[float]) -> None:
        if self.stats is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            into.append((time.perf_counter() - self.t) * 1e3)


def _channel(cfg: CPConfig, like: torch.Tensor, dtype: torch.dtype, tag: str):
    from attngym.distributed.transport import cached

    return cached(
        cfg.transport.channel,
        tuple(like.shape),
        2,
        dtype=dtype,
        device=like.device,
        timeout_s=cfg.timeout_s,
        group=cfg.group,
        tag=tag,
    )


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cfg: CPConfig):
        P, r = cfg.world_size, cfg.rank
        stats, clock = cfg.stats, StepClock(cfg.stats, q.device)
        acc = Accumulator(q, v.shape[-1])
        kv = torch.stack([k, v])
        chan = _channel(cfg, k, k.dtype, "kv") if P > 1 else None
        for i in range(P):
            if i > 0:
                clock.start()
                kv = chan.recv(i)
                clock.stop(stats.step_wait_ms if stats else [])
            if i < P - 1:
                chan.send(kv, i)  # the transfer of step i + 1 overlaps this step's compute
                if stats is not None:
                    stats.bytes_sent += kv.numel() * kv.element_size()
            clock.start()
            forward_pairs(cfg, acc, q, kv[0], kv[1], (r - i) % P)
            clock.stop(stats.step_compute_ms if stats else [])
            if i > 0:
                chan.release(i)
        if chan is not None:
            chan.join()
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
        P, r = cfg.world_size, cfg.rank
        acc_dtype = lse.dtype
        saved = (q, out.to(acc_dtype), lse, dout.to(acc_dtype))
        dq_acc = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
        kv = torch.stack([k, v])
        if P == 1:
            dkv = torch.zeros(kv.shape, dtype=acc_dtype, device=q.device)
            backward_pairs(cfg, saved, k, v, r, dq_acc, dkv)
            return dq_acc.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None
        kv_chan = _channel(cfg, k, k.dtype, "kv")
        dkv_chan = _channel(cfg, k, acc_dtype, "dkv")
        stats = cfg.stats
        for i in range(P):
            if i > 0:
                kv = kv_chan.recv(i)
            if i < P - 1:
                kv_chan.send(kv, i)
            dkv = torch.zeros(kv.shape, dtype=acc_dtype, device=q.device)
            backward_pairs(cfg, saved, kv[0], kv[1], (r - i) % P, dq_acc, dkv)
            if i > 0:
                dkv = dkv + dkv_chan.recv(i)  # the shard's dK/dV so far, one push behind K/V
            dkv_chan.send(dkv, i)  # at i = P - 1 this push reaches the shard's home rank
            if stats is not None:
                stats.bytes_sent += kv.numel() * kv.element_size() * (i < P - 1)
                stats.bytes_sent += dkv.numel() * dkv.element_size()
            if i > 0:
                kv_chan.release(i)
                dkv_chan.release(i)
        dkv = dkv_chan.recv(P).clone()
        dkv_chan.release(P)
        kv_chan.join()
        dkv_chan.join()
        return dq_acc.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


def ring_attention(
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
    """Attention of this rank's q shard over the whole sequence, K/V passed around a ring.

    Collective: every rank of `group` calls it with its shards (same shapes, same arguments).

    Args:
        q: (B, H, S/P, D) this rank's query shard in `layout`.
        k, v: (B, G, S/P, D) this rank's key/value shards, G dividing H (GQA).
        variant: the attention variant, evaluated at global positions. Pass it already on q's
            device to reuse its chunk block masks across calls (see the module docstring).
        group: process group of the P ranks (default: the world).
        transport: auto | copy_engine | nccl | gloo (see attngym.distributed.transport).
        layout: contiguous | zigzag (see attngym.distributed.layout).
        backend: chunk kernel, auto | flex | reference (auto: flex on CUDA, reference on CPU).
        block_size: (q, kv) block size of the chunk block masks.
        kernel_options: passed to flex_attention.
        scale: score scale, default 1 / sqrt(D).
        timeout_s: how long a CPU transfer may wait before RankFailure.
        stats: filled with pair counts, bytes and per-step timings when given.
        compile: compile the flex chunk kernel (False: eager flex_attention); see
            attngym.kernels.attend_chunk.
        compile_mode: torch.compile mode when compiling (attngym.kernels.COMPILE_MODES).

    Returns:
        (B, H, S/P, D) this rank's output shard, in q's dtype; differentiable w.r.t. q, k, v.
    """
    return apply(_RingAttention, **locals())


def apply(function: type[torch.autograd.Function], q, k, v, variant, **options) -> torch.Tensor:
    """Check and resolve the arguments (prepare), then run `function` (ring or all-gather).

    The one body of ring_attention and allgather_attention: they differ only in `function`.
    """
    return function.apply(q, k, v, prepare(q, k, v, variant, **options))
