"""Simulated ranks (attngym.distributed.model.simulate, topology.simulate=true) and the transfer
model.

The simulation at P=2 must do the real 2-rank run's work (same pairs computed and skipped, same
bytes moved: the real run's metrics, on gloo ranks); the model's arithmetic is checked on
hand-made numbers; identical work is timed once; layout=balanced evens predicted time.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from attngym import registry, variants
from attngym.distributed import CPOptions
from attngym.distributed.model import transfer_model as tm
from attngym.distributed.model.simulate import ItemTime, simulate
from attngym.distributed.placement import layout as layouts
from attngym.distributed.schemes.allgather import gather_rank_ms
from attngym.distributed.schemes.hybrid import HYBRID, price_hybrid
from attngym.distributed.schemes.ring import RING, ring_rank_ms
from attngym.distributed.schemes.ulysses import alltoall_rank_ms
from attngym.inputs import make_inputs
from attngym.runner.config import Benchmark, Settings, Shape, Topology

ROOT = Path(__file__).resolve().parents[2]


def _settings(simulate: bool, kind: str, layout: str, attention: dict, options=None) -> Settings:
    return Settings(
        attention=attention,
        device="cpu",
        shape=Shape(batch=1, heads=2, seq_len=512, head_dim=8),
        topology=Topology(
            kind=kind, world_size=2, layout=layout, simulate=simulate, options=options or {}
        ),  # fmt: skip
        benchmark=Benchmark(warmup=0, repeats=1),
        baselines=(),
        validate=False,
        passes=("fwd",),  # the work counted (pairs, bytes) is the forward's
    )


@pytest.mark.parametrize(
    ("kind", "layout", "attention", "options"),
    [
        ("ring", "zigzag", {"name": "causal"}, None),
        ("allgather", "contiguous", {"name": "sliding_window", "window_size": 64}, None),  # halo
        ("ulysses", "zigzag", {"name": "causal"}, None),
        ("ulysses", "zigzag", {"name": "full"}, {"pipeline": True}),  # later rounds' keys too
        ("ulysses", "double_zigzag", {"name": "causal"}, {"pipeline": True}),  # four rounds
    ],
)
def test_two_simulated_ranks_do_the_real_two_rank_work(tmp_path, kind, layout, attention,
                                                       options):  # fmt: skip
    task = registry.get("task", kind)
    for name in ("real", "sim"):
        (tmp_path / name).mkdir()
    real = task(_settings(False, kind, layout, attention, options), tmp_path / "real")
    simulated = task(_settings(True, kind, layout, attention, options), tmp_path / "sim")
    for key in ("pairs_computed", "pairs_skipped", "bytes_moved", "load_imbalance"):
        assert simulated[key] == real[key], key
    assert simulated["simulate"] is True and simulated["fabric"] == "h200_nvlink/copy_engine"
    assert simulated["predicted_fwd_ms"] > 0 and simulated["predicted_fwd_bwd_ms"] is None
    # On a CPU no scaling is predicted (its compute on a GPU fabric), and the run says why
    assert simulated["single_fwd_ms"] > 0 and simulated["predicted_efficiency"] is None
    assert simulated["bottleneck"] is None
    assert simulated["prediction_refused"].startswith("device cpu is not the fabric's")
    assert simulated["sim_timed"] <= simulated["sim_items"]
    from attngym.metrics import metric_of

    assert [key for key in simulated if metric_of(key) is None] == []  # every key has a row


def _counting_timer(calls: list):
    def timer(item, which):
        calls.append((which, item.key))
        return ItemTime(1.0)

    return timer


def test_overlapped_allgather_simulates_its_two_calls_and_hides_the_exchange():
    """Documents at P=4 (a rank reads more than a shard): with overlap each rank times its own
    keys' call and the received rows' apart, and its prediction hides the exchange behind the
    own keys' call; a contiguous window's halo (less than a shard) is not split by default."""
    from attngym.distributed.schemes.allgather import ALLGATHER

    q, k, v, g = make_inputs(Shape(batch=1, heads=2, seq_len=1024, head_dim=8), 0, "cpu",
                             torch.float32)  # fmt: skip
    docs = variants.get("document", doc_lengths=[640, 128, 256])
    slow = tm.linear_fabric("toy", "test", gbps=0.01, latency_us=0.0)  # transfers dominate
    got = {}
    for overlap in (None, True, False):
        sim = simulate(ALLGATHER, q, k, v, g, docs, world_size=4, layout="contiguous",
                       scheme_options={"overlap": overlap}, timer=_counting_timer([]))  # fmt: skip
        got[overlap] = sim
    # Ranks 0 and 3 receive nothing (documents start there); rank 2 reads 2 shards back.
    assert [len(w.fwd_ms) for w in got[True].ranks] == [1, 2, 2, 1]
    assert [len(w.fwd_ms) for w in got[None].ranks] == [1, 2, 2, 1]
    assert all(len(w.fwd_ms) == 1 for w in got[False].ranks)
    split, whole = (ALLGATHER.price(got[o], slow, True) for o in (True, False))
    exposed = [p.rank_ms[2] - p.rank_compute_ms[2] for p in (split, whole)]
    # rank 2's exchange is exposed less by the own keys' calls, 1 ms each way with this timer
    assert exposed[0] == pytest.approx(exposed[1] - 2.0) and exposed[1] > 2.0
    window = variants.get("sliding_window", window_size=64)
    sim = simulate(ALLGATHER, q, k, v, g, window, world_size=4, layout="contiguous",
                   timer=_counting_timer([]))  # fmt: skip
    assert all(len(w.fwd_ms) == 1 for w in sim.ranks)
    # The default's other way is named for topology=auto, where a rank's rows are exchanged;
    # not once an overlap is given, nor where whole shards are gathered (causal).
    assert sim.extra["alternatives"] == [{"overlap": True}]
    assert got[None].extra["alternatives"] == [{"overlap": False}]
    assert "alternatives" not in got[True].extra
    causal = simulate(ALLGATHER, q, k, v, g, variants.get("causal"), world_size=4,
                      layout="contiguous", timer=_counting_timer([]))  # fmt: skip
    assert "alternatives" not in causal.extra


def test_allgather_names_its_calls_unfolded_for_auto_where_it_folded_them(monkeypatch):
    """fold=None folds a call whose block rows' costs spread (on CUDA flex; here that rule
    stands in for the device check): rank 1 holds a long document's last two block rows among
    14 rows of short ones (one call a rank). auto is then offered the calls unfolded; not once
    fold is given."""
    from attngym.distributed.schemes import allgather

    def on_cuda(call, q, k, option):  # the rule's answer on CUDA flex
        return None if option is False else (*q.shape[:2], k.shape[1], option is True)

    monkeypatch.setattr(allgather, "_folding", on_cuda)
    q, k, v, g = make_inputs(Shape(batch=1, heads=2, seq_len=1024, head_dim=8), 0, "cpu",
                             torch.float32)  # fmt: skip
    docs = variants.get("document", doc_lengths=[288] + [16] * 46)
    alternatives = {}
    for fold in (None, False, True):
        sim = simulate(allgather.ALLGATHER, q, k, v, g, docs, world_size=4, layout="contiguous",
                       options=CPOptions(block_size=(16, 16)),
                       scheme_options={"fold": fold, "overlap": False},
                       timer=_counting_timer([]))  # fmt: skip
        alternatives[fold] = sim.extra.get("alternatives", [])
    assert {"fold": False} in alternatives[None]
    assert all("fold" not in a for a in alternatives[False] + alternatives[True])


def test_ulysses_in_rounds_hides_the_exchanges_behind_the_rounds_calls():
    """pipeline=True on zigzag: each rank's calls timed round by round (a causal mask: one call
    a round; full attention: round 0's queries read round 1's keys too), priced with each
    round's exchange behind the calls before it; the one-call Ulysses offers it to auto."""
    from attngym.distributed.schemes import ulysses_rounds as rounds
    from attngym.distributed.schemes.ulysses import ULYSSES

    q, k, v, g = make_inputs(Shape(batch=1, heads=4, seq_len=1024, head_dim=8), 0, "cpu",
                             torch.float32)  # fmt: skip
    slow = tm.linear_fabric("toy", "test", gbps=0.01, latency_us=0.0)  # transfers dominate
    sims = {}
    for name in ("causal", "full"):
        for pipeline in (False, True):
            sims[name, pipeline] = simulate(
                ULYSSES, q, k, v, g, variants.get(name), world_size=2, layout="zigzag",
                scheme_options={"pipeline": pipeline}, timer=_counting_timer([]),
            )  # fmt: skip
    causal, full = sims["causal", True].ranks[0], sims["full", True].ranks[0]
    # every call 1 ms (the timer): a round's calls forward, the last round's first backward
    assert (causal.fwd_ms, causal.bwd_ms, causal.out_ready) == ((1.0, 1.0), (1.0, 1.0), (0, 1))
    assert (full.fwd_ms, full.bwd_ms, full.out_ready) == ((1.0, 2.0), (1.0, 2.0), (1, 1))
    assert full.grads_ready == (0, 0)
    assert sims["causal", True].pairs_computed == 4 and sims["full", True].pairs_computed == 6
    assert sims["causal", False].extra["alternatives"] == [{"pipeline": True}]
    assert "alternatives" not in sims["causal", True].extra
    hybrid = simulate(HYBRID, q, k, v, g, variants.get("causal"), world_size=2, layout="zigzag",
                      scheme_options={"a2a_size": 2, "across": "ring"},
                      timer=_counting_timer([]))  # fmt: skip
    assert "alternatives" not in hybrid.extra  # one all-to-all group: Ulysses' calls, not options
    into = slow.ms("alltoall", causal.fwd_bytes[0] / 2)  # a round's q/k/v
    back = slow.ms("alltoall", causal.tail_fwd_bytes / 2)  # a round's output
    # One call: every byte in, the call (1 ms), every byte back. In rounds, on this fabric the
    # calls are hidden: round 0's beside round 1's exchange, round 1's beside round 0's output.
    one_call = ULYSSES.price(sims["causal", False], slow, False).fwd_ms
    assert one_call == pytest.approx(2 * into + 2 * back + 1.0)
    in_rounds = ULYSSES.price(sims["causal", True], slow, False).fwd_ms
    assert in_rounds == pytest.approx(2 * into + 2 * back)
    # by hand: arrivals 1, 2; calls end 3, 5; outputs leave once final and the fabric is free
    assert rounds._pipeline((2.0, 2.0), 1.0, 1.0, (0, 1)) == 6.0
    assert rounds._pipeline((2.0, 2.0), 1.0, 1.0, (1, 1)) == 7.0
    assert rounds._pipeline((0.5, 0.5), 1.0, 1.0, (0, 1)) == 4.0
    # double_zigzag: four rounds of a quarter each, offered to auto from the one call alike
    four = {pipeline: simulate(
        ULYSSES, q, k, v, g, variants.get("causal"), world_size=2, layout="double_zigzag",
        scheme_options={"pipeline": pipeline}, timer=_counting_timer([]),
    ) for pipeline in (False, True)}  # fmt: skip
    assert four[False].extra["alternatives"] == [{"pipeline": True}]
    quarter = four[True].ranks[0]
    assert (quarter.fwd_ms, quarter.out_ready) == ((1.0,) * 4, (0, 1, 2, 3))
    assert ULYSSES.price(four[True], slow, False).fwd_ms == pytest.approx(in_rounds)


