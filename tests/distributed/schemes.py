"""A context-parallel scheme that lives only in the tests, stated whole as a TopologySpec from
attngym's public pieces: its function, and how its ranks are simulated and priced. It proves
that a topology is one object (tests/distributed/test_custom_scheme.py registers it beside the
built-ins, and names it by path as topology.scheme)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from attngym.distributed import all_gather, attend_chunk, merge, plan
from attngym.distributed.model.simulate import (
    Item,
    SequenceRanks,
    SimulatedCall,
    Simulation,
    nbytes,
)
from attngym.distributed.model.transfer_model import Fabric, Prediction, RankWork, predict
from attngym.distributed.placement.layout import LAYOUTS
from attngym.distributed.schemes.spec import TopologySpec


def pairwise(q, k, v, variant, *, group, layout, options=None, transport="auto", **kwargs):
    """Gather the K/V, then attend this rank's shard to each rank's shard apart and merge. As a
    TopologySpec's function it gets the layout as the built-ins do (a name for contiguous and
    zigzag): `plan` makes it a Layout."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    layout = plan(layout, world, world * q.shape[2])
    kv = all_gather([k, v], group=group, transport=transport)
    n, row, outs = q.shape[2], 0, []
    for q_offset, q_len in layout.chunks(rank):
        pieces = []
        for p in range(world):
            at = p * n
            for offset, length in layout.chunks(p):
                pieces.append(
                    attend_chunk(q[:, :, row : row + q_len], kv[0][:, :, at : at + length],
                                 kv[1][:, :, at : at + length], variant, q_offset=q_offset,
                                 kv_offset=offset, options=options)
                )  # fmt: skip
                at += length
        outs.append(merge([o for o, _ in pieces], [lse for _, lse in pieces])[0])
        row += q_len
    return torch.cat(outs, dim=2)


def simulate_pairwise(sc: SimulatedCall) -> Simulation:
    """Each rank's calls (timed once per rank shape) and the whole shards it receives."""
    ranks = SequenceRanks(sc)
    works = []
    for r in range(sc.world_size):
        q_r, k_all, v_all = ranks.qs[r], torch.cat(ranks.ks, 2), torch.cat(ranks.vs, 2)

        def fwd(q_r=q_r, k_all=k_all, v_all=v_all):
            with torch.no_grad():
                attend_chunk(q_r, k_all, v_all, sc.variant, options=sc.options)

        ms = sc.clock.ms(Item(key=("pairwise", tuple(q_r.shape)), fwd=fwd, bwd=None), "fwd")
        got = nbytes(2, *ranks.ks[r].shape, itemsize=q_r.element_size()) * (sc.world_size - 1)
        works.append(RankWork(fwd_ms=(ms,), fwd_bytes=(got,)))
    sim = ranks.simulation(works)
    sim.bytes_moved = max(w.fwd_bytes[0] for w in works)
    return sim


def pairwise_rank_ms(work: RankWork, fab: Fabric, backward: bool) -> float:
    """The gather, then the calls (a forward-only prediction)."""
    return fab.ms("allgather", work.fwd_bytes[0]) + work.compute_fwd_ms


def price_pairwise(sim: Simulation, fab: Fabric, backward: bool) -> Prediction:
    return predict(pairwise_rank_ms, sim.ranks, fab, backward)


PAIRWISE = TopologySpec(
    name="pairwise",
    attention=pairwise,
    layouts=LAYOUTS,
    user_layouts=True,
    simulate=simulate_pairwise,
    price=price_pairwise,
)
