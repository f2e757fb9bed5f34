"""Layouts and the LSE merge, in one process (no ranks needed)."""

from __future__ import annotations

import pytest
import torch

from attngym import reference, variants
from attngym.distributed import merge, shard, unshard
from attngym.distributed.placement import layout


@pytest.mark.parametrize("name", ["contiguous", "zigzag", "balanced"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_shard_unshard_round_trip(rng, name, world_size):
    x = torch.randn(2, 3, 24, 5, generator=rng)
    variant = variants.get("document", doc_lengths=[3, 15, 6])
    shards = [shard(x, r, world_size, name, variant=variant) for r in range(world_size)]
    assert all(s.shape == (2, 3, 24 // world_size, 5) for s in shards)
    assert torch.equal(unshard(shards, name, variant=variant), x)


def _loads(placement, variant, seq_len, block):
    """Non-empty (block x block) pairs per rank, counted from the dense mask (independent of
    the layout's cost model)."""
    pos = torch.arange(seq_len)
    keep = reference.dense_mask(variant.mask_mod, 1, 1, pos, pos)[0, 0]
    nb = seq_len // block
    blocks = keep.view(nb, block, nb, block).any(3).any(1)
    return [
        sum(int(blocks[o // block : (o + n) // block].sum()) for o, n in placement.chunks(r))
        for r in range(placement.world_size)
    ]


def test_balanced_layout_evens_out_non_empty_blocks():
    # Causal, P = 2, S = 64 at 8-token blocks: contiguous gives rank 1 three times rank 0's
    # blocks (max/mean 1.5 with 8 x 8 blocks: 10 vs 26); zigzag and balanced are even.
    causal = variants.get("causal")
    S, P, block = 64, 2, (8, 8)
    contiguous = layout.plan("contiguous", P, S)
    assert _loads(contiguous, causal, S, 8) == [10, 26]
    assert layout.load_imbalance("contiguous", causal, P, S, block) == pytest.approx(26 / 18)
    assert layout.load_imbalance("zigzag", causal, P, S, block) == pytest.approx(1.0)
    balanced = layout.plan("balanced", P, S, causal, block)
    assert len(set(_loads(balanced, causal, S, 8))) == 1
    # Packed documents of unequal length: balanced beats zigzag, which ignores the documents.
    docs = variants.get("document", doc_lengths=[40, 8, 8, 8])
    zig = layout.load_imbalance("zigzag", docs, P, S, block)
    bal = layout.load_imbalance("balanced", docs, P, S, block)
    loads = _loads(layout.plan("balanced", P, S, docs, block), docs, S, 8)
    assert bal == pytest.approx(max(loads) / (sum(loads) / P))
    assert zig > 1.05 and bal < zig and bal <= 1.05, (zig, bal)
    # Every rank still holds S/P tokens, each position once.
    covered = sorted(
        p
        for r in range(P)
        for p in layout.plan("balanced", P, S, docs, block).positions(r).tolist()
    )
    assert covered == list(range(S))


def _block_price(keep, block_q, block_kv):
    """(rows, cols) float64 block times of one kernel over the dense `keep`, blocks cut from its
    first row and column (the last ones may be short), at layout.BLOCK_COSTS."""
    full_cost, partial_cost = layout.BLOCK_COSTS
    rows = [r.split(block_kv, dim=1) for r in keep.split(block_q, dim=0)]
    return torch.tensor(
        [[full_cost if b.all() else partial_cost if b.any() else 0.0 for b in r] for r in rows],
        dtype=torch.float64,
    )


def _predicted(placed, variant, block_size, kernels=None):
    """Each rank's predicted time from the dense mask, written apart from layout._TimeModel: one
    call per rank (its shard's rows in order against every key), or one kernel per chunk pair
    or per shard pair (PairKernels.shards) priced as PairKernels says."""
    S = placed.seq_len
    keys = torch.arange(S)
    times = []
    for r in range(placed.world_size):
        if kernels is None:
            keep = reference.dense_mask(variant.mask_mod, 1, 1, placed.positions(r), keys)[0, 0]
            times.append(float(_block_price(keep, *block_size).sum()))
            continue
        total = 0.0
        if kernels.shards:  # every ring step: spread, part of its longest row and column, fixed
            for kv_rank in range(placed.world_size):
                keep = reference.dense_mask(
                    variant.mask_mod, 1, 1, placed.positions(r), placed.positions(kv_rank)
                )[0, 0]
                price = _block_price(keep, *block_size)
                row_tail, col_tail = layout.STEP_TAIL
                total += float(
                    price.sum() * kernels.programs / kernels.slots
                    + row_tail * price.sum(1).max()
                    + col_tail * price.sum(0).max()
                    + kernels.launch
                )
            times.append(total)
            continue
        for qo, qn in placed.chunks(r):
            for kv_rank in range(placed.world_size):
                for ko, kn in placed.chunks(kv_rank):
                    q_pos, kv_pos = torch.arange(qo, qo + qn), torch.arange(ko, ko + kn)
                    keep = reference.dense_mask(variant.mask_mod, 1, 1, q_pos, kv_pos)[0, 0]
                    price = _block_price(keep, *block_size)
                    if price.sum() > 0:
                        longest = max(price.sum(1).max(), price.sum(0).max())
                        waves = price.sum() * kernels.programs / kernels.slots
                        total += float(max(waves, longest)) + kernels.launch
        times.append(total)
    return times


# Pair kernels per chunk pair, and per shard pair (a ring step), on a device of 2 slots.
PRICINGS = (
    layout.PairKernels(programs=3, slots=2),
    layout.PairKernels(programs=3, slots=2, launch=layout.STEP_LAUNCH, shards=True),
)


@pytest.mark.parametrize("block_size", [(8, 8), (8, 4)])
def test_time_imbalance_is_each_ranks_predicted_time_from_the_dense_mask(rng, block_size):
    """Chunks of 12 tokens straddle the 8-token blocks: a block is full only where all its
    entries are kept, and the ring's kernels cut blocks from each chunk's start."""
    docs = variants.get("document", doc_lengths=_document_lengths(rng, 48, 3))
    placed = layout.Layout("mine", 2, 48, (((0, 12), (36, 12)), ((12, 24),)))
    for kernels in (None, *PRICINGS):
        times = _predicted(placed, docs, block_size, kernels)
        got = layout.time_imbalance(placed, docs, 2, 48, block_size, kernels=kernels)
        assert got == pytest.approx(max(times) / (sum(times) / 2), rel=1e-12), (kernels, times)
    # Balanced places by that price: its slowest rank is no slower than zigzag's or contiguous's.
    for kernels in (None, *PRICINGS):
        slowest = {
            name: max(
                _predicted(
                    layout.plan(name, 2, 48, docs, block_size, kernels=kernels),
                    docs,
                    block_size,
                    kernels,
                )
            )  # fmt: skip
            for name in ("balanced", "zigzag", "contiguous")
        }
        assert slowest["balanced"] <= min(slowest["zigzag"], slowest["contiguous"]), slowest


def test_swap_search_prices_pieces_as_the_model_does_and_makes_the_slowest_rank_faster(rng):
    """The ring's placement search prices a swap from per-piece sums: the same times as the
    cost model on every placement it visits (a round's swaps priced together as each alone),
    and a slowest rank no slower than greedy's."""
    S, P, piece = 256, 4, 16
    docs = variants.get("document", doc_lengths=_document_lengths(rng, S, 5))
    kernels = PRICINGS[1]
    model = layout._TimeModel(docs, S, (8, 8), "cpu", kernels)
    prices = layout._ShardPairPrices(model, piece)
    n = S // piece
    for _ in range(5):
        owner = torch.randperm(n, generator=rng) % P
        placement = [[(i * piece, piece) for i in (owner == r).nonzero()[:, 0].tolist()]
                     for r in range(P)]  # fmt: skip
        expected = model.rank_times([layout._joined(c) for c in placement])
        assert prices.rank_times(owner, P).tolist() == pytest.approx(expected, rel=1e-12)
        # A round's swaps priced together, each from owner's sums: as each swapped placement.
        pairs = torch.tensor([(i, j) for i in range(n) for j in range(n) if owner[i] < owner[j]])
        together = prices.swapped_times(owner, P, pairs)
        for (i, j), times in zip(pairs.tolist(), together, strict=True):
            swapped = owner.clone()
            swapped[[i, j]] = owner[[j, i]]
            assert times.tolist() == pytest.approx(prices.rank_times(swapped, P).tolist(),
                                                   rel=1e-12)  # fmt: skip
    start = torch.arange(n) % P
    searched = layout._swapped(start, prices, P)
    assert torch.bincount(searched, minlength=P).tolist() == [n // P] * P  # pieces per rank
    assert prices.rank_times(searched, P).max() <= prices.rank_times(start, P).max()
    # The placement that search gives, priced by the model, beats zigzag's and contiguous's.
    plans = {name: layout.plan(name, P, S, docs, (8, 8), kernels=kernels)
             for name in ("balanced", "zigzag", "contiguous")}  # fmt: skip
    slowest = {name: max(model.rank_times(placed.placement)) for name, placed in plans.items()}
    assert slowest["balanced"] <= min(slowest["zigzag"], slowest["contiguous"]), slowest


def test_the_ring_prices_its_placement_per_step_call():
    """The ring's step is one call per shard pair: its balanced placement is priced so on CUDA
    (the SM count is the device's), by blocks elsewhere."""
    from attngym.distributed.schemes.topologies import TOPOLOGIES

    assert TOPOLOGIES["ring"].step_kernels and not TOPOLOGIES["allgather"].step_kernels
    assert TOPOLOGIES["ring"].kernel_pricing(8, "cpu") is None


def _document_lengths(rng, seq_len, count):
    cuts = (torch.randperm(seq_len - 1, generator=rng)[: count - 1] + 1).sort().values.tolist()
    edges = [0, *cuts, seq_len]
    return [b - a for a, b in zip(edges, edges[1:], strict=False)]


def test_balanced_layout_needs_the_variant_and_a_matching_plan():
    x = torch.randn(1, 1, 16, 2)
    with pytest.raises(ValueError, match="layout='balanced' is placed from the variant"):
        shard(x, 0, 2, "balanced")
    placed = layout.plan("zigzag", 2, 16)
    assert torch.equal(shard(x, 1, 2, placed), shard(x, 1, 2, "zigzag"))  # accepts a Layout
    with pytest.raises(ValueError, match="planned for world_size=2, seq_len=16"):
        shard(torch.randn(1, 1, 32, 2), 0, 2, placed)
    # Chunks of 6 tokens: counted at 2-token blocks (the gcd), where zigzag is exactly even.
    assert layout.load_imbalance("zigzag", variants.get("causal"), 2, 24, (8, 8)) == 1.0
    assert layout.load_imbalance("zigzag", variants.get("causal"), 2, 32, (8, 8)) == 1.0


def test_cp_options_reject_bad_values_by_name_and_accept_good_ones():
    from attngym.distributed import CPOptions
    from attngym.distributed.call.cp import options_from

    with pytest.raises(ValueError, match="backward.*'flexx'.*auto, flex, recompute"):
        CPOptions(backward="flexx")
    with pytest.raises(ValueError, match="block_size must be two positive ints"):
        CPOptions(block_size=(128,))
    with pytest.raises(ValueError, match="compile_mode"):
        CPOptions(compile_mode="fast")
    with pytest.raises(ValueError, match="timeout_s must be a positive"):
        CPOptions(timeout_s=0)
    with pytest.raises(TypeError, match="options must be a CPOptions"):
        options_from({"backward": "flex"})
    opts = options_from(CPOptions(backward="recompute"), block_size=[64, 32], scale=0.5)
    assert opts == CPOptions(backward="recompute", block_size=(64, 32), scale=0.5)


def test_zigzag_chunks_balance_causal_work():
    # S = 16, P = 2: 4 chunks of 4; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    assert layout.chunks(0, 2, 16, "zigzag") == [(0, 4), (12, 4)]
    assert layout.chunks(1, 2, 16, "zigzag") == [(4, 4), (8, 4)]
    assert layout.chunks(1, 4, 16, "contiguous") == [(4, 4)]
    x = torch.arange(16).view(1, 1, 16, 1)
    assert shard(x, 1, 2, "zigzag").flatten().tolist() == [4, 5, 6, 7, 8, 9, 10, 11]


def test_double_zigzag_is_a_zigzag_of_each_half_and_balances_causal_work(rng):
    # S = 32, P = 2: 8 chunks of 4; rank 0 holds the halves' chunks 0 and 3, rank 1 1 and 2
    assert layout.chunks(0, 2, 32, "double_zigzag") == [(0, 4), (12, 4), (16, 4), (28, 4)]
    assert layout.chunks(1, 2, 32, "double_zigzag") == [(4, 4), (8, 4), (20, 4), (24, 4)]
    x = torch.randn(1, 2, 48, 3, generator=rng)
    for world_size in (1, 2, 3, 4):
        shards = [shard(x, r, world_size, "double_zigzag") for r in range(world_size)]
        assert torch.equal(unshard(shards, "double_zigzag"), x)
    placed = layout.plan("double_zigzag", 4, 256)
    assert len(set(_loads(placed, variants.get("causal"), 256, 4))) == 1
    with pytest.raises(ValueError, match=r"divisible by 16 .* \(4P equal chunks\)"):
        layout.plan("double_zigzag", 4, 24)


def test_layout_rejects_bad_values_by_name():
    x = torch.randn(1, 1, 12, 2)
    with pytest.raises(
        ValueError,
        match=r"layout must be one of contiguous, zigzag, double_zigzag, balanced, documents or a "
        r"balancer's "
        r"import path \(module.function\); got 'zigzg'",
    ):
        shard(x, 0, 2, "zigzg")
    with pytest.raises(ValueError, match=r"seq_len=12 must be divisible by 8"):
        shard(x, 0, 4, "zigzag")
    with pytest.raises(ValueError, match="rank must be in"):
        layout.chunks(2, 2, 12, "contiguous")
    # Accepts the same length where it divides.
    assert shard(x, 0, 3, "zigzag").shape[2] == 4


def test_merge_of_key_splits_equals_whole_attention(rng):
    q = torch.randn(1, 2, 8, 4, generator=rng, dtype=torch.float64)
    k = torch.randn(1, 2, 12, 4, generator=rng, dtype=torch.float64)
    v = torch.randn(1, 2, 12, 4, generator=rng, dtype=torch.float64)
    causal = variants.get("causal").mask_mod
    pos = torch.arange(12)
    ref_out, ref_lse = reference.attention(q, k, v, None, causal, q_positions=pos[:8])
    parts = [
        reference.attention(
            q, k[:, :, s], v[:, :, s], None, causal, q_positions=pos[:8], kv_positions=pos[s]
        )
        for s in (slice(0, 3), slice(3, 9), slice(9, 12))  # the last split is empty for every row
    ]
    out, lse = merge([p[0] for p in parts], [p[1] for p in parts])
    # float64 throughout: only rounding of a few exp/log differs (1e-12 is ~1e4 ulp of O(1)).
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-12)


def test_merge_keeps_empty_rows_zero_and_minus_inf(rng):
    out_a = torch.randn(1, 1, 3, 2, generator=rng)
    lse_a = torch.tensor([[[float("-inf"), 0.5, float("-inf")]]])
    out_b = torch.randn(1, 1, 3, 2, generator=rng)
    lse_b = torch.tensor([[[float("-inf"), float("-inf"), 1.0]]])
    out_a[0, 0, 0] = 7.0  # garbage under a -inf lse must not leak
    out, lse = merge([out_a, out_b], [lse_a, lse_b])
    assert not out.isnan().any()
    assert torch.equal(out[0, 0, 0], torch.zeros(2))
    assert torch.isneginf(lse[0, 0, 0])
    torch.testing.assert_close(out[0, 0, 1], out_a[0, 0, 1])
    torch.testing.assert_close(out[0, 0, 2], out_b[0, 0, 2])


def test_merge_is_differentiable(rng):
    outs = [torch.randn(1, 2, 3, 4, generator=rng, dtype=torch.float64) for _ in range(3)]
    lses = [torch.randn(1, 2, 3, generator=rng, dtype=torch.float64) for _ in range(3)]
    lses[1][0, 0, 1] = float("-inf")  # a row this partial did not see
    inputs = [t.requires_grad_() for t in outs + lses]

    def merged(*tensors):
        return merge(list(tensors[:3]), list(tensors[3:]))

    assert torch.autograd.gradcheck(merged, inputs)


def test_a_wait_that_fails_at_once_is_not_called_a_timeout():
    """A peer rank that ended makes gloo's wait fail at once: the message says so, not "timed
    out after 120 s"."""
    from attngym.distributed.transport.p2p import _wait
    from attngym.errors import RankFailure

    class Broken:
        def wait(self, timeout=None):
            raise RuntimeError("Connection closed by peer\nmore gloo detail")

    with pytest.raises(RankFailure) as err:
        _wait([Broken()], timeout_s=120, device=torch.device("cpu"), what="ring step 1")
    assert "failed after 0.0 s (a peer rank ended): Connection closed by peer" in str(err.value)
    assert "timed out" not in str(err.value) and "\n" not in str(err.value)