def test_overlapped_allgather_calls_take_a_few_kernel_shapes_over_a_workload():
    """The overlap's received call holds the rows received and pads beside them, its queries the
    rows that read them widened, each a power-of-two number of blocks: batches of documents
    that fall anywhere give a few kernel shapes (each compiles once), not one per rank and
    batch."""
    from attngym.distributed.schemes.allgather import ALLGATHER

    q, k, v, g = make_inputs(Shape(batch=1, heads=2, seq_len=2048, head_dim=8), 0, "cpu",
                             torch.float32)  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    shapes, n, block = set(), 2048 // 8, 128
    for _ in range(4):  # four batches of 2-5 documents at random lengths (whole blocks)
        cuts = sorted(
            torch.randperm(15, generator=gen)[: int(torch.randint(1, 5, (1,), generator=gen))]
        )
        edges = [0, *[(int(c) + 1) * block for c in cuts], 2048]
        docs = variants.get(
            "document", doc_lengths=[b - a for a, b in zip(edges, edges[1:], strict=False)]
        )
        calls: list = []
        simulate(ALLGATHER, q, k, v, g, docs, world_size=8, layout="contiguous",
                 options=CPOptions(block_size=(block, block)), scheme_options={"overlap": True},
                 timer=_counting_timer(calls))  # fmt: skip
        for _, key in calls:  # ("allgather", part, ["tables",] q shape, k shape, mask)
            if key[1] == "received":
                q_shape, k_shape = [x for x in key[2:] if isinstance(x, tuple)][:2]
                shapes.add((q_shape[2], k_shape[2]))
    assert shapes, "no rank received rows"
    pow2 = {block << i for i in range(8)}
    assert all(rows in pow2 | {n} and keys in pow2 | {7 * n} for rows, keys in shapes), shapes


