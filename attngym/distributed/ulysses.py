"""Head-parallel (Ulysses) attention, and hybrid: Ulysses inside groups, ring or all-gather across.

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
      backward is the inverse exchange (attngym.distributed.parts.AllToAllFunction).
    * The all-to-all outputs are fresh tensors (autograd saves them); the transport objects and
      their buffers are cached per (shapes, group) by attngym.distributed.transport.cached.
    * Hybrid (W ranks, groups of a = a2a_size consecutive ranks): the all-to-all runs inside the
      group, giving H/a heads of the group's part of the sequence; that part is exactly the
      group's shard of the sequence cut for g = W/a ranks in the same layout (for zigzag too, see
      `hybrid_attention`), so ring_attention or allgather_attention over the g ranks holding the
      same head slice finishes the job, and the inverse all-to-all brings the output back.

Tensors: q_BHSD is this rank's shard in `layout`; _h names the head-sharded whole (or group)
sequence.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import weakref
from collections.abc import Callable, Mapping
from typing import Any, Literal, get_args

import torch

from attngym import kernels
from attngym.distributed import layout as layouts
from attngym.distributed.cp import (
    CPOptions,
    CPStats,
    StepClock,
    attend_chunk,
    check_shards,
    options_from,
)
from attngym.distributed.simulate import Item, SimulatedCall, Simulation
from attngym.distributed.spec import TopologySpec
from attngym.distributed.transfer_model import (
    Fabric,
    Prediction,
    RankWork,
    bottleneck,
    predict,
)
from attngym.errors import ConfigError
from attngym.variants.base import Variant

# The algorithm among hybrid attention's groups (ranks holding the same head slice).
Across = Literal["ring", "allgather"]
ACROSS = get_args(Across)
# The layouts whose shards the all-to-all puts back in global order (exchange_order): a balanced
# placement would need its variant's plan on every exchange.
HEAD_PARALLEL_LAYOUTS = ("contiguous", "zigzag")


def _check_layout(fn: str, layout: Any) -> None:
    """ValueError naming `layout` unless the all-to-all takes it."""
    if not isinstance(layout, str) or layout not in HEAD_PARALLEL_LAYOUTS:
        raise ValueError(
            f"layout: {fn} takes one of {', '.join(HEAD_PARALLEL_LAYOUTS)} (the all-to-all puts "
            f"those shards back in global order), got {layout!r}"
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


def _plan(variant, head_offset, heads, seq_len, block_size, backend, device):
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


def _exchange(
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
    import torch.distributed as dist

    from attngym.distributed.transport import cached, check_transport, resolve_transport

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("head-parallel attention needs an initialised process group")
    check_shards(q, k, v)
    check_transport(transport, q.device)
    P, r = dist.get_world_size(group), dist.get_rank(group)
    b, h, s, d = q.shape
    check_ulysses_heads(h, k.shape[1], P)
    layouts.check_seq_len(s * P, P, layout)
    if variant.device is not None and variant.device != q.device:
        variant = variant.to(q.device)
    if P == 1:  # nothing to exchange (hybrid with a2a_size 1 is ring or all-gather alone)
        return attend(q, k, v, variant, 0)
    cls = resolve_transport(transport, q.device, group).alltoall
    order = exchange_order(layout, P, s * P)
    replicas = math.lcm(k.shape[1], P) // k.shape[1]
    if replicas > 1:  # fewer K/V heads than ranks (or not a multiple): repeat up to lcm(G, P)
        k, v = (t.repeat_interleave(replicas, dim=1) for t in (k, v))

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
    if stats is not None:
        sent = q.numel() + k.numel() + v.numel() + q.numel()  # q, k, v out; the output back
        stats.bytes_sent += sent * q.element_size() * (P - 1) // P
    return a2a(out_h, 1, False)([out_h])[0]


def _ulysses_options(options: CPOptions | None, overrides: dict[str, Any]) -> CPOptions:
    """The call's CPOptions; ValueError for a `backward` choice, which has nothing to act on here
    (no chunk pairs: autograd differentiates the one kernel call and the all-to-alls)."""
    opts = options_from(options, **overrides)
    if opts.backward != "auto":
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
        layout: contiguous | zigzag (HEAD_PARALLEL_LAYOUTS; attngym.distributed.layout).
        options: kernel choices (CPOptions; default CPOptions()). block_size is that of the
            whole-sequence block mask; backward must stay auto: the gradient is autograd's
            through the one kernel call and the all-to-alls, with no pairs to choose for.
        stats: a CPStats; its bytes_sent grows by what this rank sends.
        **overrides: any CPOptions field on top of `options`, as in ring_attention.

    Returns:
        (B, H, S/P, D) this rank's output shard, in q's dtype; differentiable w.r.t. q, k, v.

    Raises:
        ValueError: a layout other than contiguous or zigzag (`layout`), P does not divide H
            (`heads`), a backward other than auto, or a bad option, shape or sequence length.
    """
    import torch.distributed as dist

    _check_layout("ulysses_attention", layout)
    opts = _ulysses_options(options, overrides)
    resolved = kernels.resolve_backend(opts.backend, q.device)
    block = opts.block_size
    if dist.is_available() and dist.is_initialized():
        variant.check_seq_len(q.shape[2] * dist.get_world_size(group))

    tables = kernels.offsets_as_tables(opts.kernel_options)

    def attend(q_h, k_h, v_h, variant_d, head_offset):
        heads = q_h.shape[1] if tables else None
        shifted, block_mask = _plan(
            variant_d, head_offset, heads, q_h.shape[2], block, resolved, q.device
        )
        if stats is not None:
            stats.pairs_computed += 1
        return attend_chunk(q_h, k_h, v_h, shifted, options=opts, block_mask=block_mask)[0]

    return _exchange(
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


# Default group -> {(ranks of the group, a2a_size): (a2a group, across group)}: kept for the life
# of the default group (a re-initialised one starts afresh).
_SUBGROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _subgroups(group_key: tuple[int, ...], a2a_size: int):
    """(a2a group, across group) of this rank: its block and its stride of `group_key`.

    The whole job: every rank creates every block and stride, in one order (new_group's plain
    protocol). A subgroup of the job (the context-parallel ranks of one data-parallel replica,
    say): only the members of each group create it (local synchronisation), so every rank of the
    job must have created the same number of groups before (PyTorch names such groups by it),
    and the default group must not be bound to a device (PyTorch then splits a communicator
    over every rank).
    """
    import torch.distributed as dist

    memo = _SUBGROUPS.setdefault(dist.group.WORLD, {})
    if (group_key, a2a_size) not in memo:
        ranks, me = list(group_key), dist.get_rank()
        blocks = [ranks[i : i + a2a_size] for i in range(0, len(ranks), a2a_size)]
        strides = [ranks[i::a2a_size] for i in range(a2a_size)]
        if len(ranks) == dist.get_world_size():
            made = [(g, dist.new_group(g)) for g in blocks + strides]
        else:
            made = [
                (g, dist.new_group(g, use_local_synchronization=True))
                for g in blocks + strides
                if me in g
            ]
        mine = [group for g, group in made if me in g]
        memo[group_key, a2a_size] = (mine[0], mine[1])  # this rank's block, then its stride
    return memo[group_key, a2a_size]


def hybrid_groups(a2a_size: int | None, group=None):
    """The (a2a group, across group) of this rank for hybrid attention; collective on the first
    call for a group and a2a_size (every rank makes it), remembered after.

    Groups are consecutive ranks of `group` (rank r's shard must be shard r of the layout, and
    consecutive shards are what compose, see hybrid_attention), checked against the NVLink domain
    (attngym.distributed.domain): each a2a group must lie in one domain. a2a_size None takes the
    ranks of this rank's domain (the host where no NVLink fabric is known).

    Raises:
        ValueError: naming `a2a_size` when it does not divide the world size, or a group would
            span NVLink domains, or (None) the domains are not equal blocks of consecutive ranks.
    """
    import torch.distributed as dist

    if a2a_size is not None and (
        isinstance(a2a_size, bool) or not isinstance(a2a_size, int) or a2a_size < 1
    ):
        raise ValueError(f"a2a_size: expected a positive int or None, got {a2a_size!r}")
    # The NVLink domains are gathered (a collective, a host sync on NCCL) once per group and
    # a2a_size, not on every call: a group's ranks do not move.
    world = dist.get_world_size(group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    chosen = _HYBRID_GROUPS.setdefault(dist.group.WORLD, {})
    key = (tuple(ranks), a2a_size)
    if key not in chosen:
        chosen[key] = _hybrid_groups(a2a_size, group, ranks)
    return chosen[key]


# Default group -> {(ranks of the group, a2a_size): (a2a group, across group)}, as _SUBGROUPS.
_HYBRID_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _hybrid_groups(a2a_size: int | None, group, ranks: list[int]):
    import torch.distributed as dist

    from attngym.distributed.domain import nvlink_domain

    world = len(ranks)
    if a2a_size is not None and world % a2a_size:
        raise ValueError(f"a2a_size: {a2a_size} does not divide the world size {world}")
    domains: list[str | None] = [None] * world
    dist.all_gather_object(domains, nvlink_domain(), group=group)
    if a2a_size is None:
        a2a_size = domains.count(domains[0])
        blocks_ok = all(domains[i] == domains[i - i % a2a_size] for i in range(world))
        if world % a2a_size or not blocks_ok:
            raise ValueError(
                f"a2a_size: None takes one NVLink domain per group, but the domains are not equal "
                f"blocks of consecutive ranks ({domains}); set a2a_size explicitly"
            )
    for start in range(0, world, a2a_size):
        if len(set(domains[start : start + a2a_size])) > 1:
            raise ValueError(
                f"a2a_size: the group of ranks {start}..{start + a2a_size - 1} spans NVLink "
                f"domains {sorted(set(domains[start : start + a2a_size]))}; choose a size that "
                "keeps each group inside one domain"
            )
    return _subgroups(tuple(ranks), a2a_size)


def hybrid_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    variant: Variant,
    *,
    a2a_size: int | None = None,
    across: Across = "ring",
    group=None,
    transport: str = "auto",
    layout: str = "contiguous",
    options: CPOptions | None = None,
    stats: CPStats | None = None,
    **overrides: Any,
) -> torch.Tensor:
    """Ulysses inside groups of a2a_size consecutive ranks, ring or all-gather across the groups.

    Why it composes: with W ranks in groups of a (g = W/a groups), group j holds shards
    j·a .. j·a + a - 1. Contiguous: their union is [j·S/g, (j+1)·S/g), group j's contiguous shard
    for g ranks. Zigzag (2W chunks): member i holds chunks j·a + i and 2W-1-j·a-i, so the group
    holds zigzag chunks j and 2g-1-j for g ranks, member i's pieces at positions i and 2a-1-i of
    them: the zigzag order over a ranks. So the in-group all-to-all (layout order over a ranks)
    yields the group's shard for g ranks in the same layout, of H/a heads, and ring_attention or
    allgather_attention among the g ranks with the same head slice finishes it.

    Collective over `group`. Arguments as in ulysses_attention, except that every CPOptions
    field is honoured: `backward` chooses the ring's or all-gather's backward across the groups.

    Args:
        a2a_size: ranks per all-to-all group (a divisor of the world size; a must divide H);
            None: one NVLink domain per group (hybrid_groups).
        across: ring | allgather, the algorithm among the groups.
        transport: for the all-to-all and for the ring/all-gather (auto picks per group).

    Returns:
        (B, H, S/W, D) this rank's output shard, differentiable w.r.t. q, k, v. stats.lse is
        left None.
    """
    import torch.distributed as dist

    from attngym.distributed.allgather import allgather_attention
    from attngym.distributed.ring import ring_attention

    _check_layout("hybrid_attention", layout)
    opts = options_from(options, **overrides)
    if across not in ACROSS:
        raise ValueError(f"across: expected one of {', '.join(ACROSS)}, got {across!r}")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("hybrid attention needs an initialised process group")
    world = dist.get_world_size(group)
    layouts.check_seq_len(q.shape[2] * world, world, layout)
    variant.check_seq_len(q.shape[2] * world)
    a2a_group, across_group = hybrid_groups(a2a_size, group)
    fn = ring_attention if across == "ring" else allgather_attention

    tables = kernels.offsets_as_tables(opts.kernel_options)

    def attend(q_h, k_h, v_h, variant_d, head_offset):
        heads = q_h.shape[1] if tables else None
        shifted, _ = _plan(variant_d, head_offset, heads, None, None, "across", q.device)
        return fn(
            q_h,
            k_h,
            v_h,
            shifted,
            group=across_group,
            transport=transport,
            layout=layout,
            options=opts,
            stats=stats,
        )

    out = _exchange(
        q,
        k,
        v,
        variant,
        attend,
        group=a2a_group,
        transport=transport,
        layout=layout,
        timeout_s=opts.timeout_s,
        stats=stats,
    )
    if stats is not None:
        # The across call's lse is of this rank's head slice over its group's sequence, not of
        # this rank's shard: like ulysses_attention, hybrid reports none.
        stats.lse = None
    return out


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
# Simulated and priced (topology.simulate=true; attngym.distributed.simulate, transfer_model).


def simulate_ulysses(sc: SimulatedCall) -> Simulation:
    """Every rank's one call on its head slice of the whole sequence (K/V heads repeated up to
    lcm(G, P) as the all-to-all does), with the head-shifted variant and block mask of
    ulysses_attention; the exchanges' bytes as _exchange counts them."""
    q, k, v, P, opts, clock = sc.q, sc.k, sc.v, sc.world_size, sc.options, sc.clock
    b, h, seq_len, d = q.shape
    check_ulysses_heads(h, k.shape[1], P)
    backend = kernels.resolve_backend(opts.backend, q.device)
    replicas = math.lcm(k.shape[1], P) // k.shape[1]
    k_rep, v_rep = (t.repeat_interleave(replicas, dim=1) for t in (k, v))
    hp, rp = h // P, k_rep.shape[1] // P
    itemsize = q.element_size()
    works, sent, peak = [], 0, 0
    for r in range(P):
        q_h, k_h, v_h = (
            t[:, r * n : (r + 1) * n].contiguous() for t, n in ((q, hp), (k_rep, rp), (v_rep, rp))
        )
        heads = hp if kernels.offsets_as_tables(opts.kernel_options) else None
        shifted, block_mask = _plan(
            sc.variant, r * hp, heads, seq_len, opts.block_size, backend, q.device
        )

        def attend(*qkv, shifted=shifted, block_mask=block_mask):
            return attend_chunk(*qkv, shifted, options=opts, block_mask=block_mask)[0]

        def fwd(attend=attend, qkv=(q_h, k_h, v_h)):
            with torch.no_grad():
                attend(*qkv)

        bwd = None
        if sc.grad_out is not None:
            g_h = sc.grad_out[:, r * hp : (r + 1) * hp].contiguous()
            leaves = [t.detach().requires_grad_() for t in (q_h, k_h, v_h)]

            def bwd(attend=attend, leaves=leaves, g_h=g_h):
                with torch.enable_grad():
                    torch.autograd.grad(attend(*leaves), leaves, g_h)

        key = ("ulysses", tuple(q_h.shape), tuple(k_h.shape), clock.mask_key(block_mask))
        item = Item(key=key, fwd=fwd, bwd=bwd, block_masks=(block_mask,))
        fwd = clock.time(item, "fwd")
        both = clock.time(item, "bwd") if sc.grad_out is not None else None
        qkv_bytes, out_bytes = _exchange_bytes(b, h, k_rep.shape[1], seq_len // P, d, itemsize)
        sent = max(sent, (qkv_bytes + out_bytes) * (P - 1) // P)
        works.append(
            RankWork(
                fwd_ms=(fwd.ms,),
                bwd_ms=() if both is None else (max(both.ms - fwd.ms, 0.0),),
                fwd_bytes=(qkv_bytes * (P - 1) / P,),
                tail_fwd_bytes=out_bytes * (P - 1) / P,
                host_fwd_ms=fwd.host_ms,
                host_bwd_ms=0.0 if both is None else max(both.host_ms - fwd.host_ms, 0.0),
            )
        )
        heads_whole = (hp + 2 * rp) * b * seq_len * d * itemsize
        peak = max(peak, heads_whole + b * hp * seq_len * d * itemsize)
    return Simulation(P, works, 1, pairs_computed=P, bytes_moved=sent, peak_mem_bytes=peak)


def _exchange_bytes(b: int, h: int, kv_heads: int, shard: int, d: int, itemsize: int):
    """(q, k, v out; the output back) bytes of one rank's shard, as _exchange counts them, K/V
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
    """Ulysses' call on `fab`: the all-to-alls around the one call (alltoall_rank_ms)."""
    crossing = fab.collective_crossing(len(sim.ranks))
    return predict(functools.partial(alltoall_rank_ms, crossing=crossing), sim.ranks, fab, backward)


def _across(options: Mapping[str, Any]) -> TopologySpec:
    """The spec of hybrid's algorithm among the groups (a composition calls the other scheme's
    public pieces, importing its module directly)."""
    if options["across"] == "ring":
        from attngym.distributed.ring import RING

        return RING
    from attngym.distributed.allgather import ALLGATHER

    return ALLGATHER


def simulate_hybrid(sc: SimulatedCall) -> Simulation:
    """The across scheme over the P / a2a_size groups on one group's head slice (H / a2a_size
    heads; every member of a group does the same work), and the in-group exchange's bytes as
    Ulysses counts them over a2a_size ranks; one group: Ulysses itself."""
    P = sc.world_size
    a2a_size = simulated_a2a_size(sc.scheme_options["a2a_size"], P, sc.domain_size)
    if a2a_size is None or P % a2a_size:
        raise ValueError(
            f"a2a_size: simulated hybrid needs a divisor of world_size={P} (no NVLink domains to "
            f"take it from), got {a2a_size!r}"
        )
    b, h, seq_len, d = sc.q.shape
    check_ulysses_heads(h, sc.k.shape[1], a2a_size)
    groups = P // a2a_size
    if groups == 1:
        return simulate_ulysses(sc.replace(world_size=a2a_size))
    replicas = math.lcm(sc.k.shape[1], a2a_size) // sc.k.shape[1]
    k_rep, v_rep = (t.repeat_interleave(replicas, dim=1) for t in (sc.k, sc.v))
    ha, ra = h // a2a_size, k_rep.shape[1] // a2a_size
    across = _across(sc.scheme_options)
    inner = across.simulate(
        sc.replace(
            q=sc.q[:, :ha].contiguous(), k=k_rep[:, :ra].contiguous(),
            v=v_rep[:, :ra].contiguous(), world_size=groups,
            grad_out=None if sc.grad_out is None else sc.grad_out[:, :ha].contiguous(),
            scheme_options=across.option_values({}),
        )
    )  # fmt: skip
    qkv, out = _exchange_bytes(b, h, k_rep.shape[1], seq_len // P, d, sc.q.element_size())
    keep = (a2a_size - 1) / a2a_size
    inner.extra["exchange"] = RankWork(
        fwd_ms=(), fwd_bytes=(qkv * keep,), tail_fwd_bytes=out * keep
    )
    inner.extra["across"] = across
    inner.extra["a2a_size"] = a2a_size
    inner.extra.pop("alternatives", None)  # the across scheme's own: hybrid runs it at defaults
    inner.stride = a2a_size  # the across scheme's ranks, a2a_size apart
    inner.bytes_moved += int((qkv + out) * keep)
    inner.pairs_computed *= a2a_size
    inner.pairs_skipped *= a2a_size
    inner.world_size = P
    return inner


def simulated_a2a_size(a2a_size: int | None, world_size: int, domain_size: int | None):
    """The group size simulated: the one given, else one NVLink domain of the fabric (all the
    ranks when they fit in one), else None."""
    if a2a_size is not None or domain_size is None:
        return a2a_size
    return min(world_size, domain_size)


def price_hybrid(sim: Simulation, fab: Fabric, backward: bool) -> Prediction:
    """The in-group all-to-alls (their bytes, no compute) around the across scheme's call,
    priced as that scheme prices it over the groups; one group: Ulysses' price."""
    if "across" not in sim.extra:
        return price_ulysses(sim, fab, backward)
    across = sim.extra["across"].price(sim, fab, backward)
    exchange = sim.extra["exchange"]
    crossing = fab.collective_crossing(sim.extra["a2a_size"])
    extra_fwd = alltoall_rank_ms(exchange, fab, False, crossing)
    extra_both = alltoall_rank_ms(exchange, fab, True, crossing)
    # The in-group exchanges lengthen each rank's device timeline; its host time stays.
    fwd_only = sim.extra["across"].price(sim, fab, False) if backward else across
    fwd = [max(h, d + extra_fwd) for h, d in zip(fwd_only.rank_host_ms, fwd_only.rank_device_ms,
                                                   strict=True)]  # fmt: skip
    device = tuple(d + (extra_both if backward else extra_fwd) for d in across.rank_device_ms)
    totals = tuple(max(h, d) for h, d in zip(across.rank_host_ms, device, strict=True))
    slowest = max(range(len(totals)), key=totals.__getitem__)
    return Prediction(
        fwd_ms=max(fwd),
        fwd_bwd_ms=max(totals) if backward else None,
        rank_ms=totals,
        rank_compute_ms=across.rank_compute_ms,
        bottleneck=bottleneck(totals[slowest], across.rank_compute_ms, device[slowest]),
        rank_host_ms=across.rank_host_ms,
        rank_device_ms=device,
    )


def _config_error(err: ValueError) -> ConfigError:
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
        raise _config_error(err) from None


@dataclasses.dataclass(frozen=True)
class HybridOptions:
    """hybrid's own options: topology.options.<field>, hybrid_attention's keywords."""

    a2a_size: int | None = None
    """Ranks per all-to-all group, consecutive ranks dividing world_size and shape.heads; None
    takes one NVLink domain per group, found on the ranks."""
    across: Across = "ring"
    """The algorithm among the groups (the ranks holding the same head slice)."""


def _hybrid_groups_split(
    *,
    heads: int,
    kv_heads: int | None,
    world_size: int | None,
    options: Mapping[str, Any],
    simulate: bool,
    domain_size: int | None = None,
    **_: Any,
) -> None:
    """Hybrid: the all-to-all groups split the ranks and the query heads evenly (K/V heads are
    repeated as Ulysses does). a2a_size None is judged on the ranks, where the NVLink domains
    are known (hybrid_sequence_shards); simulated ranks take the fabric's domain (domain_size)
    or need it given."""
    key = "topology.options.a2a_size"
    a2a_size = options["a2a_size"]
    if simulate and world_size is not None:
        a2a_size = simulated_a2a_size(a2a_size, world_size, domain_size)
    if a2a_size is None:
        if simulate:
            raise ConfigError(
                key,
                "topology.simulate=true with topology=hybrid needs the group size, got null "
                "(topology.fabric has no NVLink domains to take it from: give it, or use "
                "fabric=hgx_h200 or nvl72)",
            )
        return
    if world_size is not None and world_size % a2a_size:
        raise ConfigError(
            key,
            f"{a2a_size} does not divide topology.world_size={world_size}; use a divisor of "
            f"{world_size} (or null: one NVLink domain per group)",
        )
    if heads % a2a_size:
        raise ConfigError(
            key,
            f"{a2a_size} does not divide shape.heads={heads}; each group splits the heads over "
            "its ranks, use a common divisor of the heads and the world size",
        )
    try:
        check_ulysses_heads(heads, kv_heads, a2a_size)
    except ValueError as err:
        raise _config_error(err) from None


def hybrid_sequence_shards(settings: Any) -> int:
    """The groups of a hybrid run (collective: a2a_size None is resolved from the NVLink domains):
    every member of a group attends the group's whole shard for its head slice. A group size the
    domains or the heads refuse is a ConfigError on every rank alike (exit 2, as before launch)."""
    import torch.distributed as dist

    shape = settings.shape
    options = HYBRID.option_values(settings.topology.options)
    try:
        a2a_group, across_group = hybrid_groups(options["a2a_size"])
        check_ulysses_heads(shape.heads, shape.kv_heads, dist.get_world_size(a2a_group))
    except ValueError as err:
        raise _config_error(err) from None
    return dist.get_world_size(across_group)


ULYSSES = TopologySpec(
    name="ulysses",
    attention=ulysses_attention,
    layouts=HEAD_PARALLEL_LAYOUTS,
    rules=(_heads_split,),
    timer=alltoall_transfer_ms,
    shards=lambda settings: 1,
    simulate=simulate_ulysses,
    price=price_ulysses,
)
# Two levels of transfers (all-to-all in a group, ring or all-gather across): no one step to time
# alone.
HYBRID = TopologySpec(
    name="hybrid",
    attention=hybrid_attention,
    layouts=HEAD_PARALLEL_LAYOUTS,
    options=HybridOptions,
    rules=(_hybrid_groups_split,),
    shards=hybrid_sequence_shards,
    simulate=simulate_hybrid,
    price=price_hybrid,
)
