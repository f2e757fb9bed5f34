"""A user's balancer by import path (topology.layout=module.function), and `balanced` against the
fixed layouts on the cost model it places by, in one process."""

from __future__ import annotations

import pytest
import torch

from attngym import variants
from attngym.distributed import shard, unshard
from attngym.distributed.placement import layout

from . import balancers

MODULE = balancers.__name__  # as the tests import it (pytest puts tests/ on sys.path)

# A held-out case from review: packed documents where `balanced`, placed by piece prices alone,
# reported a block imbalance of 1.22 against zigzag's 1.19 and contiguous's 1.135.
HELD_OUT_DOCS = [700, 100, 300, 50, 386]


def _random_documents(rng, seq_len: int, count: int) -> list[int]:
    cuts = (torch.randperm(seq_len - 1, generator=rng)[: count - 1] + 1).sort().values.tolist()
    edges = [0, *cuts, seq_len]
    return [b - a for a, b in zip(edges, edges[1:], strict=False)]


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_users_balancer_shards_and_unshards_the_sequence(rng, world_size):
    S = 512
    docs = variants.get("document", doc_lengths=_random_documents(rng, S, 5))
    path = f"{MODULE}.by_document_work"
    x = torch.randn(2, 3, S, 4, generator=rng)
    shards = [shard(x, r, world_size, path, variant=docs) for r in range(world_size)]
    placed = layout.plan(path, world_size, S, docs)
    assert placed.name == path
    for r, s in enumerate(shards):
        assert torch.equal(s, x.index_select(2, placed.positions(r)))
    assert torch.equal(unshard(shards, path, variant=docs), x)
    # The pieces it placed side by side on a rank are one chunk.
    for r in range(world_size):
        chunks = placed.chunks(r)
        assert all(a + n != b for (a, n), (b, _) in zip(chunks, chunks[1:], strict=False))


def test_a_balancer_that_reads_the_block_mask_gets_the_whole_sequences():
    # Causal at S = 1024: 8 block rows keeping 1..8 blocks; greedily 8+5+4+1 and 7+6+3+2.
    causal = variants.get("causal")
    path = f"{MODULE}.by_block_rows"
    placed = layout.plan(path, 2, 1024, causal)
    assert placed.placement == (((0, 128), (384, 256), (896, 128)), ((128, 256), (640, 256)))
    assert layout.load_imbalance(path, causal, 2, 1024) == 1.0


def test_a_balancer_with_kwargs_gets_every_argument_and_one_with_its_own_option_is_accepted():
    docs = variants.get("document", doc_lengths=[40, 24])
    placed = layout.plan(f"{MODULE}.takes_everything", 2, 64, docs, block_size=[16, 8])
    seen = balancers.SEEN
    assert set(seen) == set(layout.BALANCER_ARGUMENTS)
    assert seen["variant"] is docs and (seen["seq_len"], seen["world_size"]) == (64, 2)
    assert seen["block_size"] == (16, 8) and seen["device"] == torch.device("cpu")
    assert seen["block_mask"].BLOCK_SIZE == (16, 8)
    assert seen["block_mask"].seq_lengths == (64, 64)
    assert placed.placement == (((0, 32),), ((32, 32),))
    layout.plan(f"{MODULE}.takes_everything", 2, 64, variants.get("full"))
    assert balancers.SEEN["block_mask"] is None  # a variant without a mask
    reverse = layout.plan(f"{MODULE}.with_an_option", 2, 64, docs)
    assert reverse.placement == (((32, 32),), ((0, 32),))


def test_a_balancer_is_called_once_per_variant():
    docs = variants.get("document", doc_lengths=[30, 34])
    path = f"{MODULE}.by_document_work"
    x = torch.randn(1, 1, 64, 2)
    before = len(balancers.CALLS)
    for rank in range(2):
        shard(x, rank, 2, path, variant=docs)
    layout.load_imbalance(path, docs, 2, 64)
    layout.time_imbalance(path, docs, 2, 64)
    assert len(balancers.CALLS) == before + 1
    layout.plan(path, 2, 64, variants.get("document", doc_lengths=[30, 34]))  # another variant
    assert len(balancers.CALLS) == before + 2