def test_torch_cp_is_simulated_over_whole_shards_in_one_kernel_shape():
    """PyTorch's CP gathers every shard whole and runs one call per rank over all S keys: so is it
    simulated (the all-gather's ranks read a window's halo only, each rank's keys a length of
    its own), so its kernel compiles once for every rank and balancer."""
    from attngym.distributed.schemes.allgather import ALLGATHER, torch_cp_simulation

    q, k, v, g = make_inputs(Shape(batch=1, heads=2, seq_len=1024, head_dim=8), 0, "cpu",
                             torch.float32)  # fmt: skip
    window = variants.get("sliding_window", window_size=64)
    keys = {}
    for spec in (ALLGATHER, torch_cp_simulation()):
        calls: list = []
        sim = simulate(spec, q, k, v, g, window, world_size=4, layout="contiguous",
                       scheme_options={"overlap": False}, timer=_counting_timer(calls))  # fmt: skip
        keys[spec.name] = {key[2] for _, key in calls}  # ("allgather", q, k shape, mask)
        assert {len(w.fwd_ms) for w in sim.ranks} == {1}
    assert keys["torch_cp"] == {(1, 2, 1024, 8)}
    # rank 0 holds its own 256 keys; ranks 1-3 one block of the shard before theirs too
    assert keys["allgather"] == {(1, 2, 256, 8), (1, 2, 384, 8)}
    assert sim.bytes_moved == 2 * 2 * 256 * 8 * 4 * 3  # K and V of 3 whole shards, float32
    priced = torch_cp_simulation().price(sim, tm.fabric("h200_nvlink"), True)
    assert priced.contenders["torch_cp"].fwd_bwd_ms == pytest.approx(priced.fwd_bwd_ms)


def test_allgather_pads_each_ranks_received_rows_to_a_power_of_two_of_blocks():
    """The rows a rank receives and the zeros beside them make a power-of-two number of blocks,
    taken from rows it does not read: next to the run read (a halo and its shard stay one run
    of positions), before it where there is room, else after; sources read first."""
    from attngym.distributed.placement import layout as layouts
    from attngym.distributed.schemes.allgather import ReadPlan, key_pieces, key_positions

    empty = ((), (), ())
    plan = ReadPlan(
        (empty, (((4, 16),), (), ()), (((8, 12),), ((0, 8),), ())), shard_rows=16, block=4
    )
    assert plan.pads(0) == ((), (), ())  # receives nothing
    assert plan.pads(1) == (((0, 4),), (), ())  # 12 rows: 4 more, before the run
    assert plan.pads(2) == (((4, 8),), (), ())  # 4 + 8 rows: 4 more, from shard 0 first
    contiguous = layouts.resolve("contiguous", 3, 48, None, "cpu")
    pieces = key_pieces(contiguous, 1, plan)
    assert pieces == ((0, 0, 4, None), (0, 4, 16, 0), (1, 0, 16, 0))
    assert torch.equal(key_positions(contiguous, 1, plan, "cpu"), torch.arange(32))
    after = ReadPlan((((), ((0, 12),)), ((), ())), shard_rows=16, block=4)
    assert after.pads(0) == ((), ((12, 16),))  # no room before the run: after it
    assert ReadPlan(plan.runs, 16).pads(1) == ((), (), ())  # no block given: no pads


