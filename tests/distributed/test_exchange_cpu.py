"""The uneven exchange on CPU ranks (gloo): each rank receives exactly what each peer sends it,
sources in rank order; the inverse sends it back; wrong sizes are named. Payloads carry their
(source, destination, index) in their values, so every comparison is exact."""

from __future__ import annotations

import pytest
import torch

from attngym.distributed.ranks.launch import launch
from attngym.distributed.transport.p2p import P2PExchange

# sizes[src][dst]: elements src sends dst; a rank that sends nothing, one that receives nothing.
SIZES = ((0, 5, 0), (3, 0, 0), (7, 1, 0))


def _payload(src: int, dst: int, n: int) -> torch.Tensor:
    return 1000.0 * src + 100.0 * dst + torch.arange(n, dtype=torch.float64)


def _worker(rank, world_size):
    """Every rank's checks, gathered: (rank, round, output exact, inverse exact)."""
    import torch.distributed as dist

    ex = P2PExchange(SIZES, dtype=torch.float64, device="cpu", timeout_s=30)
    want = torch.cat([_payload(src, rank, SIZES[src][rank]) for src in range(world_size)])
    checks = []
    for round_ in range(2):  # the object is reused
        send = torch.cat([_payload(rank, dst, SIZES[rank][dst]) for dst in range(world_size)])
        out = ex.exchange(send)
        back = ex.inverse().exchange(out)
        checks.append((rank, round_, torch.equal(out, want), torch.equal(back, send)))
    every = [None] * world_size
    dist.all_gather_object(every, checks)
    return [c for rank_checks in every for c in rank_checks]


def test_exchange_delivers_every_block_and_its_inverse_sends_it_back():
    checks = launch(_worker, 3, timeout_s=120)
    assert len(checks) == 6
    for rank, round_, out_ok, back_ok in checks:
        assert out_ok and back_ok, (rank, round_, out_ok, back_ok)


def _bad_sizes_worker(rank, world_size):
    messages = []
    for sizes in (((0, 1), (1, 0), (0, 0)), ((1, 1), (1, 0)), ((0, -1), (1, 0))):
        with pytest.raises(ValueError) as err:
            P2PExchange(sizes, dtype=torch.float32, device="cpu")
        messages.append(str(err.value))
    return messages


def test_bad_sizes_are_named():
    messages = launch(_bad_sizes_worker, 2, timeout_s=60)
    assert messages[0].startswith("sizes: expected 2 rows of 2 non-negative ints")
    assert messages[1] == "sizes: a rank sends nothing to itself (sizes[p][p] must be 0)"
    assert messages[2].startswith("sizes: expected 2 rows of 2 non-negative ints")
