"""Ulysses in rounds (`topology.options.pipeline`): the all-to-alls cut by the layout's pieces,
so that a round's attention runs while the next round arrives, and a round's output (backward:
its gradients) goes home as soon as it is final.

One all-to-all before the call and one after leave the exchanges bare: on packed documents at
128K over 8 ranks they were 9-31 % of Ulysses' step. A zigzag rank holds pieces r and 2P-1-r of
the sequence, so the ranks' first pieces are the sequence's first half and their second pieces
its second half: exchanged one piece at a time, round j brings every rank its heads of the j-th
part of the sequence, in order. Its queries attend the keys that have arrived (the parts up to
their own: one call); keys of a later part that they read (a mask that is not causal) are
attended when that part arrives and merged by their lse. Backward goes the other way: the last
round's gradients first, each round's dq, dK and dV sent home once no call left adds to them.
FPDT (Yao et al., 2024, arXiv:2408.16978) pipelines DeepSpeed-Ulysses by sequence chunks alike.

Contract as ulysses_attention's (attngym.distributed.schemes.ulysses), with these differences:
    * The layout must bring each round a contiguous part of the sequence (zigzag: two rounds;
      double_zigzag, each half of the sequence a zigzag: four).
    * The gradient is flex's backward op of each call from its rows' merged out and lse
      (attngym.distributed.call.flex_backward), or the call re-run (backward=recompute, and
      where the op is unusable), not autograd through one call.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch

from attngym import kernels
from attngym.distributed.call.accumulate import Accumulator, GradSum
from attngym.distributed.call.cp import CPCall, CPOptions, attend_chunk, resolve_backward
from attngym.distributed.model.simulate import Item, Simulation
from attngym.distributed.model.transfer_model import Fabric, RankWork
from attngym.variants.base import Variant


def round_pieces(layout: str, order) -> tuple[tuple[int, ...], ...]:
    """Per round, where each rank's piece lands in that round's part of the sequence (rank p's
    j-th piece at position [j][p] of part j), from the exchange's order (`order[p]`: the global
    pieces of rank p's chunks); ValueError naming `layout` unless every round's pieces make one
    contiguous part, in round order."""
    world_size, rounds = len(order), len(order[0])
    where = tuple(tuple(order[p][j] - j * world_size for p in range(world_size))
                  for j in range(rounds))  # fmt: skip
    if rounds < 2 or any(sorted(w) != list(range(world_size)) for w in where):
        raise ValueError(
            f"layout: pipeline=True exchanges the layout's pieces round by round, each round a "
            f"part of the sequence in order, which {layout!r} does not give; use zigzag (two "
            f"rounds) or double_zigzag (four)"
        )
    return where


@dataclasses.dataclass(frozen=True)
class RoundPlan:
    """The calls of one rank's head slice, round by round.

    Attributes:
        rounds: the exchange's rounds (the layout's pieces a rank).
        span: tokens a round brings (seq_len / rounds).
        later: later[j], the later rounds whose keys round j's queries read (the mask keeps a
            block there); round j's own call covers the keys of rounds 0..j.
    """

    rounds: int
    span: int
    later: tuple[tuple[int, ...], ...]

    def calls(self, j: int) -> list[tuple[int, int]]:
        """Round j's queries' calls, as the key rows (start, stop) each reads."""
        s = self.span
        return [(0, (j + 1) * s), *((i * s, (i + 1) * s) for i in self.later[j])]

    def out_ready(self, j: int) -> int:
        """The round after whose calls round j's output is final."""
        return max((j, *self.later[j]))

    def grads_ready(self, i: int) -> int:
        """The round after whose backward (rounds go last to first) round i's dq, dK and dV are
        final: its own queries' and every earlier round's reading its keys."""
        return min((i, *(j for j in range(i) if i in self.later[j])))