def test_identical_work_is_timed_once():
    """Causal zigzag at P=16: 16 ranks x 16 steps of pairs, a handful of distinct structures
    (with each step's role, and the steps that add up the sums held: every HELD-th and the
    last of each pass)."""
    q, k, v, g = make_inputs(Shape(batch=1, heads=1, seq_len=4096, head_dim=8), 0, "cpu",
                             torch.float32)  # fmt: skip
    calls: list = []
    sim = simulate(
        RING,
        q,
        k,
        v,
        g,
        variants.get("causal"),
        world_size=16,
        layout="zigzag",
        options=CPOptions(block_size=(128, 128)),
        timer=_counting_timer(calls),
    )
    assert sim.items == 2 * 16 * 16  # fwd and bwd of every step of every rank
    assert sim.timed == len(calls) == len(set(calls)) and sim.timed <= 20
    assert len(sim.ranks) == 16 and all(len(w.fwd_ms) == 16 for w in sim.ranks)


def test_ring_arithmetic_on_hand_made_numbers():
    fab = tm.linear_fabric("toy", "test", gbps=1.0, latency_us=0.0)  # 1 MB takes 1 ms
    work = tm.RankWork(
        fwd_ms=(2.0, 3.0, 1.0),
        bwd_ms=(4.0, 1.0, 1.0),
        fwd_bytes=(0, 2e6, 5e6),  # step 1's K/V takes 2 ms, step 2's 5 ms
        bwd_bytes=(1e6, 3e6, 0),
        tail_bwd_bytes=0.5e6,
    )
    # fwd: max(2, 2) + max(3, 5) + max(1, 0) = 8; bwd: max(4, 1) + max(1, 3) + max(1, 0) + 0.5.
    assert ring_rank_ms(work, fab, False) == pytest.approx(8.0)
    assert ring_rank_ms(work, fab, True) == pytest.approx(8.0 + 8.5)
    other = tm.RankWork(fwd_ms=(1.0, 1.0, 1.0), fwd_bytes=(0, 0, 0))
    pred = tm.predict(ring_rank_ms, [work, other], fab, backward=False)
    assert pred.fwd_ms == pytest.approx(8.0)  # the slowest rank
    assert pred.time_imbalance == pytest.approx(6.0 / 4.5)
    assert pred.bottleneck == "transfer"  # 8 - 6 exposed against 6 - 4.5 of imbalance


def test_gather_and_alltoall_arithmetic_and_the_bottleneck():
    fab = tm.linear_fabric("toy", "test", gbps=1.0, latency_us=100.0)  # 0.1 ms + 1 ms per MB
    work = tm.RankWork(fwd_ms=(10.0,), bwd_ms=(20.0,), fwd_bytes=(4e6,), tail_fwd_bytes=1e6)
    assert gather_rank_ms(work, fab, False) == pytest.approx(4.1 + 10)
    assert gather_rank_ms(work, fab, True) == pytest.approx(4.1 + 10 + 20 + 4.1)
    assert alltoall_rank_ms(work, fab, False) == pytest.approx(4.1 + 10 + 1.1)
    assert alltoall_rank_ms(work, fab, True) == pytest.approx(2 * (4.1 + 1.1) + 30)
    # Overlapped: the transfer beside the own keys' call, then the received rows'; backward the
    # received rows' call, then the gradients home beside the own keys'.
    split = tm.RankWork(fwd_ms=(3.0, 7.0), bwd_ms=(12.0, 8.0), fwd_bytes=(4e6,))
    assert gather_rank_ms(split, fab, False) == pytest.approx(4.1 + 7)
    assert gather_rank_ms(split, fab, True) == pytest.approx(4.1 + 7 + 12 + 8)
    assert tm.bottleneck(10.2, [10.0, 10.0]) == "compute"
    assert tm.bottleneck(15.0, [10.0, 10.0]) == "transfer"
    assert tm.bottleneck(10.0, [10.0, 6.0]) == "imbalance"
    from attngym.distributed.model.simulate import Simulation
    from attngym.distributed.schemes.allgather import ALLGATHER

    across = Simulation(1, [work], 1, extra={"torch_cp": [work]})
    across.extra.update(across=ALLGATHER, exchange=tm.RankWork((), fwd_bytes=(1e6,)), a2a_size=2)
    hybrid = price_hybrid(across, fab, True)
    assert hybrid.fwd_bwd_ms == pytest.approx(38.2 + 2 * 1.1)  # the all-to-all in, twice


