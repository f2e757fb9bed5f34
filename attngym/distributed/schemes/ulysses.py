"""Head-parallel (Ulysses) attention (hybrid, Ulysses inside groups:
attngym.distributed.schemes.hybrid).

DeepSpeed-Ulysses (Jacobs et al., 2023, arXiv:2309.14509): each rank trades its sequence shard of
every head for the whole sequence of H/P heads, runs one ordinary attention call (no offsets, no
merge, any mask) and trades the output back. TransformerEngine calls it `cp_comm_type=a2a`; the
hybrid is its `a2a+p2p` and USP's (Fang and Zhao, 2024, arXiv:2405.07719) two-level scheme.

Contract (P ranks, this rank r, an all-to-all from `transport`):
    * Forward: q (B, H, S/P, D) and k, v (B, G, S/P, D) in `layout` go through the all-to-all to
      q_h (B, H/P, S, D) and k_h, v_h (B, R/P, S, D), the sequence in global order (the exchange
      places every layout chunk at its global position: no reorder). R = lcm(G, P): K/V heads are
      split when P divides G and replicated (repeat_interleave) up to R otherwise, so rank r's
      query heads r·H/P .. (r+1)·H/P - 1 find their K/V heads locally. One flex call
      (kernels.attend_chunk; the dense reference on CPU) computes out_h (B, H/P, S, D), with the
      variant's head index moved to the global head (kernels.shifted_heads: ALiBi's slopes), and
      the inverse all-to-all returns out (B, H, S/P, D) in `layout`.
    * Backward: autograd through flex's (or the reference's) backward and the all-to-alls, whose
      backward is the inverse exchange (attngym.distributed.transport.parts.AllToAllFunction).
    * The all-to-all outputs are fresh tensors (autograd saves them); the transport objects and
      their buffers are cached per (shapes, group) by attngym.distributed.transport.cached.

Tensors: q_BHSD is this rank's shard in `layout`; _h names the head-sharded whole sequence.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import weakref
from collections.abc import Callable
from typing import Any

import torch

from attngym import kernels
from attngym.distributed.call.cp import (
    CPOptions,
    CPStats,
    StepClock,
    attend_chunk,
    check_shards,
    options_from,
)
from attngym.distributed.model.simulate import Item, SimulatedCall, Simulation
from attngym.distributed.model.transfer_model import (
    Fabric,
    Prediction,
    RankWork,
    predict,
)
from attngym.distributed.placement import layout as layouts
from attngym.distributed.schemes.spec import TopologySpec
from attngym.errors import ConfigError
from attngym.variants.base import Variant

# The layouts whose shards the all-to-all puts back in global order (exchange_order): a balanced
# placement would need its variant's plan on every exchange.
HEAD_PARALLEL_LAYOUTS = layouts.FIXED_LAYOUTS


def check_layout(fn: str, layout: Any, allowed: tuple[str, ...] = HEAD_PARALLEL_LAYOUTS) -> None:
    """ValueError naming `layout` unless the all-to-all takes it (one of `allowed`)."""
    if not isinstance(layout, str) or layout not in allowed:
        raise ValueError(
            f"layout: {fn} takes one of {', '.join(allowed)} (the all-to-all puts those shards "
            f"back in global order), got {layout!r}"
        )


def check_ulysses_heads(heads: int, kv_heads: int | None, world_size: int) -> None:
    """ValueError unless `heads` query heads (and `kv_heads` K/V heads) split over world_size.

    Args:
        heads: query heads H.
        kv_heads: K/V heads G (None: H), dividing H.
        world_size: ranks sharing the heads (P, or a2a_size in hybrid).

    Raises:
        ValueError: naming `heads` or `kv_heads`, the values and what would be allowed.
    """
    kv = heads if kv_heads is None else kv_heads
    if heads % world_size:
        raise ValueError(
            f"heads: {heads} query heads cannot be split over {world_size} ranks for head-"
            f"parallel (Ulysses) attention; use a multiple of {world_size}"
        )
    if kv < 1 or heads % kv:
        raise ValueError(f"kv_heads: {kv} must be a positive divisor of heads ({heads})")


def exchange_order(layout: str, world_size: int, seq_len: int) -> tuple[tuple[int, ...], ...]:
    """Per rank, the global piece indices of its chunks in `layout`: the all-to-all's concat order
    that puts every rank's shard of a seq_len sequence at its global place (split order back)."""
    piece = seq_len // layouts.pieces(layout, world_size)
    return tuple(
        tuple(off // piece for off, _ in layouts.chunks(r, world_size, seq_len, layout))
        for r in range(world_size)
    )


# Variant -> {(head offset, heads, seq_len, block size, backend, device): (shifted variant,
# block_mask)}. Weak keys, as ring.py's plans: an entry goes with its Variant, so nothing outlives
# the caller's.
_PLANS: weakref.WeakKeyDictionary[Variant, dict[tuple, tuple[Variant, Any]]] = (
    weakref.WeakKeyDictionary()
)


def head_plan(variant, head_offset, heads, seq_len, block_size, backend, device):
    """The head-shifted variant and, for flex, its whole-sequence BlockMask; memoised. heads:
    the local head count when the shift is a table (kernels.offsets_as_tables), else None."""
    plans = _PLANS.setdefault(variant, {})
    key = (head_offset, heads, seq_len, block_size, backend, device)
    if key not in plans:
        shifted = kernels.shifted_heads(variant, head_offset, device, heads=heads)
        block_mask = None
        if backend == "flex":
            block_mask = kernels.make_block_mask(
                shifted, seq_len, seq_len, block_size=block_size, device=device
            )
        plans[key] = (shifted, block_mask)
    return plans[key]


def _prepared(q, k, v, variant, group, transport: str, layout: str):
    """The exchange's checks, then (P, this rank, the all-to-all class, the variant on q's
    device, k and v with their heads repeated up to lcm(G, P): fewer K/V heads than ranks, or
    not a multiple)."""
    import torch.distributed as dist

    from attngym.distributed.transport import check_transport, resolve_transport

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("head-parallel attention needs an initialised process group")
    check_shards(q, k, v)
    check_transport(transport, q.device)
    P, r = dist.get_world_size(group), dist.get_rank(group)
    check_ulysses_heads(q.shape[1], k.shape[1], P)
    layouts.check_seq_len(q.shape[2] * P, P, layout)
    if variant.device is not None and variant.device != q.device:
        variant = variant.to(q.device)
    cls = resolve_transport(transport, q.device, group).alltoall if P > 1 else None
    replicas = math.lcm(k.shape[1], P) // k.shape[1]
    if replicas > 1:
        k, v = (t.repeat_interleave(replicas, dim=1) for t in (k, v))
    return P, r, cls, variant, k, v


def exchange(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    variant: Variant,
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Variant, int], torch.Tensor],
    *,
    group,
    transport: str,
    layout: str,
    timeout_s: float,
    stats,
) -> torch.Tensor:
    """All-to-all q, k, v to heads inside `group`, `attend` them, all-to-all the output back.

    `attend(q_h, k_h, v_h, variant, head_offset)` sees (B, H/P, S_g, D) and (B, R/P, S_g, D),
    S_g the group's sequence (in global order for Ulysses, the next level's layout for hybrid),
    the variant on q's device and the global index of local head 0.
    """
    from attngym.distributed.transport import cached

    P, r, cls, variant, k, v = _prepared(q, k, v, variant, group, transport, layout)
    b, h, s, d = q.shape
    if P == 1:  # nothing to exchange (hybrid with a2a_size 1 is ring or all-gather alone)
        return attend(q, k, v, variant, 0)
    order = exchange_order(layout, P, s * P)

    def a2a(like: torch.Tensor, parts: int, forward: bool):
        split, concat = (1, 2) if forward else (2, 1)
        return cached(
            cls,
            tuple(like.shape),
            parts,
            split,
            concat,
            dtype=q.dtype,
            device=q.device,
            timeout_s=timeout_s,
            **({"concat_order": order} if forward else {"split_order": order}),
            group=group,
        )

    if k.shape == q.shape:
        q_h, k_h, v_h = a2a(q, 3, True)([q, k, v]).unbind(0)
    else:
        q_h = a2a(q, 1, True)([q])[0]
        k_h, v_h = a2a(k, 2, True)([k, v]).unbind(0)
    out_h = attend(q_h, k_h, v_h, variant, r * (h // P))
    _count_sent(stats, q, k, v, P)
    return a2a(out_h, 1, False)([out_h])[0]


def _count_sent(stats: CPStats | None, q, k, v, P: int) -> None:
    """What this rank sends (q, k, v out; the output back; K/V heads as repeated) into stats."""
    if stats is not None:
        sent = q.numel() + k.numel() + v.numel() + q.numel()
        stats.bytes_sent += sent * q.element_size() * (P - 1) // P


@dataclasses.dataclass(frozen=True)
class UlyssesOptions:
    """ulysses' own options: topology.options.<field>, ulysses_attention's keywords."""

    pipeline: bool = False
    """Exchange the layout's pieces round by round (zigzag: two; double_zigzag: four), each round
    attended while the next arrives and its output and gradients sent home once final
    (ulysses_rounds); False: one all-to-all before the one call and one after."""


def _ulysses_options(
    options: CPOptions | None, overrides: dict[str, Any], pipeline: bool = False
) -> CPOptions:
    """The call's CPOptions; ValueError for a `backward` choice without `pipeline`, which has
    nothing to act on there (no chunk pairs: autograd differentiates the one kernel call and the
    all-to-alls)."""
    opts = options_from(options, **overrides)
    if opts.backward != "auto" and not pipeline:
        raise ValueError(
            f"backward: ulysses_attention differentiates its one kernel call with autograd; "
            f"only 'auto' is allowed, got {opts.backward!r}"
        )
    return opts


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    variant: Variant,
    *,
    group=None,
    transport: str = "auto",
    layout: str = "contiguous",
    pipeline: bool = False,
    options: CPOptions | None = None,
    stats: CPStats | None = None,
    **overrides: Any,
) -> torch.Tensor:
    """Attention of this rank's shards, head-parallel: all-to-all, one flex call, all-to-all back.

    Collective: every rank of `group` calls it with its shards (same shapes, same arguments).

    Args:
        q: (B, H, S/P, D) this rank's query shard in `layout`; P must divide H.
        k, v: (B, G, S/P, D) this rank's key/value shards, G dividing H (GQA).
        variant: the attention variant, at global positions and global head indices. Pass it
            already on q's device to reuse its block mask across calls.
        group: process group of the P ranks (default: the world).
        transport: auto | copy_engine | nccl | gloo (attngym.distributed.transport).
        layout: contiguous | zigzag | double_zigzag (HEAD_PARALLEL_LAYOUTS;
            attngym.distributed.placement.layout).
        pipeline: UlyssesOptions.pipeline: the exchanges in rounds (zigzag, double_zigzag), each
            round's calls beside the next round's exchange
            (attngym.distributed.schemes.ulysses_rounds).
        options: kernel choices (CPOptions; default CPOptions()). block_size is that of the
            whole-sequence block mask; backward must stay auto without `pipeline`: the gradient
            is autograd's through the one kernel call and the all-to-alls, with no pairs to
            choose for (with it: flex's backward op of each call, or the call re-run).
        stats: a CPStats; its bytes_sent grows by what this rank sends.
        **overrides: any CPOptions field on top of `options`, as in ring_attention.

    Returns:
        (B, H, S/P, D) this rank's output shard, in q's dtype; differentiable w.r.t. q, k, v.

    Raises:
        ValueError: a layout other than contiguous or zigzag (`layout`; with `pipeline`, zigzag),
            P does not divide H (`heads`), a backward other than auto without `pipeline`, or a
            bad option, shape or sequence length.
    """
    import torch.distributed as dist

    check_layout("ulysses_attention", layout)
    opts = _ulysses_options(options, overrides, pipeline)
    resolved = kernels.resolve_backend(opts.backend, q.device)
    block = opts.block_size
    ranks = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 0
    if ranks:
        variant.check_seq_len(q.shape[2] * ranks)
    if pipeline and ranks > 1:  # one rank has nothing to exchange: its one call as below
        return _in_rounds(q, k, v, variant, group=group, transport=transport, layout=layout,
                          options=opts, stats=stats)  # fmt: skip

    tables = kernels.offsets_as_tables(opts.kernel_options)

    def attend(q_h, k_h, v_h, variant_d, head_offset):
        heads = q_h.shape[1] if tables else None
        shifted, block_mask = head_plan(
            variant_d, head_offset, heads, q_h.shape[2], block, resolved, q.device
        )
        if stats is not None:
            stats.pairs_computed += 1
        return attend_chunk(q_h, k_h, v_h, shifted, options=opts, block_mask=block_mask)[0]

    return exchange(
        q,
        k,
        v,
        variant,
        attend,
        group=group,
        transport=transport,
        layout=layout,
        timeout_s=opts.timeout_s,
        stats=stats,
    )


def _in_rounds(q, k, v, variant, *, group, transport, layout, options: CPOptions, stats):
    """ulysses_attention with pipeline=True: the exchanges and calls of ulysses_rounds."""
    from attngym.distributed.schemes import ulysses_rounds as rounds

    P, r, cls, variant, k, v = _prepared(q, k, v, variant, group, transport, layout)
    b, h, s, d = q.shape
    where = rounds.round_pieces(layout, exchange_order(layout, P, s * P))
    hp = h // P
    calls = rounds.round_calls(variant, r * hp, hp, s * P, len(where), options, q.device)
    if stats is not None:
        stats.pairs_computed += sum(len(calls.plan.calls(j)) for j in range(len(where)))
        stats.backward = calls.backward
    ex = rounds.exchanges(cls, q, k, where, group=group, timeout_s=options.timeout_s)
    _count_sent(stats, q, k, v, P)
    return rounds.rounds_attention(q, k, v, calls, ex)


def alltoall_transfer_ms(
    transport, k_s: torch.Tensor, timeout_s: float, repeats: int
) -> list[float]:
    """Times of the Ulysses all-to-all of K and V alone (sequence shards to head slices; the step
    clock of CPStats), K/V heads repeated up to a multiple of the ranks as ulysses_attention
    does. Collective over the world."""
    world_size = torch.distributed.get_world_size()
    heads = k_s.shape[1]
    kv = k_s.detach().repeat_interleave(math.lcm(heads, world_size) // heads, dim=1)
    a2a = transport.alltoall(
        tuple(kv.shape), 2, 1, 2, dtype=kv.dtype, device=kv.device, timeout_s=timeout_s
    )
    stats = CPStats()
    clock = StepClock(stats, kv.device)
    for _ in range(repeats):
        clock.start()
        a2a.exchange([kv, kv])
        clock.stop("step_wait_ms")
    return stats.step_wait_ms


# ---------------------------------------------------------------------------------------------
# Simulated and priced (topology.simulate=true; attngym.distributed.model.simulate, transfer_model).


@dataclasses.dataclass(frozen=True)
class SimulatedHeads:
    """What every simulated Ulysses rank holds after the exchange, whichever way it attends:
    per rank (q_h, k_h, v_h, grad_out_h or None), its global head offset, and its exchanges:
    `fwd_bytes` (q/k/v in) and `tail_bytes` (the output back) as the transfer model reads them,
    `sent` as CPStats counts a forward, `peak_bytes` the head slices held (beside a call's own)."""

    ranks: list[tuple]
    head_offsets: list[int]
    fwd_bytes: float
    tail_bytes: float
    sent: int
    peak_bytes: int


def simulated_heads(sc: SimulatedCall) -> SimulatedHeads:
    """Every rank's head slice of the whole sequence, K/V heads repeated up to lcm(G, P) as the
    all-to-all does; the exchanges' bytes as exchange counts them."""
    q, k, v, P = sc.q, sc.k, sc.v, sc.world_size
    b, h, seq_len, d = q.shape
    check_ulysses_heads(h, k.shape[1], P)
    replicas = math.lcm(k.shape[1], P) // k.shape[1]
    k_rep, v_rep = (t.repeat_interleave(replicas, dim=1) for t in (k, v))
    hp, rp = h // P, k_rep.shape[1] // P
    ranks = []
    for r in range(P):
        q_h, k_h, v_h = (
            t[:, r * n : (r + 1) * n].contiguous() for t, n in ((q, hp), (k_rep, rp), (v_rep, rp))
        )
        g = sc.grad_out
        ranks.append(
            (q_h, k_h, v_h, None if g is None else g[:, r * hp : (r + 1) * hp].contiguous())
        )
    itemsize = q.element_size()
    qkv_bytes, out_bytes = exchange_bytes(b, h, k_rep.shape[1], seq_len // P, d, itemsize)
    return SimulatedHeads(
        ranks=ranks,
        head_offsets=[r * hp for r in range(P)],
        fwd_bytes=qkv_bytes * (P - 1) / P,
        tail_bytes=out_bytes * (P - 1) / P,
        sent=(qkv_bytes + out_bytes) * (P - 1) // P,
        peak_bytes=(2 * hp + 2 * rp) * b * seq_len * d * itemsize,
    )


def simulate_ulysses(sc: SimulatedCall) -> Simulation:
    """Every rank's one call on its head slice of the whole sequence (simulated_heads), with the
    head-shifted variant and block mask of ulysses_attention. With pipeline, the rounds' calls
    (ulysses_rounds.simulate_rounds); without it on a layout whose pieces make rounds (zigzag,
    double_zigzag), the rounds are offered to `auto` as an alternative."""
    heads = simulated_heads(sc)
    if sc.scheme_options.get("pipeline") and sc.world_size > 1:
        from attngym.distributed.schemes import ulysses_rounds as rounds

        order = exchange_order(sc.layout, sc.world_size, sc.q.shape[2])
        return rounds.simulate_rounds(sc, len(rounds.round_pieces(sc.layout, order)), heads)
    sim = _simulate_one_call(sc, heads)
    # Ulysses' own options only: hybrid's one group simulates through here with its own
    if "pipeline" in sc.scheme_options and _in_rounds_allowed(sc.layout, sc.world_size):
        sim.extra["alternatives"] = [{"pipeline": True}]
    return sim


def _in_rounds_allowed(layout: str, world_size: int) -> bool:
    """Whether the layout's pieces make rounds (ulysses_rounds.round_pieces) at P > 1."""
    from attngym.distributed.schemes.ulysses_rounds import round_pieces

    if world_size < 2:
        return False
    try:
        round_pieces(layout, exchange_order(layout, world_size, layouts.pieces(layout, world_size)))
    except ValueError:
        return False
    return True


def _simulate_one_call(sc: SimulatedCall, heads: SimulatedHeads) -> Simulation:
    opts, clock, seq_len = sc.options, sc.clock, sc.q.shape[2]
    backend = kernels.resolve_backend(opts.backend, sc.q.device)
    works = []
    for (q_h, k_h, v_h, g_h), offset in zip(heads.ranks, heads.head_offsets, strict=True):
        hp = q_h.shape[1]
        tables = hp if kernels.offsets_as_tables(opts.kernel_options) else None
        shifted, block_mask = head_plan(
            sc.variant, offset, tables, seq_len, opts.block_size, backend, sc.q.device
        )

        def attend(*qkv, shifted=shifted, block_mask=block_mask):
            return attend_chunk(*qkv, shifted, options=opts, block_mask=block_mask)[0]

        def fwd(attend=attend, qkv=(q_h, k_h, v_h)):
            with torch.no_grad():
                attend(*qkv)

        bwd = None
        if g_h is not None:
            leaves = [t.detach().requires_grad_() for t in (q_h, k_h, v_h)]

            def bwd(attend=attend, leaves=leaves, g_h=g_h):
                with torch.enable_grad():
                    torch.autograd.grad(attend(*leaves), leaves, g_h)

        key = ("ulysses", tuple(q_h.shape), tuple(k_h.shape), clock.mask_key(block_mask))
        item = Item(key=key, fwd=fwd, bwd=bwd, block_masks=(block_mask,))
        fwd = clock.time(item, "fwd")
        both = clock.time(item, "bwd") if g_h is not None else None
        works.append(
            RankWork(
                fwd_ms=(fwd.ms,),
                bwd_ms=() if both is None else (max(both.ms - fwd.ms, 0.0),),
                fwd_bytes=(heads.fwd_bytes,),
                tail_fwd_bytes=heads.tail_bytes,
                host_fwd_ms=fwd.host_ms,
                host_bwd_ms=0.0 if both is None else max(both.host_ms - fwd.host_ms, 0.0),
            )
        )
    P = sc.world_size
    return Simulation(P, works, 1, pairs_computed=P, bytes_moved=heads.sent,
                      peak_mem_bytes=heads.peak_bytes)  # fmt: skip


def exchange_bytes(b: int, h: int, kv_heads: int, shard: int, d: int, itemsize: int):
    """(q, k, v out; the output back) bytes of one rank's shard, as exchange counts them, K/V
    heads repeated to `kv_heads`."""
    qkv = (b * h * shard * d + 2 * b * kv_heads * shard * d) * itemsize
    return qkv, b * h * shard * d * itemsize


def alltoall_rank_ms(work: RankWork, fab: Fabric, backward: bool, crossing: float = 0.0) -> float:
    """q/k/v exchange, call, output exchange; backward: the output gradient's exchange, the
    call's backward, the q/k/v gradients' exchange. `crossing`: the share exchanged with other
    NVLink domains."""
    into = fab.ms("alltoall", work.fwd_bytes[0] if work.fwd_bytes else 0.0, crossing)
    back = fab.ms("alltoall", work.tail_fwd_bytes, crossing)
    total = into + work.compute_fwd_ms + back
    if backward:
        total += back + sum(work.bwd_ms) + into
    return total


def price_ulysses(sim: Simulation, fab: Fabric, backward: bool) -> Prediction:
    """Ulysses' call on `fab`: the all-to-alls around the one call (alltoall_rank_ms), or the
    rounds' (ulysses_rounds.rounds_rank_ms)."""
    from attngym.distributed.schemes.ulysses_rounds import RoundWork, rounds_rank_ms

    crossing = fab.collective_crossing(len(sim.ranks))
    in_rounds = isinstance(sim.ranks[0], RoundWork)
    rank_ms = rounds_rank_ms if in_rounds else alltoall_rank_ms
    return predict(functools.partial(rank_ms, crossing=crossing), sim.ranks, fab, backward)


def heads_config_error(err: ValueError) -> ConfigError:
    """A check's "key: message" ValueError as the ConfigError of its config key."""
    key, _, message = str(err).partition(": ")
    return ConfigError(f"topology.options.{key}" if key == "a2a_size" else f"shape.{key}", message)


def _heads_split(*, heads: int, kv_heads: int | None, world_size: int | None, **_: Any) -> None:
    """Ulysses: every rank takes H/P query heads (checked once P is known)."""
    if world_size is None:
        return
    try:
        check_ulysses_heads(heads, kv_heads, world_size)
    except ValueError as err:
        raise heads_config_error(err) from None


def _rounds_of_layout(*, layout: Any, options: dict[str, Any], world_size: int | None,
                      seq_len: int, **_: Any) -> None:  # fmt: skip
    """pipeline=True: the layout's pieces make the rounds (zigzag, double_zigzag)."""
    if not options.get("pipeline") or world_size is None or not isinstance(layout, str):
        return
    from attngym.distributed.schemes.ulysses_rounds import round_pieces

    try:
        order = exchange_order(layout, world_size, seq_len)
    except ValueError:  # the sequence length's own check says it
        return
    try:
        round_pieces(layout, order)
    except ValueError as err:
        raise ConfigError("topology.options.pipeline", str(err).partition(": ")[2]) from None


ULYSSES = TopologySpec(
    name="ulysses",
    attention=ulysses_attention,
    layouts=HEAD_PARALLEL_LAYOUTS,
    options=UlyssesOptions,
    rules=(_heads_split, _rounds_of_layout),
    timer=alltoall_transfer_ms,
    shards=lambda topology, shape: 1,
    simulate=simulate_ulysses,
    price=price_ulysses,
    pickable=True,
)