class RoundCalls:
    """One rank's calls on its head slice (the variant moved to its heads): their block masks
    (memoised), forward and gradients; shared by the ranks' run and the simulation."""

    def __init__(self, variant: Variant, head_offset: int, heads: int, seq_len: int, rounds: int,
                 options: CPOptions, device: torch.device):  # fmt: skip
        self.options, self.device = options, device
        self.backend = kernels.resolve_backend(options.backend, device)
        self.backward = resolve_backward(options)
        tables = kernels.offsets_as_tables(options.kernel_options)
        self.variant = kernels.shifted_heads(
            variant, head_offset, device, heads=heads if tables else None
        )
        self._masks: dict[tuple[int, int, int, int], Any] = {}
        span = seq_len // rounds
        later = tuple(
            tuple(i for i in range(j + 1, rounds)
                  if not kernels.block_mask_is_empty(self.mask(j * span, span, i * span, span)))
            for j in range(rounds)
        )  # fmt: skip
        self.plan = RoundPlan(rounds, span, later)
        # What the backward helpers shared with the other schemes read: variant and options.
        self.call = CPCall(variant=self.variant, group=None, transport=None, layout=None,
                           options=options, backend=self.backend, backward=self.backward,
                           rank=0, world_size=1, seq_len=seq_len, stats=None)  # fmt: skip

    def mask(self, q_offset: int, q_len: int, kv_offset: int, kv_len: int):
        """The block mask of one call, memoised (a full one where the variant has no mask:
        flex's backward op takes one in every case)."""
        key = (q_offset, q_len, kv_offset, kv_len)
        if key not in self._masks:
            self._masks[key] = kernels.make_block_mask(
                self.variant, q_len, kv_len, q_offset=q_offset, kv_offset=kv_offset,
                block_size=self.options.block_size, device=self.device, full_when_unmasked=True,
            )  # fmt: skip
        return self._masks[key]

    def attend(self, q, k, v, q_offset: int, kv_offset: int):
        """(out, lse) of round queries at q_offset over keys at kv_offset."""
        bm = self.mask(q_offset, q.shape[2], kv_offset, k.shape[2])
        return attend_chunk(q, k, v, self.variant, q_offset=q_offset, kv_offset=kv_offset,
                            options=self.options, block_mask=bm)  # fmt: skip

    def grads(self, q, k, v, out, lse, dout, q_offset: int, kv_offset: int):
        """(dq, dk, dv) of one call from its rows' merged out and lse."""
        from attngym.distributed.call import flex_backward
        from attngym.distributed.call.pairs import Saved, recompute_pair

        bm = self.mask(q_offset, q.shape[2], kv_offset, k.shape[2])
        grads = None
        if self.backward == "flex":
            grads = flex_backward.grads(self.call, q, k, v, out, lse, dout, bm,
                                        q_offset=q_offset, kv_offset=kv_offset)  # fmt: skip
        if grads is None:  # recompute, or flex failed under backward=auto (logged)
            whole = slice(0, q.shape[2])
            grads = recompute_pair(self.call, Saved(q, out, lse, dout), whole, k, v,
                                   (q_offset,), (kv_offset,), bm)  # fmt: skip
        return grads


# Variant -> {(head offset, heads, seq_len, rounds, options' repr, device): RoundCalls}; weak
# keys, as ulysses.head_plan's.
_CALLS: weakref.WeakKeyDictionary[Variant, dict[tuple, RoundCalls]] = weakref.WeakKeyDictionary()


def round_calls(variant, head_offset, heads, seq_len, rounds, options, device) -> RoundCalls:
    """RoundCalls of one rank's head slice, memoised on the variant."""
    per = _CALLS.setdefault(variant, {})
    # repr: kernel_options is a dict (CPOptions does not hash); equal options, equal reprs
    key = (head_offset, heads, seq_len, rounds, repr(options), device)
    if key not in per:
        per[key] = RoundCalls(variant, head_offset, heads, seq_len, rounds, options, device)
    return per[key]


