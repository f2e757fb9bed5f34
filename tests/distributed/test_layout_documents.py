"""layout=documents: packed documents placed whole from their lengths, the long ones split head
and tail (attngym.distributed.placement.documents)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from attngym import variants
from attngym.distributed import shard, unshard
from attngym.distributed.placement import documents, layout
from attngym.errors import ConfigError
from attngym.runner.config import Settings, Shape, Topology


def _brute_prices(docs, unit, left, right):
    """Each block row's price from the dense mask, block by block (layout.BLOCK_COSTS)."""
    doc = torch.repeat_interleave(torch.arange(len(docs)), torch.tensor(docs))
    j = torch.arange(sum(docs))
    keep = doc[:, None] == doc[None, :]
    if left >= 0:
        keep &= j[None, :] >= j[:, None] - left
    if right >= 0:
        keep &= j[None, :] <= j[:, None] + right
    blocks = keep.view(len(j) // unit, unit, len(j) // unit, unit)
    some, every = blocks.any(3).any(1), blocks.all(3).all(1)
    full, partial = every.sum(1).double(), (some & ~every).sum(1).double()
    price = full * layout.BLOCK_COSTS[0] + partial * layout.BLOCK_COSTS[1]
    return torch.cat([price.new_zeros(1), price.cumsum(0)]).tolist()


def test_the_price_before_a_block_row_is_its_blocks_full_and_partial():
    rng = random.Random(0)
    for _ in range(200):
        unit = rng.choice([4, 8, 16])
        docs, left_to_fill = [], unit * rng.randint(1, 12)
        while left_to_fill:
            docs.append(min(left_to_fill, rng.randint(1, 3 * unit)))
            left_to_fill -= docs[-1]
        left, right = rng.choice([-1, 0, 1, 3, 10, 17]), rng.choice([-1, 0, 2, 7, 20])
        want = _brute_prices(docs, unit, left, right)
        got = documents.block_prices(docs, unit, left, right, layout.BLOCK_COSTS)
        assert got == pytest.approx(want), (docs, unit, left, right)


def _lognormal(rng, seq_len: int) -> list[int]:
    docs, left = [], seq_len
    while left:
        n = min(left, max(1, int(rng.lognormvariate(6.0, 1.2))))
        docs.append(n)
        left -= n
    return docs


def _owners(placement, seq_len):
    owner = [-1] * seq_len
    for r, chunks in enumerate(placement):
        for offset, n in chunks:
            for p in range(offset, offset + n):
                assert owner[p] == -1, f"position {p} placed twice"
                owner[p] = r
    return owner


@pytest.mark.parametrize(("world_size", "seq_len"), [(2, 2048), (4, 8192), (8, 16384)])
def test_every_position_is_placed_once_and_every_rank_holds_a_shard(world_size, seq_len):
    rng = random.Random(world_size)
    for left, right in ((-1, 0), (-1, -1), (256, 0)):
        docs = _lognormal(rng, seq_len)
        placement = documents.place(docs, world_size, left, right, layout.BLOCK_COSTS)
        owner = _owners(placement, seq_len)
        assert -1 not in owner
        for chunks in placement:
            assert sum(n for _, n in chunks) == seq_len // world_size
            assert list(chunks) == sorted(chunks)


def test_short_documents_stay_whole_and_a_long_one_is_split_head_and_tail():
    """Documents shorter than a shard: all but a few (one split per rank filled to its share,
    at most) on one rank each. A document of half the sequence: over the ranks as head-and-tail
    pairs, each rank's pair as long as the others'."""
    P, S = 4, 16384
    rng = random.Random(1)
    docs = [rng.choice([256, 512, 768]) for _ in range(40)]
    docs.append(S - sum(docs))
    owner = _owners(documents.place(docs, P, -1, 0, layout.BLOCK_COSTS), S)
    starts = list(itertools.accumulate(docs, initial=0))
    split = [d for d, (a, b) in enumerate(itertools.pairwise(starts)) if len(set(owner[a:b])) > 1]
    assert len(split) <= P - 1, split
    long = [S // 2, *[512] * 16]
    owner = _owners(documents.place(long, P, -1, 0, layout.BLOCK_COSTS), S)
    halves = [owner[i * S // 16 : (i + 1) * S // 16] for i in range(8)]  # 2k = 8 chunks of it
    assert all(len(set(h)) == 1 for h in halves)
    for j in range(4):  # chunk j and chunk 7 - j on one rank
        assert halves[j][0] == halves[7 - j][0]
    assert len({halves[j][0] for j in range(4)}) == 4


def test_a_batch_of_one_document_is_placed_as_zigzag():
    """One causal document is every rank's work: head and tail over all P ranks, zigzag's
    shards (the middle pair on rank 0)."""
    variant = variants.get("document", doc_lengths=[8192])
    for P in (2, 4, 8):
        placed, zigzag = layout.plan("documents", P, 8192, variant), layout.plan("zigzag", P, 8192)
        assert sorted(placed.positions(r).tolist() for r in range(P)) == sorted(
            zigzag.positions(r).tolist() for r in range(P)
        )


def test_shard_and_unshard_round_trip_on_the_documents_layout():
    variant = variants.get("document", doc_lengths=[300, 20, 500, 204])
    x = torch.randn(1, 2, 1024, 4)
    parts = [shard(x, r, 4, "documents", variant=variant) for r in range(4)]
    assert {p.shape[2] for p in parts} == {256}
    assert torch.equal(unshard(parts, "documents", variant=variant), x)
    # the same placement whatever block size asks for it (the CP call and shard agree)
    planned = layout.plan("documents", 4, 1024, variant, (64, 64))
    assert planned.placement == layout.plan("documents", 4, 1024, variant, (128, 128)).placement


@pytest.mark.parametrize("simulate", [False, True])
def test_a_variant_without_documents_is_refused_naming_the_key(tmp_path, simulate):
    from attngym import registry
    from attngym.runner.config import Benchmark

    settings = Settings(
        attention={"name": "causal"},
        device="cpu",
        shape=Shape(batch=1, heads=2, seq_len=512, head_dim=8),
        topology=Topology(kind="ring", world_size=2, layout="documents", simulate=simulate),
        benchmark=Benchmark(warmup=0, repeats=1),
        baselines=(),
    )
    with pytest.raises(ConfigError, match="topology.layout: documents places packed documents"):
        registry.get("task", "ring")(settings, tmp_path)
    # auto's candidates named by topology.options.layouts, before any candidate runs
    settings.topology = Topology(kind="auto", world_size=2, layout="auto", simulate=True,
                                 options={"layouts": ["zigzag", "documents"]})  # fmt: skip
    with pytest.raises(ConfigError, match="topology.options.layouts: documents places"):
        registry.get("task", "auto")(settings, tmp_path)
    assert not layout.applies("documents", variants.get("causal"))
    assert layout.applies("documents", variants.get("document", doc_lengths=[10, 22]))