def test_a_rank_takes_the_longer_of_its_device_timeline_and_its_host():
    """Small kernels on many ranks: the host issues a rank's calls ahead of the device, so the
    rank ends when the later of the two does, and a host slower than the device is named."""
    fab = tm.linear_fabric("toy", "test", gbps=1.0, latency_us=0.0)
    device_bound = tm.RankWork(fwd_ms=(2.0,), bwd_ms=(3.0,), fwd_bytes=(1e6,), host_fwd_ms=1.0,
                               host_bwd_ms=1.5)  # fmt: skip
    host_bound = tm.RankWork(fwd_ms=(0.5,), bwd_ms=(0.5,), fwd_bytes=(1e6,), host_fwd_ms=4.0,
                             host_bwd_ms=5.0)  # fmt: skip
    assert host_bound.host_ms(False) == 4.0 and host_bound.host_ms(True) == 9.0
    pred = tm.predict(gather_rank_ms, [device_bound, host_bound], fab, backward=True)
    # device timelines: 1 + 2 + 3 + 1 = 7 and 1 + 0.5 + 0.5 + 1 = 3; host 2.5 and 9
    assert pred.rank_device_ms == pytest.approx((7.0, 3.0))
    assert pred.rank_host_ms == pytest.approx((2.5, 9.0))
    assert pred.rank_ms == pytest.approx((7.0, 9.0)) and pred.fwd_bwd_ms == pytest.approx(9.0)
    assert pred.fwd_ms == pytest.approx(4.0)  # forward: max(1 + 0.5, 4) on the host-bound rank
    assert pred.bottleneck == "host"
    assert tm.predict(gather_rank_ms, [device_bound], fab, True).bottleneck == "transfer"
    assert tm.bottleneck(10.0, [10.0], device_ms=9.8) == "compute"  # within the share: no host


def test_stream_time_on_a_cpu_is_the_wall_time_with_no_host_apart():
    from attngym import bench

    timing = bench.stream_time(lambda: time.sleep(0.002), warmup=0, repeats=3, device="cpu")
    assert timing.host_ms == 0.0 and timing.gpu_ms >= 2.0
    with pytest.raises(ValueError, match="repeats must be an integer >= 1"):
        bench.stream_time(lambda: None, repeats=0, device="cpu")


