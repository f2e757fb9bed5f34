"""The all-to-all transport on CPU ranks (gloo twin): placement, orders, inverse, gradient.

The reference output is built here from the definition (piece j of the block rank r sends rank p
lands at piece concat_order[r][j] of p's output), independently of AllToAllPlan. The gradient is
checked through element identities: an all-to-all only moves elements, so feeding unique ids
shows where each input element lands, and its gradient must be the upstream gradient found there.
Everything is a copy, so every comparison is exact (torch.equal).
"""

from __future__ import annotations

import pytest
import torch

from attngym.distributed import P2PAllToAll
from attngym.distributed.ranks.launch import launch
from attngym.distributed.transport.parts import AllToAllPlan

# (part_shape, split_dim, concat_dim, split_order, concat_order) per world size
CASES = {
    2: [
        ((2, 4, 6, 3), 1, 2, None, None),  # Ulysses: heads split, sequence concatenated
        ((2, 2, 12, 3), 2, 1, None, None),  # and back
        ((4, 6, 5), 0, -1, None, None),
        ((1, 4, 8, 2), 1, 2, None, [[0, 3], [1, 2]]),  # zigzag shards into global order
        ((1, 2, 16, 2), 2, 1, [[0, 3], [1, 2]], None),  # global order back into zigzag shards
    ],
    3: [
        ((2, 6, 4, 3), 1, 2, None, None),
        ((1, 3, 8, 2), 1, 2, None, [[0, 5], [1, 4], [2, 3]]),
        ((1, 2, 18, 2), 2, 1, [[0, 5], [1, 4], [2, 3]], None),
    ],
}


def _pieces(t, dim, n):
    return list(t.chunk(n, dim=dim % t.dim()))


def _expected(inputs, p, split_dim, concat_dim, split_order, concat_order):
    """Rank p's output part from every rank's input part, straight from the definition."""
    world = len(inputs)
    s_order = split_order or [[q] for q in range(world)]
    c_order = concat_order or [[q] for q in range(world)]
    placed = {}
    for r, x in enumerate(inputs):
        split_pieces = _pieces(x, split_dim, world * len(s_order[0]))
        block = torch.cat([split_pieces[i] for i in s_order[p]], dim=split_dim)
        for j, piece in enumerate(_pieces(block, concat_dim, len(c_order[r]))):
            placed[c_order[r][j]] = piece
    return torch.cat([placed[i] for i in sorted(placed)], dim=concat_dim)


def _cases(rank, world_size, group):
    """Every case of CASES[world_size] on `group` (this rank's rank in it: `rank`)."""
    import torch.distributed as dist

    results = []
    for n, (shape, split_dim, concat_dim, s_order, c_order) in enumerate(CASES[world_size]):
        a2a = P2PAllToAll(
            shape,
            2,
            split_dim,
            concat_dim,
            dtype=torch.float64,
            device="cpu",
            split_order=s_order,
            concat_order=c_order,
            group=group,
            timeout_s=30,
        )
        for it in range(3):  # fresh data every call; the buffers are reused
            gens = [
                torch.Generator().manual_seed(1000 * n + 10 * it + r) for r in range(world_size)
            ]
            inputs = [
                [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(2)]
                for g in gens
            ]
            out = a2a(inputs[rank])
            want = torch.stack(
                [
                    _expected([x[k] for x in inputs], rank, split_dim, concat_dim, s_order, c_order)
                    for k in range(2)
                ]
            )
            results.append(
                (n, it, "forward", out.shape == a2a.out_shape and torch.equal(out, want))
            )
            back = a2a.inverse()(out)
            results.append((n, it, "inverse", torch.equal(back, torch.stack(inputs[rank]))))
        # Gradient = the inverse all-to-all of the upstream gradient, element by element.
        numel = 2 * torch.Size(shape).numel()
        ids = (torch.arange(numel, dtype=torch.float64) + rank * numel).view(2, *shape)
        landed = a2a(ids)
        upstream = torch.randn(
            landed.shape, generator=torch.Generator().manual_seed(50 + rank), dtype=torch.float64
        )
        everyone = [None] * world_size
        dist.all_gather_object(everyone, (landed, upstream), group=group)
        grad_of_id = torch.empty(world_size * numel, dtype=torch.float64)
        for got, g in everyone:
            grad_of_id[got.long().view(-1)] = g.view(-1)
        x = [
            t.clone().requires_grad_()
            for t in torch.randn(2, *shape, dtype=torch.float64).unbind(0)
        ]
        (a2a(x) * upstream).sum().backward()
        want_grad = grad_of_id[ids.long().view(-1)].view(2, *shape)
        results.append((n, 0, "grad", all(torch.equal(x[k].grad, want_grad[k]) for k in range(2))))
    return results


def _worker(rank, world_size):
    """The 3-rank cases on the world, then the 2-rank cases on ranks 0 and 1 (one spawn)."""
    import torch.distributed as dist

    results = {3: _cases(rank, world_size, None)}
    pair = dist.new_group([0, 1])
    results[2] = _cases(rank, 2, pair) if rank < 2 else []
    dist.barrier()
    return results


def test_alltoall_places_orders_inverts_and_differentiates_at_2_and_3_ranks():
    results = launch(_worker, 3, timeout_s=90)
    for world_size in (2, 3):
        assert len(results[world_size]) == len(CASES[world_size]) * 7
        failed = [r[:3] for r in results[world_size] if not r[3]]
        assert failed == [], world_size


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"split_dim": 1, "concat_dim": 1}, "split_dim and concat_dim must differ"),
        ({"split_dim": 0, "concat_dim": 1}, r"part_shape\[0\] = 3 \(the split dim\)"),
        ({"split_dim": 4, "concat_dim": 1}, "dim: expected an int"),
        ({"concat_order": [[0], [0]]}, "concat_order: the piece indices must cover"),
        ({"split_order": [[0, 1]]}, "split_order: expected 2 sequences"),
        ({"concat_order": [[0, 3], [1, 2]]}, r"part_shape\[2\] = 5 \(the concat dim\)"),
    ],
)
def test_plan_rejects_bad_arguments(kwargs, match):
    args = {"split_dim": 1, "concat_dim": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        AllToAllPlan.build((3, 4, 5), 2, **args)


def test_plan_accepts_and_inverts():
    plan = AllToAllPlan.build((1, 4, 8, 2), 2, 1, 2, None, [[0, 3], [1, 2]])
    assert plan.out_shape == (1, 2, 16, 2)
    inv = plan.inverse()
    assert (inv.part_shape, inv.split_dim, inv.concat_dim) == ((1, 2, 16, 2), 2, 1)
    assert inv.split_order == ((0, 3), (1, 2)) and inv.inverse() == plan
