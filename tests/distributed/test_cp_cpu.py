"""Context parallelism on CPU ranks (gloo): attention parity, transports, launch failures.

Each spawn costs seconds, so one spawn runs many cases and returns their results to the test.
Inputs are float64 and the chunk kernel is the float64 reference, so CP and the whole-sequence
reference differ only by the order of a few sums (a handful of ulp of O(1) values); 1e-10 is far
above that yet far below any real bug (a wrong offset or weight gives errors of order 1e-2).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import time

import pytest
import torch

from attngym import reference, variants
from attngym.distributed import (
    P2PAllGather,
    P2PChannel,
    allgather_attention,
    ring_attention,
    shard,
    unshard,
)
from attngym.distributed.ranks.launch import launch
from attngym.distributed.schemes.ring import CPStats
from attngym.errors import ConfigError, RankFailure
from attngym.runner.config import Benchmark, Settings, Shape, Topology

from .catalogue import HEADS, PARAMS

TOL = 1e-10
S = 32


def _cases():
    return {
        "causal": variants.get("causal"),
        "alibi": variants.get("alibi", num_heads=4),
        "sliding_window+softcap": variants.compose(
            variants.get("sliding_window", window_size=6), variants.get("softcap", soft_cap=5.0)
        ),
        "document": variants.get("document", doc_lengths=[10, 14, 8]),
    }


def _gather(t, world_size, layout, variant=None):
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(world_size)]
    dist.all_gather(parts, t.detach().contiguous())
    return unshard(parts, layout, variant=variant)


def _parity(
    rank, world_size, name, variant, heads, kv_heads, fns, layouts, backward="auto", seq_len=None,
    **overrides,
):  # fmt: skip
    gen = torch.Generator().manual_seed(7)
    seq_len = seq_len or (S if world_size == 2 else 36)
    q = torch.randn(2, heads, seq_len, 8, generator=gen, dtype=torch.float64)
    k, v = (
        torch.randn(2, kv_heads, q.shape[2], 8, generator=gen, dtype=torch.float64)
        for _ in range(2)
    )
    dout = torch.randn(q.shape, generator=gen, dtype=torch.float64)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref_out, _ = reference.attention(qr, kr, vr, variant.score_mod, variant.mask_mod)
    ref_out.backward(dout)
    errors = {}
    for fn in fns:
        for layout in layouts:
            q_s, k_s, v_s = (
                shard(t, rank, world_size, layout, variant=variant).requires_grad_()
                for t in (q, k, v)
            )
            out = fn(
                q_s, k_s, v_s, variant, layout=layout, transport="gloo", backward=backward,
                **overrides,
            )  # fmt: skip
            out.backward(shard(dout, rank, world_size, layout, variant=variant))
            got = [out, q_s.grad, k_s.grad, v_s.grad]
            want = [ref_out, qr.grad, kr.grad, vr.grad]
            errors[(name, fn.__name__, layout, backward, *overrides.values())] = [
                (_gather(g, world_size, layout, variant) - w).abs().max().item()
                for g, w in zip(got, want, strict=True)
            ]
    return errors


def _attention_worker(rank, world_size):
    import torch.distributed as dist

    errors = {}
    for name, variant in _cases().items():
        kv_heads = 2 if name == "causal" else 4  # GQA on one case
        # Every layout: the ring's pairs and the all-gather's one call with flex's backward op
        # (auto resolves to it on this torch); on one layout the ring's re-run backward and the
        # all-gather through the kernel's own autograd.
        errors.update(
            _parity(
                rank,
                world_size,
                name,
                variant,
                4,
                kv_heads,
                (ring_attention, allgather_attention),
                ("contiguous", "zigzag", "balanced"),
            )
        )
        errors.update(
            _parity(
                rank, world_size, name, variant, 4, kv_heads,
                (ring_attention, allgather_attention), ("zigzag",), backward="recompute",
            )
        )  # fmt: skip
        # The all-gather's calls split around its exchange (own keys, then the rows received),
        # on every layout, with the op and with re-run forwards.
        for backward, overlap_layouts in (("auto", ("contiguous", "zigzag", "balanced")),
                                          ("recompute", ("balanced",))):  # fmt: skip
            errors.update(
                _parity(
                    rank, world_size, name, variant, 4, kv_heads, (allgather_attention,),
                    overlap_layouts, backward=backward, overlap=True,
                )
            )  # fmt: skip
        # Blocks of 4 rows: the received rows' call covers only the query blocks that read
        # them (the window's halo: the shard's first rows), merged into those rows alone.
        errors.update(
            _parity(
                rank, world_size, name, variant, 4, kv_heads, (allgather_attention,),
                ("contiguous",), overlap=True, block_size=(4, 4),
            )
        )  # fmt: skip
        # The batch and heads folded into the call's rows, its costliest block rows first
        # (AllGatherOptions.fold; blocks of 4 rows, so that a shard is whole blocks): ALiBi
        # reads each row's head, GQA its keys' head, the batch of 2 its batch. With flex's
        # backward op: the call re-run under autograd is folded on flex (CUDA) only.
        errors.update(
            _parity(
                rank, world_size, name, variant, 4, kv_heads, (allgather_attention,),
                ("zigzag", "balanced"), fold=True, block_size=(4, 4),
            )
        )  # fmt: skip
    # The ring's placement priced per pair kernel (here another one than by blocks: rank 0
    # holds the second half), handed to shard and to the call as one Layout.
    from attngym.distributed.placement import layout as layouts

    docs = variants.get("document", doc_lengths=[20, 4, 8])
    priced = layouts.plan("balanced", world_size, S, docs, (4, 4),
                          kernels=layouts.PairKernels(2, 2))  # fmt: skip
    assert priced.placement != layouts.plan("balanced", world_size, S, docs, (4, 4)).placement
    errors.update(_parity(rank, world_size, "document", docs, 4, 4, (ring_attention,), (priced,)))
    # Whole documents placed from their lengths (layout=documents), the longest split head and
    # tail: the ring and the all-gather (its call split around the exchange too).
    errors.update(_parity(rank, world_size, "document", docs, 4, 2, (ring_attention,),
                          ("documents",)))  # fmt: skip
    for overlap in (False, True):
        errors.update(_parity(rank, world_size, "document", docs, 4, 2, (allgather_attention,),
                              ("documents",), overlap=overlap))  # fmt: skip
        errors.update(_parity(rank, world_size, "document", docs, 4, 2, (allgather_attention,),
                              ("documents",), overlap=overlap, fold=True,
                              block_size=(4, 4)))  # fmt: skip
    # Rank 1 reads 3 blocks of rank 0's shard (a document of 24 rows from row 4): its call also
    # holds the unread block before them as zeros (ReadPlan.pads); exact all the same, forward
    # and backward.
    # The same with the call split around the exchange: the received rows' call holds those
    # zeros too (received_pieces), and its queries the rows that read them, widened.
    docs = variants.get("document", doc_lengths=[4, 24, 4])
    for overlap in (False, True):
        errors.update(_parity(rank, world_size, "document pads", docs, 4, 2,
                              (allgather_attention,), ("contiguous",), overlap=overlap,
                              block_size=(4, 4)))  # fmt: skip
    # Pairs computed / skipped by a causal forward, per rank.
    counts = {}
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 2, S, 4, generator=gen, dtype=torch.float64)
    for fn in (ring_attention, allgather_attention):
        for layout in ("contiguous", "zigzag"):
            stats = CPStats()
            xs = shard(x, rank, world_size, layout)
            with torch.no_grad():
                fn(xs, xs, xs, variants.get("causal"), layout=layout, stats=stats)
            both = [None] * world_size
            dist.all_gather_object(both, (stats.pairs_computed, stats.pairs_skipped))
            counts[(fn.__name__, layout)] = both
    # compile / compile_mode reach the chunk kernel of both topologies, forward and backward.
    import attngym.kernels

    seen, calls, attend_chunk = set(), [], attngym.kernels.attend_chunk

    def spy(*args, **kwargs):
        seen.add((kwargs["compile"], kwargs["compile_mode"]))
        calls.append(1)
        return attend_chunk(*args, **kwargs)

    attngym.kernels.attend_chunk = spy
    try:
        for fn in (ring_attention, allgather_attention):
            xs = shard(x, rank, world_size, "contiguous").requires_grad_()
            out = fn(xs, xs, xs, variants.get("causal"), compile=False, compile_mode="max-autotune")
            out.sum().backward()
        # Forward kernel calls made by the ring's backward: none with flex's backward op, one per
        # step's call when re-running forwards.
        # The all-gather's backward runs no forward either way: flex's op, or the kernel's own
        # autograd.
        reruns = {}
        for fn in (ring_attention, allgather_attention):
            for backward in ("flex", "recompute"):
                xs = shard(x, rank, world_size, "zigzag").requires_grad_()
                stats = CPStats()
                out = fn(
                    xs, xs, xs, variants.get("causal"), layout="zigzag", backward=backward,
                    stats=stats,
                )  # fmt: skip
                before = len(calls)
                out.sum().backward()
                reruns[fn.__name__, backward] = (
                    len(calls) - before, stats.pairs_computed, stats.backward
                )  # fmt: skip
    finally:
        attngym.kernels.attend_chunk = attend_chunk
    return errors, counts, seen, reruns


def _user_mask(b, h, q_idx, kv_idx):
    """A user's own mask with no block rule: causal stripes and a head-dependent band."""
    return (q_idx >= kv_idx) & (((q_idx // 5 + kv_idx // 3) % 3 != 0) | (q_idx - kv_idx < h + 2))


def _user_mask_worker(rank, world_size):
    from attngym.variants.base import Variant

    user = Variant(name="user", mask_mod=_user_mask)
    errors = _parity(
        rank, world_size, "user", user, 4, 2, (ring_attention, allgather_attention),
        ("contiguous", "zigzag", "balanced"), seq_len=64,
    )  # fmt: skip
    errors.update(
        _parity(
            rank, world_size, "user", user, 4, 2, (allgather_attention,),
            ("contiguous", "zigzag", "balanced"), seq_len=64, overlap=True,
        )
    )  # fmt: skip
    errors.update(
        _parity(
            rank,
            world_size,
            "user",
            user,
            4,
            2,
            (ring_attention,),
            ("zigzag", "balanced"),
            backward="recompute",
            seq_len=64,
        )  # fmt: skip
    )
    return errors


def test_a_users_mask_on_four_ranks_every_layout_matches_float64_fwd_bwd():
    """4 gloo ranks, a mask with no block rule: ring (flex's backward and the re-run one) and
    all-gather (the exchange of the rows each rank reads; one call, and split around the
    exchange), forward and every gradient."""
    errors = launch(_user_mask_worker, 4, timeout_s=240)
    assert len(errors) == 2 * 3 + 3 + 2
    for case, errs in errors.items():
        assert max(errs) < TOL, f"{case}: max |err| of out, dq, dk, dv = {errs}"


def test_ring_and_allgather_match_reference_fwd_bwd_and_skip_masked_pairs():
    errors, counts, seen, reruns = launch(_attention_worker, 2, timeout_s=120)
    assert seen == {(False, "max-autotune"), (True, "default")}
    # + the ring on its pair-priced placement, the all-gather with pads (one call, and split),
    # the ring and the all-gather (one call, and split; each folded too) on layout=documents
    assert len(errors) == 4 * (2 * 3 + 2 + 4 + 1 + 2) + 3 + 5
    assert reruns["ring_attention", "flex"] == (0, 5, "flex")  # zigzag causal: 5 pairs, no re-run
    # zigzag: a step is one call over the rank's two chunks, so one re-run per step
    assert reruns["ring_attention", "recompute"] == (2, 5, "recompute")
    assert reruns["allgather_attention", "flex"] == (0, 5, "flex")
    assert reruns["allgather_attention", "recompute"] == (0, 5, "kernel")
    for case, errs in errors.items():
        assert max(errs) < TOL, f"{case}: max |err| of out, dq, dk, dv = {errs}"
    for fn in ("ring_attention", "allgather_attention"):
        # contiguous: rank 0's queries precede rank 1's keys, so that pair is skipped.
        assert counts[(fn, "contiguous")] == [(1, 1), (2, 0)]
        # zigzag (4 chunks): each rank computes 5 of its 8 chunk pairs — balanced work.
        assert counts[(fn, "zigzag")] == [(5, 3), (5, 3)]


def _transport_worker(rank, world_size, run_dir):
    import torch.distributed as dist

    from attngym.distributed.ranks import launch as launch_mod
    from attngym.distributed.schemes.topologies import TOPOLOGIES
    from attngym.distributed.transport import resolve_transport
    from attngym.runner.tasks.context_parallel import _rank_run

    out = {}
    # Channel: many steps over two rounds; at step i a rank holds rank (r - i)'s data.
    chan = P2PChannel((2, 3), 2, dtype=torch.float32, device="cpu", timeout_s=30)
    mine = torch.full((2, 2, 3), float(rank))
    held, ptrs = [], {}
    for _ in range(2):
        data = mine
        for i in range(world_size * 2):
            if i > 0:
                data = chan.recv(i)
                ptrs.setdefault(i % 2, set()).add(data.data_ptr())
                held.append(int(data[0, 0, 0]))
            chan.send(data, i)
            if i > 0:
                chan.release(i)
        chan.recv(world_size * 2)
        chan.release(world_size * 2)
    chan.join()
    out["held"] = held
    out["two_slots"] = len(ptrs[0]) == 1 and len(ptrs[1]) == 1 and ptrs[0] != ptrs[1]
    # Misuse raises before anything is sent, so the ranks stay in step.
    errs = []

    def attempt(bad):
        try:
            bad()
            errs.append(None)
        except (RuntimeError, ValueError) as e:
            errs.append(f"{type(e).__name__}: {e}")

    for bad in (
        lambda: chan.recv(3),  # never sent
        lambda: chan.release(1),  # never received
        lambda: chan.send(torch.zeros(2, 2, 4), 0),  # wrong shape
        lambda: chan.send(torch.zeros(2, 2, 3, dtype=torch.float64), 0),  # wrong dtype
        lambda: chan.recv(0),  # step 0 is the rank's own data
    ):
        attempt(bad)
    chan.send(mine, 0)
    chan.recv(1)
    attempt(lambda: chan.recv(1))  # the same step twice, refused as on the copy engine
    attempt(lambda: chan.send(mine, 2))  # would receive step 3 into slot 1, still holding step 1
    chan.release(1)
    chan.join()
    out["errors"] = errs
    # Each topology's transfer-only timing follows its step protocol at three ranks: the ring
    # P - 1 steps a round, the all-gather and the all-to-all one exchange a round.
    gloo = resolve_transport("gloo", "cpu")
    k_s = torch.randn(1, 2, 4, 8)
    out["transfer_ms"] = {
        name: spec.transfer_ms(gloo, k_s, 30, 2) for name, spec in TOPOLOGIES.items()
    }

    # All-gather: offsets, reduce_scatter, differentiable wait.
    gen = torch.Generator().manual_seed(100 + rank)
    parts = [torch.randn(2, 3, 4, generator=gen) for _ in range(2)]
    ag = P2PAllGather((2, 3, 4), 2, 1, dtype=torch.float32, device="cpu", timeout_s=30)
    ag.start(parts)
    try:
        ag.start(parts)
        out["double_start"] = None
    except RuntimeError as e:
        out["double_start"] = str(e)
    gathered = ag.wait(parts)
    everyone = [None] * world_size
    dist.all_gather_object(everyone, parts)
    expect = torch.stack([torch.cat([p[j] for p in everyone], dim=1) for j in range(2)])
    out["gather_ok"] = gathered.shape == (2, 2, 3 * world_size, 4) and torch.equal(gathered, expect)
    try:
        ag.wait(parts)
        out["wait_without_start"] = None
    except RuntimeError as e:
        out["wait_without_start"] = str(e)
    grad = torch.randn(gathered.shape, generator=gen)
    grads = [None] * world_size
    dist.all_gather_object(grads, grad)
    total = sum(grads)
    rows = slice(3 * rank, 3 * rank + 3)
    out["reduce_scatter_ok"] = torch.allclose(ag.reduce_scatter(grad), total[:, :, rows], atol=1e-5)
    leaves = [p.clone().requires_grad_() for p in parts]
    ag.start(leaves)
    weight = torch.randn(gathered.shape, generator=torch.Generator().manual_seed(3))
    (ag.wait(leaves) * weight).sum().backward()
    out["grad_ok"] = all(
        torch.allclose(leaf.grad, world_size * weight[j][:, rows], atol=1e-5)
        for j, leaf in enumerate(leaves)
    )
    # The CP task on three ranks, then with a wrong result: the verdict fails it (cli then fails
    # the run as for a single-device run).
    settings = Settings(
        attention={"name": "causal"},
        device="cpu",
        shape=Shape(batch=1, heads=2, seq_len=48, head_dim=8),
        topology=Topology(kind="ring", world_size=3, transport="auto", timeout_s=30),
        benchmark=Benchmark(warmup=0, repeats=1),
    )
    out["task_ok"] = _rank_run(rank, world_size, settings, "ring")
    # (The second run also skips the one-device comparison, as a CPU run too large for it would.)
    import attngym.runner.tasks.context_parallel as ring_task

    real, limit = ring_task.CPRun, ring_task.SINGLE_CPU_MAX_BYTES
    ring = TOPOLOGIES["ring"]
    wrong = dataclasses.replace(ring, attention=lambda *a, **kw: 1.5 * ring.attention(*a, **kw))

    class WrongRun(real):
        @classmethod
        def of(cls, settings):
            return dataclasses.replace(real.of(settings), spec=wrong)

    ring_task.CPRun = WrongRun
    ring_task.SINGLE_CPU_MAX_BYTES = 0
    try:
        out["task_wrong"] = _rank_run(rank, world_size, settings, "ring")
    finally:
        ring_task.CPRun = real
        ring_task.SINGLE_CPU_MAX_BYTES = limit
    # Under torchrun (the group exists already), ranks other than 0 log to rank<N>.log.
    name = "attngym.tests.torchrun"

    def speak(r, p):
        logging.getLogger(name).warning("rank %d of %d speaks", r, p)
        return r

    handlers = list(logging.getLogger().handlers)
    out["torchrun"] = launch_mod._join_torchrun(
        speak, world_size, args=(), device="cpu", timeout_s=30, run_dir=run_dir
    )
    out["handlers_restored"] = logging.getLogger().handlers == handlers
    # Under torchrun rank 0's reports land in the caller's dict directly (no private folder).
    progress = {}
    launch_mod._join_torchrun(
        lambda r, p: launch_mod.report({"fwd_ms": 1.5, "rank": r}),
        world_size, args=(), device="cpu", timeout_s=30, progress=progress,
    )  # fmt: skip
    out["torchrun_progress"] = progress
    # Three ranks, GQA, zigzag and contiguous.
    out["parity"] = _parity(
        rank,
        world_size,
        "sliding_window",
        variants.get("sliding_window", window_size=9),
        4,
        2,
        (ring_attention, allgather_attention),
        ("contiguous", "zigzag", "balanced"),
    )
    # A window shorter than a shard: shard s is read by rank s + 1 only, so the ring stops after
    # two of its three steps (and dK/dV go straight home), and only the halo the window reads
    # travels (8 of 12 rows at 4-token blocks); a causal mask needs all three steps, whole shards.
    # The all-gather likewise moves only the rows each rank reads: rank 0 sends the same 8 rows,
    # to rank 1 alone, for the window; its whole shard to both peers for causal.
    steps, gathered = {}, {}
    for name, variant in (("window", variants.get("sliding_window", window_size=5)),
                          ("causal", variants.get("causal"))):  # fmt: skip
        stats = CPStats()
        x = torch.randn(1, 2, 12, 4, dtype=torch.float64)
        with torch.no_grad():
            ring_attention(x, x, x, variant, stats=stats, block_size=(4, 4))
        steps[name] = (len(stats.step_compute_ms), stats.bytes_sent // (2 * 2 * 4 * 8))
        stats = CPStats()
        with torch.no_grad():
            allgather_attention(x, x, x, variant, stats=stats, block_size=(4, 4))
        gathered[name] = stats.bytes_sent // (2 * 2 * 4 * 8)  # K/V rows sent
    out["steps"], out["gathered_rows"] = steps, gathered
    # Forward and backward exact where only halos travel (4-token blocks over 12-row shards).
    out["parity"].update(
        _parity(
            rank,
            world_size,
            "sliding_window",
            variants.get("sliding_window", window_size=5),
            4,
            2,
            (ring_attention, allgather_attention),
            ("contiguous", "zigzag"),
            block_size=(4, 4),
        )
    )
    out["parity"].update(
        _parity(
            rank,
            world_size,
            "document",
            variants.get("document", doc_lengths=[20, 6, 10]),
            4,
            4,
            (ring_attention,),
            ("balanced",),
            backward="recompute",
        )
    )
    return out


def _catalogue_worker(rank, world_size):
    """Every catalogue variant through ring and all-gather, each on a layout in turn, at 8-token
    blocks over 16-row shards (so local masks move halos and skip pairs)."""
    names = ("contiguous", "zigzag", "balanced")
    errors = {}
    for n, name in enumerate(variants.names()):
        variant = variants.get(name, **PARAMS[name])
        for fn, layout in (
            (ring_attention, names[n % 3]),
            (allgather_attention, names[(n + 1) % 3]),
        ):
            errors.update(
                _parity(
                    rank, world_size, name, variant, HEADS, (4, 2)[n % 2], (fn,), (layout,),
                    block_size=(8, 8),
                )
            )  # fmt: skip
    return errors


def _tables_worker(rank, world_size):
    """The FLASH form of the shifted callbacks (position tables, kernels.offsets_as_tables),
    forced here on CPU, against the float64 reference, on a mask and a score that read positions
    and heads: the ring's backward (flex's backward op, after the reference forward), and the
    forward of the ring, the all-gather and Ulysses on eager flex (which has no CPU backward)."""
    import attngym.kernels
    from attngym.distributed import ulysses_attention

    attngym.kernels.offsets_as_tables = lambda kernel_options: True
    variant = variants.compose(
        variants.get("document", doc_lengths=[10, 14, 8]), variants.get("alibi", num_heads=4)
    )
    gen = torch.Generator().manual_seed(11)
    q, k, v, dout = (torch.randn(2, 4, S, 8, generator=gen, dtype=torch.float64) for _ in range(4))
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref_out, _ = reference.attention(qr, kr, vr, variant.score_mod, variant.mask_mod)
    ref_out.backward(dout)
    opts = {"layout": "zigzag", "transport": "gloo", "block_size": (8, 8)}
    q_s, k_s, v_s = (shard(t, rank, world_size, "zigzag").requires_grad_() for t in (q, k, v))
    out = ring_attention(q_s, k_s, v_s, variant, backward="flex", **opts)
    out.backward(shard(dout, rank, world_size, "zigzag"))
    got, want = (q_s.grad, k_s.grad, v_s.grad), (qr.grad, kr.grad, vr.grad)
    errors = {
        "ring backward": [
            (_gather(g, world_size, "zigzag") - w).abs().max().item()
            for g, w in zip(got, want, strict=True)
        ]
    }
    with torch.no_grad():
        for fn in (ring_attention, allgather_attention, ulysses_attention):
            out = fn(q_s.detach(), k_s.detach(), v_s.detach(), variant, backend="flex", **opts)
            error = (_gather(out, world_size, "zigzag") - ref_out).abs().max().item()
            errors[f"{fn.__name__} forward"] = [error]
    return errors


def test_position_tables_match_the_reference():
    errors = launch(_tables_worker, 2, timeout_s=120)
    assert len(errors) == 4
    for case, errs in errors.items():
        assert max(errs) < TOL, f"{case}: max |err| = {errs}"


def test_every_variant_through_ring_and_allgather_matches_reference():
    assert sorted(PARAMS) == variants.names(), "give every catalogue variant its test parameters"
    errors = launch(_catalogue_worker, 2, timeout_s=180)
    assert len(errors) == 2 * len(PARAMS)
    bad = {case: errs for case, errs in errors.items() if max(errs) >= TOL}
    assert bad == {}, f"max |err| of out, dq, dk, dv: {bad}"


def test_p2p_transports_and_three_rank_attention(tmp_path):
    out = launch(_transport_worker, 3, args=(str(tmp_path),), timeout_s=60)
    assert out["held"] == [2, 1, 0, 2, 1] * 2  # rank 0 holds rank (0 - i) mod 3 at steps 1..5
    assert out["two_slots"]
    messages = out["errors"]
    assert None not in messages, messages
    assert messages[0].startswith("RuntimeError") and "never sent" in messages[0]
    assert messages[1].startswith("RuntimeError") and "release(1)" in messages[1]
    # Wrong parts are ValueErrors naming the parameter, as in the copy-engine transport.
    assert messages[2].startswith("ValueError: parts: expected a tensor of shape (2, 2, 3)")
    assert messages[3].startswith("ValueError: parts[0]: expected dtype")
    assert messages[4].startswith("RuntimeError") and "steps start at 1" in messages[4]
    assert messages[5].startswith("RuntimeError: recv(1) twice")
    assert messages[6].startswith("RuntimeError") and "release(1) first" in messages[6]
    times = out["transfer_ms"]
    assert {name: len(t) for name, t in times.items() if t is not None} == {
        "ring": 2 * 2,  # 2 repeats of P - 1 = 2 steps
        "allgather": 2,
        "ulysses": 2,
    }
    assert times["hybrid"] is None  # two levels of transfers: no one step to time
    assert all(t > 0 for name in ("ring", "allgather", "ulysses") for t in times[name])
    ok, wrong = out["task_ok"], out["task_wrong"]
    assert ok["validation"] == "ok" and ok["transport"] == "gloo"
    assert ok["err_out_rel"] < 1e-5 and ok["err_dk_rel"] < 1e-5  # float32 CP vs float64
    assert ok["single_fwd_ms"] > 0 and ok["efficiency"] > 0 and ok["step_transfer_ms"] > 0
    assert wrong["validation"].startswith("failed: err_out_rel=")
    assert wrong["err_out_rel"] > 0.4  # 1.5 x the output: a relative error of 0.5
    assert wrong["single_fwd_ms"] is None and wrong["efficiency"] is None
    assert out["torchrun"] == 0
    for r in (1, 2):
        assert f"rank {r} of 3 speaks" in (tmp_path / f"rank{r}.log").read_text()
    assert not (tmp_path / "rank0.log").exists()
    assert out["handlers_restored"]
    assert out["torchrun_progress"] == {"fwd_ms": 1.5, "rank": 0}
    assert "already outstanding" in out["double_start"]
    assert "no gather outstanding" in out["wait_without_start"]
    assert out["gather_ok"] and out["reduce_scatter_ok"] and out["grad_ok"]
    assert out["steps"] == {"window": (2, 8), "causal": (3, 24)}  # (steps, K/V rows sent)
    assert out["gathered_rows"] == {"window": 8, "causal": 24}
    for case, errs in out["parity"].items():
        assert max(errs) < TOL, f"{case}: {errs}"


def _dying_worker(rank, world_size):
    if rank == 1:
        time.sleep(0.5)
        os._exit(1)
    chan = P2PChannel((4,), 1, dtype=torch.float32, device="cpu", timeout_s=20)
    chan.send(torch.ones(1, 4), 0)
    chan.recv(1)  # rank 1 never sends: this rank must fail, not hang
    return "unreachable"


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                try:
                    with open(f"/proc/{entry}/cmdline") as f:
                        helper = "resource_tracker" in f.read()  # multiprocessing's, not a rank
                except OSError:
                    continue
                if not helper:
                    kids.append(int(entry))
    return kids


def test_dead_rank_fails_the_run_names_it_and_leaves_no_process():
    before = set(_children(os.getpid()))
    start = time.monotonic()
    with pytest.raises(RankFailure, match="rank 1 exited with code 1"):
        launch(_dying_worker, 2, timeout_s=20)
    assert time.monotonic() - start < 20
    assert set(_children(os.getpid())) - before == set()


def _config_error_worker(rank, world_size):
    raise ConfigError("topology.transport", "copy_engine needs one NVLink domain")


def test_config_error_on_a_rank_reaches_the_caller_as_itself():
    with pytest.raises(ConfigError, match="topology.transport: copy_engine"):
        launch(_config_error_worker, 1, timeout_s=20)


def _here_worker(rank, world_size):
    import torch.distributed as dist

    from attngym.distributed.ranks.launch import report

    report({"rank": rank})
    return os.getpid(), dist.get_world_size(), float(torch.ones(1).sum())


def test_a_world_of_one_runs_in_this_process_when_asked_and_leaves_no_group():
    import torch.distributed as dist

    progress: dict = {}
    here = launch(_here_worker, 1, timeout_s=20, in_process=True, progress=progress)
    assert here == (os.getpid(), 1, 1.0) and progress == {"rank": 0}
    assert not dist.is_initialized()
    assert launch(_here_worker, 1, timeout_s=20)[0] != os.getpid()  # spawned unless asked
    with pytest.raises(ConfigError, match="topology.transport: copy_engine"):
        launch(_config_error_worker, 1, timeout_s=20, in_process=True)
    assert not dist.is_initialized()


def test_task_rejects_copy_engine_on_cpu_before_launch_and_accepts_gloo(tmp_path):
    from attngym.runner.tasks.context_parallel import check_hardware
    from attngym.runner.tasks.cp_setup import CPRun

    def settings(transport):
        return Settings(
            attention={"name": "causal"},
            device="cpu",
            shape=Shape(seq_len=64, heads=2, head_dim=8),
            topology=Topology(kind="ring", world_size=2, transport=transport),
        )

    with pytest.raises(ConfigError, match=r"topology.transport: .*'copy_engine'.*auto, gloo"):
        check_hardware(CPRun.of(settings("copy_engine")))
    check_hardware(CPRun.of(settings("gloo")))
    check_hardware(CPRun.of(settings("auto")))


def _sleeping_worker(rank, world_size):
    time.sleep(120)


def test_interrupted_launch_leaves_no_rank_alive(monkeypatch):
    """KeyboardInterrupt while waiting on the ranks: launch terminates the live ranks."""
    import torch.multiprocessing as mp

    def interrupted(self, timeout=None, **kwargs):
        time.sleep(1)  # the ranks are starting (or up) when the interrupt comes
        raise KeyboardInterrupt

    before = set(_children(os.getpid()))
    monkeypatch.setattr(mp.ProcessContext, "join", interrupted)
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        launch(_sleeping_worker, 2, timeout_s=60)
    assert time.monotonic() - start < 30
    assert set(_children(os.getpid())) - before == set()


def test_pair_plans_live_as_long_as_their_variant():
    """The skip decisions are kept per Variant object and go with it (no growing global cache)."""
    from attngym.distributed.call import pairs

    variant = variants.get("causal")
    args = (1, 2, (16, 16), (0, 16), (16, 16), "reference", torch.device("cpu"))
    assert pairs._pair_plan(variant, *args) == (False, None)
    assert pairs._pair_plan(variant, 1, 2, (0, 16), (16, 16), *args[4:])[0] is True  # future keys
    assert len(pairs._PLANS[variant]) == 2
    assert pairs._pair_plan(variant, *args) is pairs._PLANS[variant][(*args[:2], *args[2:])]
    before = len(pairs._PLANS)
    del variant
    gc.collect()
    assert len(pairs._PLANS) == before - 1


@pytest.mark.parametrize("seq, block", [(1024, (64, 64)), (1000, (64, 64)), (768, (128, 64))])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "balanced"])
@pytest.mark.parametrize("name", ["causal", "sliding_window", "document"])
def test_allgather_block_mask_is_the_mapped_mask_s(name, layout, seq, block):
    """The all-gather's block mask lives in its local index space (this shard's rows, the
    gathered keys): the variant's block rule is applied at the global positions of each block,
    giving create_block_mask's blocks on the mapped callbacks where chunks are whole blocks, and
    where a block straddles two chunks, a partial block (evaluated exactly) instead."""
    from torch.nn.attention.flex_attention import create_block_mask

    from attngym import kernels
    from attngym.distributed.placement import layout as layouts
    from attngym.distributed.placement.positions import at_positions
    from attngym.distributed.schemes.allgather import key_positions, whole_plan

    P = 2
    params = {"sliding_window": {"window_size": 100}, "document": {"doc_lengths": [300, seq - 300]}}
    variant = variants.get(name, **params.get(name, {}))
    plan = layouts.resolve(layout, P, seq, variant, "cpu")
    aligned = all(start % b == 0 and length % b == 0
                  for r in range(P) for start, length in plan.chunks(r) for b in block)  # fmt: skip
    whole = whole_plan(P, seq // P)
    for rank in range(P):
        kv_positions = key_positions(plan, rank, whole, "cpu")
        mapped = at_positions(variant, plan.positions(rank), kv_positions, "cpu", "mapped")
        got = kernels.make_block_mask(mapped, seq // P, seq, block_size=block)
        want = create_block_mask(mapped.mask_mod, None, None, seq // P, seq, device="cpu",
                                 BLOCK_SIZE=block)  # fmt: skip
        kept, want_kept = got.to_dense().bool(), want.to_dense().bool()
        assert not (want_kept & ~kept).any(), rank  # never a block skipped that has a kept entry
        full = _full_blocks(got)
        assert not (full & ~_full_blocks(want)).any(), rank  # never full where some are masked
        if aligned:
            assert torch.equal(kept, want_kept) and torch.equal(full, _full_blocks(want)), rank


def _full_blocks(block_mask) -> torch.Tensor:
    """(q blocks, kv blocks) bool: the blocks a BlockMask lists as full."""
    num, idx = block_mask.full_kv_num_blocks[0, 0], block_mask.full_kv_indices[0, 0]
    dense = torch.zeros(idx.shape[0], idx.shape[1], dtype=torch.bool)
    for row, n in enumerate(num.tolist()):
        dense[row, idx[row, :n].long()] = True
    return dense


def test_gathers_backward_refuses_a_cuda_graph_capture_over_gloo(monkeypatch):
    """Two ranks sharing a GPU run gloo, whose all-reduce of CUDA tensors cannot be captured: the
    all-gather's backward says so in words instead of an invalidated capture."""
    from types import SimpleNamespace

    from attngym.distributed.transport.copy_engine import CopyEngineAllGather

    gather = SimpleNamespace(
        out_shape=(1, 2, 8), world_size=2, num_parts=1, _rows=2, _chunk=4, rank=0,
        part_shape=(2, 4), group=None,
    )  # fmt: skip
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="gloo.*CUDA graph cannot capture.*nccl"):
        CopyEngineAllGather.reduce_scatter(gather, torch.randn(1, 2, 8))
