"""Balancers a user might write, named by import path in tests/distributed/test_balancer.py
(topology.layout=module.function): good ones, and one for each way a placement can be wrong.

Each returns, per rank, a list of (global offset, length) chunks.
"""

from __future__ import annotations

# Every call of by_document_work, by variant name: the layout calls a balancer once per variant.
CALLS: list[str] = []
# What takes_everything was given, by keyword.
SEEN: dict = {}


def _contiguous(seq_len: int, world_size: int) -> list[list[tuple[int, int]]]:
    share = seq_len // world_size
    return [[(r * share, share)] for r in range(world_size)]


def _greedy(work: list[float], world_size: int) -> list[list[int]]:
    """Piece indices per rank: the heaviest piece first, to the lightest rank with room."""
    room = len(work) // world_size
    load, owned = [0.0] * world_size, [[] for _ in range(world_size)]
    for i in sorted(range(len(work)), key=lambda i: -work[i]):
        r = min((r for r in range(world_size) if len(owned[r]) < room), key=lambda r: load[r])
        owned[r].append(i)
        load[r] += work[i]
    return [sorted(o) for o in owned]


def by_document_work(variant, world_size, seq_len):
    """Packed causal documents: 4P equal pieces, each weighed by the keys its queries read inside
    their document (from the variant's doc_lengths), placed greedily."""
    CALLS.append(variant.name)
    starts, start = [], 0
    for length in variant.params["doc_lengths"]:
        starts += [start] * length
        start += length
    size = seq_len // (4 * world_size)
    work = [sum(p - starts[p] + 1 for p in range(i, i + size)) for i in range(0, seq_len, size)]
    return [[(i * size, size) for i in o] for o in _greedy(work, world_size)]


def by_block_rows(block_mask, block_size, world_size, seq_len):
    """Query block rows weighed by the key blocks the whole sequence's block mask keeps."""
    kept = block_mask.kv_num_blocks[0, 0]
    if block_mask.full_kv_num_blocks is not None:
        kept = kept + block_mask.full_kv_num_blocks[0, 0]
    rows = block_size[0]
    return [[(i * rows, rows) for i in o] for o in _greedy(kept.tolist(), world_size)]


def with_an_option(seq_len, world_size, *extra, reverse=True):
    """Contiguous shards, the last rank first: a parameter with a default is the balancer's own."""
    placed = _contiguous(seq_len, world_size)
    return placed[::-1] if reverse else placed


def takes_everything(**kwargs):
    SEEN.clear()
    SEEN.update(kwargs)
    return _contiguous(kwargs["seq_len"], kwargs["world_size"])


def drops_the_last_position(seq_len, world_size):
    placed = _contiguous(seq_len, world_size)
    offset, length = placed[-1][0]
    placed[-1] = [(offset, length - 1)]
    return placed


def doubles_the_first_position(seq_len, world_size):
    placed = _contiguous(seq_len, world_size)
    placed[-1].append((0, 1))
    return placed


def uneven_ranks(seq_len, world_size):
    """Every position once, but rank 0 one longer and rank 1 one shorter."""
    share = seq_len // world_size
    placed = _contiguous(seq_len, world_size)
    placed[0], placed[1] = [(0, share + 1)], [(share + 1, share - 1)]
    return placed


def returns_a_dict(world_size, seq_len):
    return dict(enumerate(_contiguous(seq_len, world_size)))


def one_rank_short(world_size, seq_len):
    return _contiguous(seq_len, world_size)[1:]


def float_offsets(world_size, seq_len):
    return [[(float(o), n) for o, n in rank] for rank in _contiguous(seq_len, world_size)]


def negative_offset(world_size, seq_len):
    placed = _contiguous(seq_len, world_size)
    placed[0] = [(-1, 1), *placed[0]]
    return placed


def empty_chunk(world_size, seq_len):
    placed = _contiguous(seq_len, world_size)
    placed[1] = [(5, 0), *placed[1]]
    return placed


def past_the_end(world_size, seq_len):
    placed = _contiguous(seq_len, world_size)
    offset, length = placed[-1][0]
    placed[-1] = [(offset + 1, length)]
    return placed


def needs_heads(variant, heads):
    return _contiguous(variant.seq_len, heads)


def raises(world_size):
    raise RuntimeError(f"no placement for {world_size} ranks")


NOT_A_FUNCTION = 42