@pytest.mark.parametrize(
    "name, message",
    [
        ("drops_the_last_position", "puts position 63 in no chunk; every position must be held "
         "exactly once"),
        ("doubles_the_first_position", r"puts position 0 in 2 chunks \(rank 0 chunk 0, rank 1 "
         r"chunk 1\); every position"),
        ("uneven_ranks", r"gives rank 0 33, rank 1 31 positions; every rank must hold "
         r"seq_len/world_size = 32 \(the shards are tensors of one shape\)"),
        ("returns_a_dict", "returned a dict; a balancer returns one list of \\(offset, length\\) "
         "pairs per rank, 2 lists"),
        ("one_rank_short", "returned a list of 1 for world_size=2; a balancer returns one list "
         "per rank"),
        ("float_offsets", r"rank 0 chunk 0 is \(0.0, 32\), not two ints \(offset, length\)"),
        ("negative_offset", r"rank 0 chunk 0 \(-1, 1\) has a negative offset"),
        ("empty_chunk", r"rank 1 chunk 0 \(5, 0\) has length 0; a chunk holds at least one"),
        ("past_the_end", r"rank 1 chunk 0 \(33, 32\) ends at 65, past seq_len=64"),
        ("needs_heads", "requires parameter 'heads'; a balancer is called with the keywords it "
         "names out of variant, block_mask, seq_len, world_size, block_size, device"),
        ("raises", "raised RuntimeError: no placement for 2 ranks"),
        ("NOT_A_FUNCTION", r"is not callable \(int\)"),
    ],
)  # fmt: skip
def test_a_wrong_balancer_is_refused_in_one_line_naming_what_is_wrong(name, message):
    docs = variants.get("document", doc_lengths=[40, 24])
    path = f"{MODULE}.{name}"
    with pytest.raises(ValueError, match=message) as err:
        layout.plan(path, 2, 64, docs)
    assert str(err.value).startswith(f"layout: {path} ") and "\n" not in str(err.value)


def test_a_path_that_names_nothing_is_refused_with_the_closest_name():
    docs = variants.get("document", doc_lengths=[40, 24])
    with pytest.raises(ValueError, match="did you mean 'by_document_work'") as err:
        layout.plan(f"{MODULE}.by_document_wrok", 2, 64, docs)
    assert str(err.value).startswith("layout: ") and "by_document_wrok" in str(err.value)
    with pytest.raises(ValueError, match="layout: 'no_such_balancers.place': no module"):
        layout.plan("no_such_balancers.place", 2, 64, docs)
    with pytest.raises(ValueError, match="layout='x.place' is placed from the variant"):
        layout.plan("x.place", 2, 64)


def test_a_path_is_routed_apart_from_the_names_and_takes_any_seq_len_of_p_shards():
    for name in ("contiguous", "zigzag", "balanced", "zigzg", layout.plan("zigzag", 2, 8)):
        assert not layout.is_user_layout(name)
    assert layout.is_user_layout("mymod.place") and layout.is_user_layout("mymod:place")
    path = f"{MODULE}.by_document_work"
    assert layout.pieces(path, 3) == 3 and layout.pieces("balanced", 3) == 6
    layout.check_seq_len(30, 2, path)  # 2P = 4 does not divide 30: balanced would refuse it
    with pytest.raises(ValueError, match="seq_len=30 must be divisible by 4"):
        layout.check_seq_len(30, 2, "balanced")
    with pytest.raises(ValueError, match=r"seq_len=31 must be divisible by 2 .*\(P equal"):
        layout.check_seq_len(31, 2, path)