@dataclasses.dataclass
class _Exchanges:
    """One rank's all-to-alls of each round, built before any is started (building one may be
    collective): q (and dO), K/V with q where they have q's heads, and their inverses home."""

    q: list[Any]  # per round: (B, H, piece, D) -> (B, H/P, span, D), one part
    kv: list[Any]  # per round: q, k, v in one (3 parts), or k, v (2 parts) where fewer heads
    with_q: bool  # kv carries q too

    def send(self, j: int, q, k, v):
        if self.with_q:
            return self.kv[j].start([q, k, v]), None
        return self.kv[j].start([k, v]), self.q[j].start([q])

    def received(self, j: int, started) -> tuple[torch.Tensor, ...]:
        kv_started, q_started = started
        if self.with_q:
            return tuple(self.kv[j].wait(kv_started).unbind(0))
        k, v = self.kv[j].wait(kv_started).unbind(0)
        return self.q[j].wait(q_started)[0], k, v

    def home(self, j: int, dq, dk, dv):
        if self.with_q:
            return self.kv[j].inverse().start([dq, dk, dv]), None
        return self.kv[j].inverse().start([dk, dv]), self.q[j].inverse().start([dq])

    def arrived_home(self, j: int, started) -> tuple[torch.Tensor, ...]:
        kv_started, q_started = started
        if self.with_q:
            return tuple(self.kv[j].inverse().wait(kv_started).unbind(0))
        dk, dv = self.kv[j].inverse().wait(kv_started).unbind(0)
        return self.q[j].inverse().wait(q_started)[0], dk, dv


def exchanges(cls, q: torch.Tensor, k: torch.Tensor, where, *, group, timeout_s) -> _Exchanges:
    """The rounds' all-to-alls (transport class `cls`) for shards like q and k (K/V heads already
    repeated to a multiple of the ranks), and their inverses."""
    from attngym.distributed.transport import cached

    piece = q.shape[2] // len(where)
    with_q = k.shape == q.shape

    def a2a(heads: int, parts: int, j: int):
        # tagged by round: rounds of one order (double_zigzag's 0 and 2) are in flight together
        return cached(cls, (q.shape[0], heads, piece, q.shape[3]), parts, 1, 2, dtype=q.dtype,
                      device=q.device, timeout_s=timeout_s, tag=f"ulysses round {j}",
                      concat_order=tuple((w,) for w in where[j]), group=group)  # fmt: skip

    made = _Exchanges(
        q=[a2a(q.shape[1], 1, j) for j in range(len(where))],
        kv=[a2a(k.shape[1], 3 if with_q else 2, j) for j in range(len(where))],
        with_q=with_q,
    )
    for obj in (*made.q, *made.kv):
        obj.inverse()
    return made


