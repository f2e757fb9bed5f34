"""Which chunk pairs a rank computes, and the loops that attend and differentiate them.

Apart from cp.py (the options and the call every scheme takes) because only the pairwise schemes
(the ring, the all-gather, the simulated ranks) plan chunk pairs:

    pairs        the plan of (q chunk, kv chunk) pairs against one K/V shard (or the rows of it
                 held), masked ones skipped, kept per Variant; read_part cuts a pair to the rows
                 its mask reads; rows_read / runs_read: which rows of a shard a rank reads
    positioned   a call whose rows and keys sit at given global positions (PositionedCall);
                 step_call: the ring's step over a shard of several chunks as one such call
    forward_pairs / backward_pairs   attend, or differentiate, this rank's q over one K/V shard
                 (partials into an accumulate.Accumulator, gradients into accumulate.GradSums)
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Mapping
from typing import Any

import torch

from attngym import kernels, reference
from attngym.distributed.call.accumulate import Accumulator, GradSum
from attngym.distributed.call.cp import CPCall, attend
from attngym.distributed.call.merge import weights
from attngym.variants.base import Variant

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
    source=None,
):
    """(skip, block_mask) for one chunk pair: skip when the variant masks every entry.

    backend "reference": the exact dense mask over (B, H) decides and no block mask is kept (the
    mask is small there). "flex": the block mask the kernels use anyway decides, and is kept for
    them; a variant without a mask gets a full block mask (flex's backward op needs one). Memoised
    in _PLANS; `source` (CPCall.plans) may supply it first.
    """
    plans = _PLANS.setdefault(variant, {})
    key = (batch, heads, q_chunk, kv_chunk, block_size, backend, device)
    if key not in plans:
        plan = None if source is None else source(*key)
        plans[key] = plan if plan is not None else _build_pair_plan(
            variant, batch, heads, q_chunk, kv_chunk, block_size, backend, device
        )  # fmt: skip
    return plans[key]


def _build_pair_plan(variant, batch, heads, q_chunk, kv_chunk, block_size, backend, device):
    if backend == "reference":
        if variant.mask_mod is None:
            return False, None
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
        full_when_unmasked=True,
    )
    return kernels.block_mask_is_empty(block_mask), block_mask


def pairs(
    call: CPCall,
    q: torch.Tensor,
    kv_rank: int,
    *,
    block_masks: str | None = None,
    window: tuple[int, int] | None = None,
    masks: bool = True,
):
    """The (q rows, kv rows, q chunk, kv chunk, block_mask) pairs to compute against kv_rank.

    Rows are local slices of this rank's q shard and of the K/V held; chunks are global
    (offset, length). Skipped pairs are counted in call.stats.

    Args:
        block_masks: the backend whose block masks to return ("flex", or "reference" for none);
            default the call's backend. The flex backward asks for "flex" masks whatever the
            forward kernel is.
        window: (start, length): only rows [start, start + length) of kv_rank's shard are held
            (a halo, see ring.py); kv rows are then relative to `start` and each kv chunk is cut
            to the window. Rows outside it must be masked for this rank (the halo plan ensures
            it), so the cut is exact.
        masks: False: which pairs are computed (and counted), their block masks None and not
            built (a caller that counts, or asks whether any pair is left).
    """
    backend = block_masks or call.backend
    lo, hi = (0, call.seq_len // call.world_size) if window is None else (window[0], sum(window))
    q_chunks, q_starts, start = call.chunks(call.rank), [], 0
    for qc in q_chunks:
        q_starts.append(start)
        start += qc[1]
    kv_cuts = []  # (kv rows held, the kv chunk cut to them)
    kv_start = 0
    for kc in call.chunks(kv_rank):
        a, b = max(kv_start, lo), min(kv_start + kc[1], hi)
        if a < b:
            kv_cuts.append((slice(a - lo, b - lo), (kc[0] + a - kv_start, b - a)))
        kv_start += kc[1]
    kept = _kept(call, q, q_chunks, [kc for _, kc in kv_cuts])
    if kept is not None:  # the kept pairs at once, row by row as the loop below
        chosen = kept.nonzero().tolist()
        if call.stats is not None and block_masks is None:
            call.stats.pairs_skipped += kept.numel() - len(chosen)
            call.stats.pairs_computed += len(chosen)
    else:
        chosen = [(i, j) for i in range(len(q_chunks)) for j in range(len(kv_cuts))]
    out = []
    for i, j in chosen:
        qc, (kv_rows, kc) = q_chunks[i], kv_cuts[j]
        block_mask = None
        if kept is None or masks:
            skip, block_mask = _call_plan(call, q, qc, kc, backend)
            if kept is None and call.stats is not None and block_masks is None:
                call.stats.pairs_skipped += int(skip)
                call.stats.pairs_computed += int(not skip)
            if skip:
                continue
        q_rows = slice(q_starts[i], q_starts[i] + qc[1])
        out.append((q_rows, kv_rows, qc, kc, block_mask))
    return out


def _kept(call: CPCall, q: torch.Tensor, q_chunks, kv_chunks) -> torch.Tensor | None:
    """Which chunk pairs the mask keeps anything of, all at once from the whole sequence's
    grid (grid.GridPlans.kept); None where the pairs are decided one by one (`_pair_plan`)."""
    kept = getattr(call.plans, "kept", None)
    return None if kept is None else kept(q_chunks, kv_chunks, call.options.block_size, q.device)


def read_part(call: CPCall, q: torch.Tensor, pair, backend: str):
    """The pair (as `pairs` gives it) cut to the query rows and keys its mask reads, when they
    are at most half of either side (a halo pair then returns gradient pieces over the band it
    touches, not over the whole q chunk and kv window). A cut is a power-of-two number of blocks
    (`bucket`), so the kernel shapes cuts add, each compiled once, stay few. Memoised."""
    q_rows, kv_rows, qc, kc, block_mask = pair
    plans = _PLANS.setdefault(call.variant, {})
    key = ("read", *q.shape[:2], qc, kc, call.options.block_size, backend, q.device)
    if key not in plans:
        qa, qb, ka, kb = _read_extent(call, q, qc, kc, block_mask, backend)
        bq, bkv = call.options.block_size
        plans[key] = (*bucket(qa, qb, qc[1], bq), *bucket(ka, kb, kc[1], bkv))
    qa, qb, ka, kb = plans[key]
    if (qa, qb, ka, kb) == (0, qc[1], 0, kc[1]):
        return pair
    qc_cut, kc_cut = (qc[0] + qa, qb - qa), (kc[0] + ka, kb - ka)
    _, cut_mask = _call_plan(call, q, qc_cut, kc_cut, backend)
    return (
        slice(q_rows.start + qa, q_rows.start + qb),
        slice(kv_rows.start + ka, kv_rows.start + kb),
        qc_cut,
        kc_cut,
        cut_mask,
    )


def bucket(a: int, b: int, n: int, block: int) -> tuple[int, int]:
    """Rows [a, b) of n widened to `pow2_blocks` inside [0, n); all of [0, n) when they are more
    than half of it."""
    if 2 * (b - a) > n:
        return 0, n
    start = a - a % block
    length = pow2_blocks(b - start, n, block)
    start = min(start, n - length)
    return start, start + length


def pow2_blocks(rows: int, n: int, block: int) -> int:
    """`rows` rounded up to a power-of-two number of blocks, at most n. Every kernel shape is
    compiled once: rows of any count would compile anew for each mask (each batch of a
    workload), these at most log2(n / block) + 2 times."""
    blocks = max(-(-rows // block), 1)
    return min(block << math.ceil(math.log2(blocks)), n)


def _read_extent(call: CPCall, q: torch.Tensor, qc, kc, block_mask, backend: str):
    """(q first, q stop, kv first, kv stop) local rows of a chunk pair that its mask reads."""
    if call.variant.mask_mod is None:
        return 0, qc[1], 0, kc[1]
    if backend == "reference":
        q_pos = torch.arange(qc[0], qc[0] + qc[1], device=q.device)
        kv_pos = torch.arange(kc[0], kc[0] + kc[1], device=q.device)
        keep = reference.dense_mask(call.variant.mask_mod, *q.shape[:2], q_pos, kv_pos)
        rows = keep.flatten(0, 1).any(0)  # (q rows, kv rows)
        q_read, kv_read = rows.any(1).nonzero(), rows.any(0).nonzero()
        return int(q_read[0]), int(q_read[-1]) + 1, int(kv_read[0]), int(kv_read[-1]) + 1
    bq, bkv = block_mask.BLOCK_SIZE
    kept = block_mask.kv_num_blocks
    if block_mask.full_kv_num_blocks is not None:
        kept = kept + block_mask.full_kv_num_blocks
    q_blocks = (kept.flatten(0, 1).amax(0) > 0).nonzero()
    kv_blocks = _kv_blocks_kept(block_mask, -(-kc[1] // bkv)).nonzero()
    return (
        int(q_blocks[0]) * bq,
        min((int(q_blocks[-1]) + 1) * bq, qc[1]),
        int(kv_blocks[0]) * bkv,
        min((int(kv_blocks[-1]) + 1) * bkv, kc[1]),
    )


@dataclasses.dataclass(frozen=True, eq=False)
class PositionedCall:
    """A kernel call whose query rows and keys sit at given global positions (several chunks,
    or keys gathered from several shards): the variant read there (positions.at_positions),
    the block mask of those positions (cut from the call's grid where it has one) and the
    positions as flex's backward op takes them (positions.BackwardMaps)."""

    variant: Variant
    block_mask: Any  # None on the reference backend when flex's backward op does not run
    maps: Any  # positions.BackwardMaps
    fold: Any = None  # fold.Fold: the call runs with its heads folded into its rows


def attend_at(call: CPCall, q, k, v, pc: PositionedCall):
    """(out, lse) of the call at positions `pc` (folded where pc.fold says, the results unfolded),
    differentiable w.r.t. q, k, v."""
    from attngym.distributed.call import fold

    f = pc.fold
    if f is None:
        return attend(call, q, k, v, 0, 0, pc.block_mask, variant=pc.variant)
    k, v = fold.keys_in(k), fold.keys_in(v)
    out, lse = attend(call, fold.rows_in(f, q), k, v, 0, 0, f.block_mask, variant=f.variant)
    return fold.rows_out(f, out), fold.rows_out(f, lse)


def positioned(
    call: CPCall, q_positions: torch.Tensor, kv_positions: torch.Tensor, name: str
) -> PositionedCall:
    """The PositionedCall of queries at `q_positions` against keys at `kv_positions` (global
    positions in local order) for this call; the block mask is built where a flex kernel reads
    it (the forward on flex, flex's backward op on any backend)."""
    from attngym.distributed.placement.positions import at_positions, backward_maps

    device = q_positions.device
    tables = kernels.offsets_as_tables(call.options.kernel_options)
    mapped = at_positions(
        call.variant, q_positions, kv_positions, device, name, offsets_as_tables=tables
    )
    block_mask = None
    if call.plans is not None:  # cut from the grid: no mask evaluated for this call
        block_mask = call.plans.sub_mask(q_positions, kv_positions, mapped.mask_mod)
    if block_mask is None and "flex" in (call.backend, call.backward):
        block_mask = kernels.make_block_mask(
            mapped, q_positions.numel(), kv_positions.numel(), block_size=call.options.block_size,
            device=device, full_when_unmasked=True,
        )  # fmt: skip
    return PositionedCall(mapped, block_mask, backward_maps(q_positions, kv_positions))


def one_call_steps(call: CPCall) -> bool:
    """Whether the ring steps of this call are one PositionedCall each (step_call): where a
    shard holds several chunks (zigzag, balanced, a user's layout). A host issues a compiled
    call in about 0.1-0.3 ms, far longer than a pair kernel of small chunks runs (64 ranks of
    128K: 1K rows, microseconds), so pair kernels would leave the device waiting on the host.
    A contiguous shard's step is one pair anyway, at offsets: its callbacks read no table."""
    return len(call.chunks(call.rank)) > 1


# Variant -> {(layout, rank, kv rank, window, B, H, block size, backend, backward, device,
# tables): PositionedCall | None}.
_STEPS: weakref.WeakKeyDictionary[Variant, dict[tuple, PositionedCall | None]] = (
    weakref.WeakKeyDictionary()
)


def step_call(
    call: CPCall, q: torch.Tensor, kv_rank: int, window: tuple[int, int] | None = None
) -> PositionedCall | None:
    """The call of this rank's whole q shard against kv_rank's shard (or the `window` of it
    held, as `pairs` takes it); None when the mask keeps nothing there. Memoised per variant."""
    n = call.seq_len // call.world_size
    window = (0, n) if window is None else tuple(window)
    tables = kernels.offsets_as_tables(call.options.kernel_options)
    key = (call.layout, call.rank, kv_rank, window, *q.shape[:2], call.options.block_size,
           call.backend, call.backward, q.device, tables)  # fmt: skip
    per = _STEPS.setdefault(call.variant, {})
    if key not in per:
        # The chunk pairs decide (uncounted: block_masks given).
        if not pairs(call, q, kv_rank, block_masks=call.backend, window=window, masks=False):
            per[key] = None
            return None
        q_pos = call.layout.positions(call.rank, q.device)
        kv_pos = call.layout.positions(kv_rank, q.device)[window[0] : sum(window)]
        name = f"{call.variant.name}@{call.layout.name}.rank{call.rank}.step{kv_rank}"
        per[key] = positioned(call, q_pos, kv_pos, name)
    return per[key]


def rows_read(call: CPCall, q: torch.Tensor, q_rank: int, kv_rank: int) -> tuple[int, int] | None:
    """[lo, hi): the local rows of kv_rank's shard that q_rank's queries read (the hull of
    `runs_read`, a superset of the exact rows), or None when they read none."""
    runs = runs_read(call, q, q_rank, kv_rank)
    return (runs[0][0], runs[-1][1]) if runs else None


def runs_read(
    call: CPCall, q: torch.Tensor, q_rank: int, kv_rank: int
) -> tuple[tuple[int, int], ...]:
    """The runs [a, b) of kv_rank's local rows that q_rank's queries read, in order and merged:
    the whole kv blocks some query block keeps (partial or full) in the pairs' block masks,
    read from their block indices (no dense copy: the all-gather asks this of P² rank pairs)."""
    runs: list[tuple[int, int]] = []
    kv_start = 0
    for kc in call.chunks(kv_rank):
        used = None
        for qc in call.chunks(q_rank):
            skip, block_mask = _call_plan(call, q, qc, kc, "flex")
            if skip:
                continue
            block = block_mask.BLOCK_SIZE[1]
            kept = _kv_blocks_kept(block_mask, -(-kc[1] // block))
            used = kept if used is None else used | kept
        if used is not None:
            for a, b in _true_runs(used.cpu()):
                a, b = kv_start + a * block, kv_start + min(b * block, kc[1])
                if runs and runs[-1][1] == a:
                    a = runs.pop()[0]
                runs.append((a, b))
        kv_start += kc[1]
    return tuple(runs)


def _kv_blocks_kept(block_mask, num_kv_blocks: int) -> torch.Tensor:
    """(num_kv_blocks,) bool: the kv blocks some query block keeps (partial or full)."""
    kept = None
    for num, idx in (
        (block_mask.kv_num_blocks, block_mask.kv_indices),
        (block_mask.full_kv_num_blocks, block_mask.full_kv_indices),
    ):
        if num is None:
            continue
        listed = idx[torch.arange(idx.shape[-1], device=idx.device) < num.unsqueeze(-1)]
        here = torch.zeros(num_kv_blocks, dtype=torch.bool, device=idx.device)
        here[listed.long()] = True
        kept = here if kept is None else kept | here
    return kept


def _true_runs(flags: torch.Tensor) -> list[tuple[int, int]]:
    """[a, b) runs of True in a 1-D bool tensor."""
    edges = torch.diff(flags.to(torch.int8), prepend=flags.new_zeros(1, dtype=torch.int8),
                       append=flags.new_zeros(1, dtype=torch.int8))  # fmt: skip
    starts, stops = (edges == 1).nonzero()[:, 0].tolist(), (edges == -1).nonzero()[:, 0].tolist()
    return list(zip(starts, stops, strict=True))


def _call_plan(call: CPCall, q: torch.Tensor, qc, kc, backend: str):
    """_pair_plan for one chunk pair of this call (q gives batch, heads and device)."""
    return _pair_plan(
        call.variant, q.shape[0], q.shape[1], qc, kc, call.options.block_size, backend, q.device,
        call.plans,
    )  # fmt: skip


def forward_pairs(call: CPCall, acc: Accumulator, q, k, v, kv_rank: int, window=None) -> None:
    """Attend this rank's q chunks to kv_rank's K/V (its shard, or the `window` of it held): one
    call over the whole shard where it has several chunks (step_call), else per chunk pair."""
    if one_call_steps(call):
        if call.stats is not None:
            # counted, as the pairs the call covers
            pairs(call, q, kv_rank, window=window, masks=False)
        step = step_call(call, q, kv_rank, window)
        if step is not None:
            out_i, lse_i = attend_at(call, q, k, v, step)
            acc.add(slice(0, q.shape[2]), out_i, lse_i)
        return
    for q_rows, kv_rows, qc, kc, block_mask in pairs(call, q, kv_rank, window=window):
        out_i, lse_i = attend(
            call, q[:, :, q_rows], k[:, :, kv_rows], v[:, :, kv_rows], qc[0], kc[0], block_mask
        )
        acc.add(q_rows, out_i, lse_i)


@dataclasses.dataclass(frozen=True)
class Saved:
    """What a rank's backward needs of its forward: its q shard and the merged results.

    q, out, dout: (B, H, S/P, D) in the input dtype; lse: (B, H, S/P) merged, natural base, in the
    accumulator dtype (float32, float64 for float64 inputs); lse2: per q chunk (start, stop) of
    rows, the same in the base flex's backward op reads (flex_backward.kernel_lse), converted
    once per backward, not per pair (None: each pair converts its own).
    """

    q: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    dout: torch.Tensor
    lse2: Mapping[tuple[int, int], torch.Tensor] | None = None


def backward_pairs(
    call: CPCall,
    saved: Saved,
    k,
    v,
    kv_rank: int,
    dq: GradSum,
    dk: GradSum,
    dv: GradSum,
    *,
    window: tuple[int, int] | None = None,
    dkv_offset: int = 0,
) -> None:
    """Add the gradients of the pairs against kv_rank's shard: dq into `dq`, dK/dV into `dk`, `dv`.

    Args:
        saved: this rank's forward (Saved).
        k, v: kv_rank's shard (B, G, S/P, D), or the `window` of it held.
        dq: the GradSum of this rank's dq, (B, H, S/P, D).
        dk, dv: the GradSums of kv_rank's dK, dV, (B, G, rows, D): kv row j of the held K/V
            lands at row j + dkv_offset.
        window: the rows of kv_rank's shard held (see `pairs`).
    """
    from attngym.distributed.call import flex_backward

    flex = call.backward == "flex"
    if one_call_steps(call):
        step = step_call(call, saved.q, kv_rank, window)
        if step is not None:
            _step_backward(call, saved, k, v, step, dq, dk, dv, dkv_offset)
        return
    masks = "flex" if flex else call.backend
    for pair in pairs(call, saved.q, kv_rank, block_masks=masks, window=window):
        # Cut to what the mask reads: a halo pair's pieces cover its band, not the whole chunk.
        q_rows, kv_rows, qc, kc, block_mask = read_part(call, saved.q, pair, masks)
        k_i, v_i = k[:, :, kv_rows], v[:, :, kv_rows]
        grads = None
        if flex:
            grads = flex_backward.pair_grads(call, saved, q_rows, k_i, v_i, qc, kc, block_mask)
        if grads is None:  # recompute, or flex failed under backward=auto (logged)
            grads = recompute_pair(call, saved, q_rows, k_i, v_i, qc, kc, block_mask)
        dq_i, dk_i, dv_i = grads
        dq.add(q_rows.start, dq_i)
        dk.add(kv_rows.start + dkv_offset, dk_i)
        dv.add(kv_rows.start + dkv_offset, dv_i)


def _step_backward(call: CPCall, saved: Saved, k, v, step: PositionedCall, dq, dk, dv, dkv_offset):
    """A step call's gradients added into dq (the whole shard) and dk, dv (held rows at
    `dkv_offset`)."""
    dq_i, dk_i, dv_i = grads_at(call, saved, k, v, step)
    dq.add(0, dq_i)
    dk.add(dkv_offset, dk_i)
    dv.add(dkv_offset, dv_i)


def grads_at(call: CPCall, saved: Saved, k, v, pc: PositionedCall):
    """(dq, dk, dv) of a call at positions `pc` over all of `saved`'s rows, from its merged out
    and lse: flex's backward op (on the folded call where pc.fold says, its gradients unfolded),
    or the call re-run, weighted (backward recompute, or the op failed under backward=auto,
    logged)."""
    from attngym.distributed.call import flex_backward, fold

    whole = slice(0, saved.q.shape[2])
    lse2 = None if saved.lse2 is None else saved.lse2.get((0, whole.stop))
    grads, f = None, pc.fold
    if call.backward == "flex" and f is not None:
        q, out, lse, dout = (
            fold.rows_in(f, t) for t in (saved.q, saved.out, saved.lse, saved.dout)
        )
        grads = flex_backward.grads(
            call, q, fold.keys_in(k), fold.keys_in(v), out, lse, dout, f.block_mask,
            lse2=None if lse2 is None else fold.rows_in(f, lse2), variant=f.variant,
        )  # fmt: skip
        if grads is not None:
            dq, dk, dv = grads
            return fold.rows_out(f, dq), fold.keys_out(f, dk), fold.keys_out(f, dv)
    elif call.backward == "flex":
        maps = pc.maps
        grads = flex_backward.grads(
            call, saved.q, k, v, saved.out, saved.lse, saved.dout, pc.block_mask,
            q_offset=maps.q_offset, kv_offset=maps.kv_offset, lse2=lse2,
            q_positions=maps.q_positions, kv_positions=maps.kv_positions,
        )  # fmt: skip
    if grads is None:  # recompute, or flex failed under backward=auto (logged)
        grads = recompute_pair(
            call, saved, whole, k, v, (0, 0), (0, 0), pc.block_mask, variant=pc.variant
        )
    return grads


def recompute_pair(call: CPCall, saved: Saved, q_rows, k_i, v_i, qc, kc, block_mask, variant=None):
    """One pair's (dq, dk, dv): its forward again under autograd, weighted by exp(lse_i - lse);
    `variant`: a PositionedCall's, at its positions (qc, kc at 0)."""
    lse = saved.lse[:, :, q_rows]
    out = saved.out[:, :, q_rows].to(lse.dtype)
    dout = saved.dout[:, :, q_rows].to(lse.dtype)
    with torch.enable_grad():
        q_i = saved.q[:, :, q_rows].detach().requires_grad_()
        k_i = k_i.detach().requires_grad_()
        v_i = v_i.detach().requires_grad_()
        out_i, lse_i = attend(call, q_i, k_i, v_i, qc[0], kc[0], block_mask, variant=variant)
        w = weights(lse_i.detach().to(lse.dtype), lse)
        g_out = (w.unsqueeze(-1) * dout).to(out_i.dtype)
        g_lse = w * (dout * (out_i.detach().to(lse.dtype) - out)).sum(-1)
        return torch.autograd.grad([out_i, lse_i], [q_i, k_i, v_i], [g_out, g_lse.to(lse_i.dtype)])