def test_measured_fabric_is_the_stored_measurement_and_interpolates():
    data = json.loads(
        (ROOT / "experiments/multi_gpu_cp/transfer_bandwidth_alltoall.json").read_text()
    )
    for row in data["rows"]:
        table = tm.H200_MEASURED[row["transport"]].get(row["pattern"])
        if table is None:
            continue  # the ulysses q exchange: the model prices the all-to-all
        assert (row["bytes_per_rank"] // tm.MIB, round(row["ms"], 4)) in table
    fab = tm.fabric("h200_nvlink", "copy_engine")
    assert fab.ms("channel", 64 * tm.MIB) == pytest.approx(0.2417)
    between = fab.ms("channel", 160 * tm.MIB)
    assert 0.2417 < between < 0.8188
    beyond = fab.ms("channel", 2048 * tm.MIB)  # the last segment's slope
    assert beyond == pytest.approx(2.9347 + (2.9347 - 0.8188) * (1024 / 768))
    assert fab.ms("alltoall", 32 * tm.MIB) == pytest.approx(0.2610)  # received = half of 64 MiB
    assert fab.ms("channel", 0) == 0.0


def test_fabric_names_agree_with_the_config_and_bad_ones_are_refused():
    from typing import get_args

    from attngym.runner.config import Fabric

    assert get_args(Fabric) == tm.FABRIC_NAMES
    assert tm.fabric("custom", gbps=100, latency_us=5).ms("allgather", 1e8) == pytest.approx(1.005)
    assert tm.fabric("nvlink5").source.startswith("assumed")
    with pytest.raises(ValueError, match="fabric_gbps, fabric_latency_us"):
        tm.fabric("custom", gbps=None, latency_us=5)
    with pytest.raises(ValueError, match="transport: h200_nvlink is measured"):
        tm.fabric("h200_nvlink", "gloo")
    with pytest.raises(ValueError, match="fabric: expected one of"):
        tm.fabric("ethernet")


def test_two_level_fabric_prices_what_crosses_domains_on_the_slower_link():
    hgx = tm.fabric("hgx_h200", "nccl")
    inside = tm.fabric("h200_nvlink", "nccl")
    ib = tm.fabric("infiniband")
    assert hgx.domain_size == 8 and hgx.across == ib and "assumed" in hgx.source
    size = 64 * tm.MIB
    assert hgx.ms("channel", size) == inside.ms("channel", size)  # nothing crosses
    assert hgx.ms("channel", size, 1.0) == pytest.approx(ib.ms("channel", size))
    # A collective over 64 ranks, 8 per node: 56 of 63 peers' bytes come over InfiniBand.
    share = hgx.collective_crossing(64)
    assert share == pytest.approx(56 / 63)
    assert hgx.ms("allgather", size, share) == pytest.approx(
        max(inside.ms("allgather", size * 7 / 63), ib.ms("allgather", size * 56 / 63))
    )
    assert hgx.collective_crossing(8) == 0.0 and hgx.neighbour_crossing(8) == 0.0
    assert hgx.neighbour_crossing(16) == 1.0
    assert hgx.collective_crossing(8, stride=8) == 1.0  # hybrid's across groups: one per node
    assert tm.fabric("h200_nvlink").collective_crossing(64) == 0.0  # one level: one domain
    assert tm.domain_size("nvl72") == 72 and tm.domain_size("h200_nvlink") is None


def test_each_scheme_prices_what_crosses_nodes_on_the_two_level_fabric():
    from attngym.distributed.model.simulate import Simulation
    from attngym.distributed.schemes.allgather import ALLGATHER, price_allgather
    from attngym.distributed.schemes.hybrid import price_hybrid
    from attngym.distributed.schemes.ring import price_ring

    hgx, one = tm.fabric("hgx_h200", "nccl"), tm.fabric("h200_nvlink", "nccl")
    ib = tm.fabric("infiniband")
    step = 64 * tm.MIB
    work = tm.RankWork(fwd_ms=(0.1, 0.1), fwd_bytes=(0, step))
    for P in (8, 16):
        ring = price_ring(Simulation(P, [work] * P, P), hgx, False)
        # Inside one node the step is NVLink's; past 8 ranks every step waits for InfiniBand.
        link = one if P == 8 else ib
        assert ring.fwd_ms == pytest.approx(max(0.1, link.ms("channel", step)) + 0.1)
    gather = tm.RankWork(fwd_ms=(1.0,), fwd_bytes=(step,))
    across = Simulation(16, [gather] * 2, 2, stride=8, extra={"torch_cp": [gather] * 2})
    across.extra.update(across=ALLGATHER, exchange=tm.RankWork((), fwd_bytes=(0,)), a2a_size=8)
    # hybrid's across all-gather runs among groups one node apart: all of it over InfiniBand.
    assert price_hybrid(across, hgx, False).fwd_ms == pytest.approx(ib.ms("allgather", step) + 1)
    flat = Simulation(16, [gather] * 16, 16, extra={"torch_cp": [gather] * 16})
    share = hgx.collective_crossing(16)
    assert price_allgather(flat, hgx, False).fwd_ms == pytest.approx(
        max(one.ms("allgather", step * (1 - share)), ib.ms("allgather", step * share)) + 1
    )


def test_ring_halos_of_a_workload_share_a_few_widths(monkeypatch):
    """Batches of documents whose reads differ at every step: each step's halo is a power-of-two
    number of blocks (or the whole shard), so the kernels a workload runs are compiled for a few
    shapes, not anew for each batch; the halo still holds every row a rank reads."""
    from attngym.distributed.schemes import ring

    plans = []
    build = ring._build_ring_plan
    monkeypatch.setattr(ring, "_build_ring_plan", lambda call, q: plans.append(build(call, q))
                        or plans[-1])  # fmt: skip
    q, k, v, g = make_inputs(Shape(batch=1, heads=1, seq_len=2048, head_dim=8), 0, "cpu",
                             torch.float32)  # fmt: skip
    batches = ([1000, 600, 448], [300, 1500, 248], [1700, 348], [420, 560, 500, 568])
    for lengths in batches:
        simulate(RING, q, k, v, g, variants.get("document", doc_lengths=lengths), world_size=4,
                 layout="contiguous", options=CPOptions(block_size=(32, 32)),
                 timer=_counting_timer([]))  # fmt: skip
    assert len(plans) == len(batches)
    n = 2048 // 4
    halos = {w for plan in plans for w in plan.widths[1:]}
    assert halos and halos <= {32 << i for i in range(5)} | {n}, halos
    # The 1700-token document spans shards 0-3: rank 3 reads shard 0 (three hops) whole.
    assert plans[2].steps == 4 and plans[2].widths == (n, n, n, n)
    # [420, 560, 500, 568]: the widest read back is rank 1's, rows 420..511 of shard 0 (blocks
    # 13-15): held as 4 blocks, rows 384..511; no rank reads two shards back.
    assert plans[3].widths == (n, 128) and plans[3].starts[0][1] == 384


def _priced(item, which):
    """A rank's predicted time from its block masks, at layout.BLOCK_COSTS."""
    full_cost, partial_cost = layouts.BLOCK_COSTS
    total = 0.0
    for bm in item.block_masks:
        if bm is not None:
            full = 0 if bm.full_kv_num_blocks is None else int(bm.full_kv_num_blocks.sum())
            total += full * full_cost + int(bm.kv_num_blocks.sum()) * partial_cost
    return ItemTime(total)


def test_balanced_layout_evens_time_on_unequal_documents_at_eight_ranks():
    """Documents of unequal length, P=8: the placement weighed by time has a lower time
    imbalance (each rank's pairs priced from their block masks) than the one that counts blocks,
    and far lower than zigzag."""
    S, P = 8192, 8
    docs = variants.get("document", doc_lengths=[3000, 500, 1800, 700, 1200, 992])
    q, k, v, _ = make_inputs(Shape(batch=1, heads=1, seq_len=S, head_dim=8), 0, "cpu",
                             torch.float32)  # fmt: skip
    imbalance = {}
    for name, layout in (
        ("time", layouts.plan("balanced", P, S, docs)),
        ("blocks", layouts.plan("balanced", P, S, docs, block_costs=(1.0, 1.0))),
        ("zigzag", "zigzag"),
    ):
        sim = simulate(RING, q, k, v, None, docs, world_size=P, layout=layout,
                       options=CPOptions(block_size=(128, 128)), timer=_priced)  # fmt: skip
        imbalance[name] = tm.predict(ring_rank_ms, sim.ranks, tm.fabric("h200_nvlink"), False)
        imbalance[name] = imbalance[name].time_imbalance
    assert imbalance["time"] < 1.03, imbalance
    assert imbalance["time"] < imbalance["blocks"] - 0.1 < imbalance["zigzag"], imbalance


def test_placement_priced_per_pair_kernel_speeds_a_pairwise_schemes_slowest_rank():
    """Documents of unequal length, P=8, a scheme of one kernel per chunk pair (a user's with
    TopologySpec.pair_kernels) simulated with each kernel priced by its waves: the placement
    priced per pair kernel has a faster slowest rank than the one priced by blocks (fewer,
    fuller kernels), and both beat zigzag. The ring runs one call per step over a shard of
    several chunks, so its `balanced`, like the all-gather's, is priced by blocks."""
    import dataclasses

    from attngym.distributed.schemes.allgather import ALLGATHER
    from attngym.distributed.schemes.ring import RING

    from .schemes import PAIRWISE

    S, P, heads, slots = 32768, 8, 8, 132
    docs = variants.get("document", doc_lengths=[12000, 2000, 7200, 2800, 4800, 3968])
    kernels = layouts.PairKernels(heads, slots)
    pair_priced = layouts.plan("balanced", P, S, docs, kernels=kernels)
    slowest = {
        name: max(layouts.rank_times(layout, docs, P, S, kernels=kernels))
        for name, layout in (("pairs", pair_priced), ("blocks", layouts.plan("balanced", P, S,
                             docs)), ("zigzag", "zigzag"))
    }  # fmt: skip
    assert slowest["pairs"] < 0.8 * min(slowest["blocks"], slowest["zigzag"]), slowest
    by_blocks = layouts.plan("balanced", P, S, docs)
    pairwise = dataclasses.replace(PAIRWISE, pair_kernels=True)
    assert not RING.pair_kernels and not ALLGATHER.pair_kernels
    for spec in (RING, ALLGATHER, pairwise):  # on a CPU (no waves) every one places by blocks
        got = spec.placement("balanced", P, S, docs, batch_heads=heads, device="cpu")
        assert got.placement == by_blocks.placement
    assert RING.placement("zigzag", P, S, docs, batch_heads=heads, device="cpu") == "zigzag"
    with pytest.raises(ValueError, match="PairKernels.slots must be a positive integer, got 0"):
        layouts.PairKernels(heads, 0)


def test_check_script_on_a_tiny_csv(tmp_path):
    import subprocess
    import sys

    folder = tmp_path / "measured"
    folder.mkdir()
    base = (
        "+experiment=ring_attention shape.batch=1 shape.heads=2 shape.head_dim=8 "
        "benchmark.warmup=0 benchmark.repeats=1 logger=none attention=causal shape.seq_len=512"
    )
    rows = [
        "job,overrides,status,topology,world_size,transport,layout,fwd_ms,fwd_bwd_ms",
        f'0,"{base} topology=ring topology.layout=zigzag",ok,ring,2,copy_engine,zigzag,1.0,3.0',
        f'1,"{base} topology=allgather topology.layout=zigzag",ok,allgather,2,copy_engine,'
        "zigzag,1.0,2.0",
    ]
    (folder / "study_tiny.csv").write_text("\n".join(rows) + "\n")
    out = tmp_path / "check"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts/check_cp_model.py"),
            str(folder),
            "--out",
            str(out),
            "--override",
            "device=cpu",
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    table = json.loads((out / "check_cp_model.json").read_text())
    assert [r["topology"] for r in table["rows"]] == ["ring", "allgather"]
    for row in table["rows"]:
        assert row["predicted_fwd_bwd_ms"] > 0 and row["error_pct"] is not None
    (case,) = table["cases"]
    assert case["measured_best"] == "allgather/zigzag"
    assert case["predicted_best"] in ("ring/zigzag", "allgather/zigzag")
    assert "| measured" in (out / "check_cp_model.md").read_text()


def test_hybrid_is_the_across_scheme_over_the_groups_plus_the_in_group_exchange():
    """4 ranks in groups of 2: the ring across the 2 groups on half the heads, and the Ulysses
    exchange inside a group (q, k, v in and the output back, each rank keeping its half)."""
    q, k, v, g = make_inputs(Shape(batch=1, heads=4, seq_len=1024, head_dim=8), 0, "cpu",
                             torch.float32)  # fmt: skip
    calls: list = []
    sim = simulate(HYBRID, q, k, v, g, variants.get("causal"), world_size=4, layout="zigzag",
                   options=CPOptions(block_size=(128, 128)), scheme_options={"a2a_size": 2},
                   timer=_counting_timer(calls))  # fmt: skip
    assert sim.extra["across"] is RING and len(sim.ranks) == 2 and sim.world_size == 4
    assert sim.sequence_shards == 2
    shard = 1 * 4 * (1024 // 4) * 8 * 4  # one rank's q (or k, v, out) bytes, float32
    assert sim.extra["exchange"].fwd_bytes == (3 * shard / 2,)
    assert sim.extra["exchange"].tail_fwd_bytes == shard / 2
    with pytest.raises(ValueError, match="a2a_size"):
        simulate(HYBRID, q, k, v, g, variants.get("causal"), world_size=4, layout="zigzag",
                 timer=_counting_timer([]))  # fmt: skip


def test_check_matches_a_case_whatever_hydras_prefix(monkeypatch):
    """A measured summary may write `++attention.window_size=1024` where a kept prediction
    writes it as typed: the same case, so the two rows meet."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import check_cp_model

    typed = ["attention=sliding_window", "attention.window_size=1024", "topology=ring"]
    assert check_cp_model._case(["++" + typed[1], *typed[::2]]) == check_cp_model._case(typed)
    assert "topology" not in check_cp_model._case(typed)


def test_check_judges_the_pick_by_its_own_measured_time_and_groups_cases_in_any_order():
    """A pick that measured more than 5 % slower than the fastest differs, even when two others
    are a tie; a case's overrides in another order are the same case."""
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    import check_cp_model

    def row(case, topology, measured, predicted):
        return {"case": check_cp_model._case(case.split()), "topology": topology,
                "layout": "zigzag", "measured_fwd_bwd_ms": measured,
                "predicted_fwd_bwd_ms": predicted}  # fmt: skip

    table = [
        row("a=1 b=2", "ring", 6.05, 4.1),
        row("b=2 a=1", "allgather", 7.2, 3.9),  # the model's pick, 19 % slower than the best
        row("a=1 b=2", "ulysses", 5.96, 5.7),
        row("a=2", "ring", 10.0, 9.0),
        row("a=2", "ulysses", 10.3, 9.5),
    ]
    verdicts = {c["case"]: c["verdict"] for c in check_cp_model._cases(table)}
    assert verdicts == {"a=1 b=2": "differs", "a=2": "agree"}
    table[3]["predicted_fwd_bwd_ms"] = 9.9
    assert check_cp_model._cases(table)[1]["verdict"] == "within 5 %"


def test_scaling_resume_keeps_every_row_when_cases_narrow_or_a_run_is_cut(tmp_path, monkeypatch):
    """A resumed scaling run narrowed by --cases, and one cut off mid-run, still write every row
    they were given, so the next resume loses nothing."""
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    import check_cp_model

    def row(case, ms):
        return {"case": case, "topology": "ring", "layout": "zigzag", "world_size": 2,
                "predicted_fwd_bwd_ms": ms, "efficiency_fwd_bwd": 0.9, "bottleneck": "compute",
                "time_imbalance": 1.0, "sim_s": 1.0, "single_fwd_bwd_ms": 2 * ms}  # fmt: skip

    resume = tmp_path / "resume.json"
    resume.write_text(json.dumps({"rows": [row("window(1024) 128K", 3.0), row("causal 1M", 7.0)]}))
    args = ["--scaling", "--resume", str(resume), "--world-sizes", "2", "--topologies", "ring"]
    new = {"predicted_fwd_bwd_ms": 1.5, "bottleneck": "compute", "single_fwd_bwd_ms": 3.1,
           "device_name": "NVIDIA H200", "torch": "2.11.0"}  # fmt: skip
    monkeypatch.setattr(check_cp_model, "_simulated", lambda *a: new)
    out = ["--out", str(tmp_path / "a"), "--cases", "128K", "--commit", "abc1234"]
    assert check_cp_model.main([*args, *out]) == 0
    rows = {r["case"]: r for r in json.loads((tmp_path / "a/scaling.json").read_text())["rows"]}
    assert set(rows) == {"window(1024) 128K", "documents 128K", "causal 1M"}
    assert rows["window(1024) 128K"]["predicted_fwd_bwd_ms"] == 3.0  # resumed, not re-run
    assert rows["documents 128K"]["efficiency_fwd_bwd"] == pytest.approx(3.1 / 2 / 1.5)
    made = rows["documents 128K"]["measured"]
    assert made["commit"] == "abc1234" and made["device_name"] == "NVIDIA H200"
    assert f"Made on {made['date']} at commit abc1234" in (tmp_path / "a/scaling.md").read_text()

    def cut(*a):
        raise KeyboardInterrupt("cut")

    monkeypatch.setattr(check_cp_model, "_simulated", cut)
    with pytest.raises(KeyboardInterrupt):
        check_cp_model.main([*args, "--out", str(tmp_path / "b")])
    rows = json.loads((tmp_path / "b/scaling.json").read_text())["rows"]
    assert {r["case"] for r in rows} == {"window(1024) 128K", "causal 1M"}


def test_check_reads_predictions_kept_from_before_the_measurement(tmp_path):
    """PREDICT=1 study.sh's sweep (simulated, its summary.csv) is what --predicted compares with
    the measured rows: the kept predictions, matched per job, nothing simulated again."""
    import csv
    import subprocess
    import sys

    base = (
        "+experiment=ring_attention shape.batch=1 shape.heads=2 shape.head_dim=8 device=cpu "
        "benchmark.warmup=0 benchmark.repeats=1 logger=none attention=causal shape.seq_len=512"
    )
    run = subprocess.run(
        [sys.executable, "-m", "attngym", "-m", f"hydra.sweep.dir={tmp_path}/predicted/causal",
         *base.split(), "topology=ring,allgather", "topology.layout=zigzag",
         "topology.simulate=true", "topology.world_size=2", "validate=false", "baselines=[]"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    with (tmp_path / "predicted/causal/summary.csv").open() as f:
        kept = {r["topology"]: float(r["predicted_fwd_bwd_ms"]) for r in csv.DictReader(f)}
    measured = tmp_path / "measured"
    measured.mkdir()
    (measured / "study_tiny.csv").write_text(
        "job,overrides,status,topology,world_size,transport,layout,fwd_ms,fwd_bwd_ms\n"
        f'0,"{base} topology=allgather topology.layout=zigzag",ok,allgather,2,copy_engine,zigzag,'
        "1.0,2.0\n"
        f'1,"{base} topology=ulysses topology.layout=zigzag",ok,ulysses,2,copy_engine,zigzag,'
        "1.0,2.5\n"
    )
    out = tmp_path / "check"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts/check_cp_model.py"), str(measured), "--out", str(out),
         "--predicted", str(tmp_path / "predicted")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads((out / "check_cp_model.json").read_text())["rows"]
    assert rows[0]["predicted_fwd_bwd_ms"] == pytest.approx(kept["allgather"])
    assert rows[0]["error_pct"] == pytest.approx(100 * (kept["allgather"] - 2.0) / 2.0)
    assert rows[1]["predicted_fwd_bwd_ms"] is None  # no prediction was kept for this job
    assert not (out / "runs").exists()