class _Rounds(torch.autograd.Function):
    """The rounds' exchanges and calls as one node (module docstring). Every rank starts its
    exchanges in the same order (forward: every round's q/k/v, then the outputs in round order;
    backward: every round's dO last to first, then the gradients home last to first), whatever
    its mask lets it start early."""

    @staticmethod
    def forward(ctx, q, k, v, calls: RoundCalls, ex: _Exchanges):
        q, k, v = (t.detach() for t in (q, k, v))
        plan, m = calls.plan, calls.plan.rounds
        piece, span = q.shape[2] // m, plan.span
        cut = lambda t, j: t[:, :, j * piece : (j + 1) * piece]  # noqa: E731
        started = [ex.send(j, cut(q, j), cut(k, j), cut(v, j)) for j in range(m)]
        q_h, accs, results, back = [], [], [None] * m, []
        k_all = v_all = None
        for j in range(m):
            q_j, k_j, v_j = ex.received(j, started[j])
            if k_all is None:
                k_all = k_j.new_empty((*k_j.shape[:2], span * m, k_j.shape[3]))
                v_all = torch.empty_like(k_all)
            k_all[:, :, j * span : (j + 1) * span] = k_j
            v_all[:, :, j * span : (j + 1) * span] = v_j
            q_h.append(q_j)
            fused = calls.options.compile and q_j.device.type == "cuda"
            accs.append(Accumulator(q_j, q_j.shape[3], fused=fused))
            for i in [*(i for i in range(j) if j in plan.later[i]), j]:  # calls these keys end
                a, b = (j * span, (j + 1) * span) if i < j else (0, (j + 1) * span)
                part = calls.attend(q_h[i], k_all[:, :, a:b], v_all[:, :, a:b], i * span, a)
                accs[i].add(slice(0, span), *part)
            while len(back) < m and plan.out_ready(len(back)) <= j:
                i = len(back)
                results[i] = accs[i].result()
                back.append(ex.q[i].inverse().start([results[i][0]]))
        out = torch.cat([ex.q[j].inverse().wait(back[j])[0] for j in range(m)], dim=2)
        ctx.save_for_backward(*q_h, k_all, v_all, *(o for o, _ in results),
                              *(lse for _, lse in results))  # fmt: skip
        ctx.calls, ctx.ex = calls, ex
        ctx.set_materialize_grads(False)
        return out

    @staticmethod
    def backward(ctx, dout):
        calls, ex = ctx.calls, ctx.ex
        plan, m = calls.plan, calls.plan.rounds
        saved = ctx.saved_tensors
        q_h, (k_all, v_all) = saved[:m], saved[m : m + 2]
        outs, lses = saved[m + 2 : 2 * m + 2], saved[2 * m + 2 :]
        piece, span = dout.shape[2] // m, plan.span
        dout = dout.contiguous()
        started = {j: ex.q[j].start([dout[:, :, j * piece : (j + 1) * piece]])
                   for j in reversed(range(m))}  # fmt: skip
        acc = torch.float64 if k_all.dtype == torch.float64 else torch.float32

        def sums(shape):  # one a round: each round's rows go home on their own
            return [GradSum.of(calls.call, shape, acc, k_all.device) for _ in range(m)]

        dq, dk, dv = sums(q_h[0].shape), *(sums((*k_all.shape[:2], span, k_all.shape[3]))
                                           for _ in range(2))  # fmt: skip
        home = {}
        for j in reversed(range(m)):
            g = ex.q[j].wait(started[j])[0]
            for a, b in plan.calls(j):
                dq_c, dk_c, dv_c = calls.grads(q_h[j], k_all[:, :, a:b], v_all[:, :, a:b],
                                               outs[j], lses[j], g, j * span, a)  # fmt: skip
                dq[j].add(0, dq_c)
                for i in range(a // span, b // span):  # each round's rows of the keys read
                    dk[i].add(0, dk_c.narrow(2, i * span - a, span))
                    dv[i].add(0, dv_c.narrow(2, i * span - a, span))
            while len(home) < m and plan.grads_ready(m - 1 - len(home)) >= j:
                i = m - 1 - len(home)
                home[i] = ex.home(i, *(t[i].total(k_all.dtype) for t in (dq, dk, dv)))
        parts = [ex.arrived_home(j, home[j]) for j in range(m)]
        dq_s, dk_s, dv_s = (torch.cat([p[n] for p in parts], dim=2) for n in range(3))
        return dq_s, dk_s, dv_s, None, None


def rounds_attention(q, k, v, calls: RoundCalls, ex: _Exchanges) -> torch.Tensor:
    """This rank's output shard (in the layout) of the rounds' exchanges and calls;
    differentiable w.r.t. q, k, v (K/V heads already repeated as ulysses' exchange does)."""
    return _Rounds.apply(q, k, v, calls, ex)


# ---------------------------------------------------------------------------------------------
# Simulated (topology.simulate=true; attngym.distributed.model.simulate).


def simulate_rounds(sc, rounds: int, heads) -> Simulation:
    """Every rank's calls of the `rounds` rounds on its head slice (`heads`:
    ulysses.SimulatedHeads, the slices and the exchanges' bytes), each timed through the clock:
    forward in the round that completes it, backward from the whole problem's out and lse of
    those heads (one call, not timed) in the order the backward runs them."""
    opts, clock, seq_len, m = sc.options, sc.clock, sc.q.shape[2], rounds
    works, pairs = [], 0
    for (q_h, k_h, v_h, g_h), offset in zip(heads.ranks, heads.head_offsets, strict=True):
        calls = round_calls(sc.variant, offset, q_h.shape[1], seq_len, m, opts, sc.q.device)
        plan, span = calls.plan, calls.plan.span
        merged = None
        if g_h is not None:
            with torch.no_grad():
                merged = calls.attend(q_h, k_h, v_h, 0, 0)
        fwd_ms, bwd_ms, host = [0.0] * m, [0.0] * m, [0.0, 0.0]
        for j in range(m):
            rows = slice(j * span, (j + 1) * span)
            for a, c in plan.calls(j):
                qkv = (q_h[:, :, rows], k_h[:, :, a:c], v_h[:, :, a:c])

                def fwd(calls=calls, qkv=qkv, at=(j * span, a)):
                    with torch.no_grad():
                        calls.attend(*qkv, *at)

                def bwd(calls=calls, qkv=qkv, at=(j * span, a), rows=rows, merged=merged,
                        g_h=g_h):  # fmt: skip
                    with torch.no_grad():
                        out, lse = merged
                        calls.grads(*qkv, out[:, :, rows], lse[:, :, rows], g_h[:, :, rows], *at)

                bm = calls.mask(j * span, span, a, c - a)
                key = ("ulysses_rounds", tuple(qkv[0].shape), tuple(qkv[1].shape),
                       clock.mask_key(bm))  # fmt: skip
                item = Item(key=key, fwd=fwd, bwd=bwd if merged is not None else None,
                            block_masks=(bm,))  # fmt: skip
                timed = clock.time(item, "fwd")
                fwd_ms[max(j, a // span)] += timed.ms  # in the round whose keys it waits for
                host[0] += timed.host_ms
                if merged is not None:
                    timed = clock.time(item, "bwd")
                    bwd_ms[m - 1 - j] += timed.ms  # the backward runs the last round first
                    host[1] += timed.host_ms
                pairs += 1
        works.append(
            RoundWork(
                fwd_ms=tuple(fwd_ms), bwd_ms=tuple(bwd_ms) if merged is not None else (),
                fwd_bytes=(heads.fwd_bytes,), tail_fwd_bytes=heads.tail_bytes,
                host_fwd_ms=host[0], host_bwd_ms=host[1],
                out_ready=tuple(plan.out_ready(j) for j in range(m)),
                grads_ready=tuple(plan.grads_ready(j) for j in range(m)),
            )
        )  # fmt: skip
    return Simulation(sc.world_size, works, 1, pairs_computed=pairs, bytes_moved=heads.sent,
                      peak_mem_bytes=heads.peak_bytes)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Priced (attngym.distributed.model.transfer_model).


@dataclasses.dataclass(frozen=True)
class RoundWork(RankWork):
    """A rank's work in rounds: fwd_ms per round (its calls), bwd_ms per round last to first,
    fwd_bytes the q/k/v exchange and tail_fwd_bytes the output's, all rounds together;
    out_ready and grads_ready as RoundPlan's."""

    out_ready: tuple[int, ...] = ()
    grads_ready: tuple[int, ...] = ()


def _pipeline(compute, arrive_ms: float, leave_ms: float, ready) -> float:
    """Rounds arriving one after another (`arrive_ms` each on the fabric), each computed once it
    is there and the one before is done, then results leaving in order (`leave_ms` each), each
    once final (ready[n]: after the compute of round ready[n]) and the fabric free."""
    t, done = 0.0, []
    for j, ms in enumerate(compute):
        t = max(t, (j + 1) * arrive_ms) + ms
        done.append(t)
    link = len(compute) * arrive_ms
    for n in range(len(compute)):
        link = max(link, done[ready[n]]) + leave_ms
    return max(t, link)


def rounds_rank_ms(work: RoundWork, fab: Fabric, backward: bool, crossing: float = 0.0) -> float:
    """Forward: each round's q/k/v, its calls beside the next round's exchange, its output home
    once final; backward the same last round first: its dO, its calls' gradients, its dq, dK and
    dV home once no call left adds to them."""
    m = len(work.fwd_ms)
    into = fab.ms("alltoall", (work.fwd_bytes[0] if work.fwd_bytes else 0.0) / m, crossing)
    back = fab.ms("alltoall", work.tail_fwd_bytes / m, crossing)
    total = _pipeline(work.fwd_ms, into, back, work.out_ready)
    if backward:  # in processing order (last round first), homes issued last round first
        ready = [m - 1 - work.grads_ready[m - 1 - n] for n in range(m)]
        total += _pipeline(work.bwd_ms, back, into, ready)
    return total