def _cases(rng):
    docs = _random_documents(rng, 1024, 6)
    return [
        ("held-out documents", variants.get("document", doc_lengths=HELD_OUT_DOCS), 1536),
        ("causal", variants.get("causal"), 1024),
        ("sliding_window", variants.get("sliding_window", window_size=300), 1024),
        (f"documents {docs}", variants.get("document", doc_lengths=docs), 1024),
        ("prefix_lm", variants.get("prefix_lm", prefix_length=333), 1024),
    ]


@pytest.mark.parametrize("world_size", [2, 4])
def test_balanced_is_never_predicted_more_imbalanced_than_zigzag_or_contiguous(rng, world_size):
    for what, variant, S in _cases(rng):
        imbalance = {
            name: layout.time_imbalance(name, variant, world_size, S)
            for name in ("balanced", "zigzag", "contiguous")
        }
        assert imbalance["balanced"] <= min(imbalance["zigzag"], imbalance["contiguous"]), (
            what,
            imbalance,
        )


def test_a_placement_of_whole_block_pieces_is_priced_as_the_sum_of_its_pieces(rng):
    """One call per rank over pieces of whole blocks: `balanced` prices its pieces once and a
    rank as their sum; the cost model pricing each rank's chunks as a whole agrees."""
    S, P = 4096, 4
    documents = variants.get("document", doc_lengths=_random_documents(rng, S, 9))
    window = variants.get("sliding_window", window_size=300)
    for what, variant in (("documents", documents), ("window", window)):
        model = layout._TimeModel(variant, S, (128, 128), "cpu")
        whole = [[(0, S)]]  # the whole sequence's blocks, read off the tiles when they are blocks
        read = layout._TimeModel(variant, S, (128, 128), "cpu").block_kinds(whole, whole)[:2]
        assert all(map(torch.equal, model.whole_block_kinds(), read)), what
        for pieces in (2 * P, 8 * P):
            size = S // pieces
            costs = layout._piece_costs(model, size)
            owned = layout._greedy(costs, P)
            placement = [[(i * size, size) for i in o] for o in owned]
            whole = model.rank_times(placement)
            summed = [sum(costs[i] for i in o) for o in owned]
            assert summed == pytest.approx(whole, rel=1e-12), (what, pieces)
        placed = layout.plan("balanced", P, S, variant)
        assert max(model.rank_times(placed.placement)) <= min(
            max(model.rank_times(layout.plan(name, P, S).placement))
            for name in ("zigzag", "contiguous")
        ), what


def test_held_out_documents_are_balanced_in_time_and_in_blocks():
    """The review's case: pieces of 192 tokens straddle the 128-token blocks, so every rank
    of the piece placement is slower than contiguous's halves; balanced keeps contiguous (named
    balanced, as asked) at 1.06 predicted time and 1.135 block imbalance (zigzag: 1.21, 1.19)."""
    docs = variants.get("document", doc_lengths=HELD_OUT_DOCS)
    S, P = 1536, 2
    placed = layout.plan("balanced", P, S, docs)
    assert placed.name == "balanced"
    assert placed.placement == layout.plan("contiguous", P, S).placement
    assert layout.time_imbalance(placed, docs, P, S) <= 1.15
    assert layout.load_imbalance(placed, docs, P, S) <= 1.15
    assert layout.time_imbalance("zigzag", docs, P, S) > 1.15


def test_both_imbalances_take_a_layout_a_name_or_a_path():
    docs = variants.get("document", doc_lengths=[40, 24])
    path = f"{MODULE}.with_an_option"
    placed = layout.plan(path, 2, 64, docs)
    for measure in (layout.load_imbalance, layout.time_imbalance):
        assert measure(path, docs, 2, 64, (8, 8)) == measure(placed, docs, 2, 64, (8, 8))
        assert measure("zigzag", docs, 2, 64, (8, 8)) == measure(
            layout.plan("zigzag", 2, 64), docs, 2, 64, (8, 8)
        )
