"""topology=auto and the block grid: the model's pick runs validated, what it records, and the
grid every plan is cut from (any mask, evaluated once)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from attngym.distributed.placement import grid, layout
from attngym.variants.base import Variant

pytestmark = pytest.mark.timeout(600)


def _checkerboard(b, h, q_idx, kv_idx):
    return (q_idx // 96 + kv_idx // 160) % 3 != 0


def test_sub_mask_is_create_block_mask_of_the_mapped_user_mask():
    from torch.nn.attention.flex_attention import create_block_mask

    user = Variant(name="user", mask_mod=_checkerboard)
    plans = grid.plans_for(user, 2048, (128, 128), "cpu")
    q_pos = torch.cat([torch.arange(256, 768), torch.arange(1536, 1792)])
    kv_pos = torch.cat([torch.arange(0, 384), torch.arange(1024, 1280)])

    def mapped(b, h, q, kv):
        return _checkerboard(b, h, q_pos[q], kv_pos[kv])

    cut = plans.sub_mask(q_pos, kv_pos, mapped)
    built = create_block_mask(mapped, None, None, q_pos.numel(), kv_pos.numel(), device="cpu")
    assert torch.equal(cut.to_dense(), built.to_dense())
    assert plans.sub_mask(q_pos + 1, kv_pos, mapped) is None  # not whole blocks: built instead


def test_kept_decides_every_chunk_pair_as_the_pair_plan_does(monkeypatch):
    """GridPlans.kept answers for all chunk pairs at once what a pair's own plan decides (any
    kept block), on unevenly long whole-block chunks; unaligned chunks are left to the pairs.
    Asked again it reads its answer: a CUDA graph's capture repeats the warm-up's questions and
    allows no copy between host and device."""

    def banded(b, h, q_idx, kv_idx):  # documents of 384 with a checkerboard inside
        return (q_idx // 384 == kv_idx // 384) & _checkerboard(b, h, q_idx, kv_idx)

    user = Variant(name="user", mask_mod=banded)
    plans = grid.plans_for(user, 2048, (128, 128), "cpu")
    q_chunks = [(0, 128), (384, 256), (1024, 128), (1792, 256)]
    kv_chunks = [(128, 256), (640, 128), (768, 512), (1664, 128)]
    kept = plans.kept(q_chunks, kv_chunks, (128, 128), "cpu")
    each = [[not plans(1, 1, qc, kc, (128, 128), "flex", "cpu")[0] for kc in kv_chunks]
            for qc in q_chunks]  # fmt: skip
    assert kept.tolist() == each and any(map(any, each)) and not all(map(all, each))
    assert plans.kept([(64, 128)], kv_chunks, (128, 128), "cpu") is None

    def no_copies(*args):
        raise AssertionError("kept reduced the grid again")

    monkeypatch.setattr(grid, "_blocks_of", no_copies)
    assert plans.kept(list(q_chunks), kv_chunks, (128, 128), "cpu").tolist() == each


def test_bytes_needed_counts_the_blocks_other_ranks_hold_that_the_mask_reads():
    from attngym.variants.sliding_window import sliding_window

    window = sliding_window(256).to("cpu")
    lay = layout.plan("contiguous", 4, 4096)
    # A causal window of 256 reads 256 rows of the previous rank: 2 blocks of 128.
    assert grid.kv_bytes_needed(window, lay, (128, 128), "cpu", kv_row_bytes=10) == 256 * 10
    full = Variant(name="full")  # no mask: every other rank's whole shard
    assert grid.kv_bytes_needed(full, lay, (128, 128), "cpu", kv_row_bytes=1) == 3 * 1024


def test_auto_picks_by_the_model_records_why_and_the_pick_runs_validated(tmp_path):
    import attngym

    m = attngym.run(
        overrides=["topology=auto", "topology.world_size=2", "attention=document",
                   "shape.seq_len=512", "logger=none"],
        run_dir=tmp_path / "real",
    )  # fmt: skip
    assert m["validation"] == "ok" and m["topology"] in ("ring", "allgather", "ulysses")
    assert m["transport"] == "gloo" and m["auto_pick"].endswith("/gloo")
    assert m["auto_pick"].startswith(f"{m['topology']}/{m['layout']}")
    assert m["auto_runner_up"]
    if m["auto_runner_up_ms"] >= m["auto_pick_ms"]:
        assert "faster than" in m["auto_why"]
    else:  # an untimed candidate priced within the confirmation's margin of the pick
        assert "not timed" in m["auto_why"] and "a tie" in m["auto_why"]
    # The pick follows this machine's timings; bytes_needed is a sequence-sharded scheme's.
    assert (m["bytes_needed"] is None) == (m["topology"] == "ulysses")
    assert m["auto_measured_over_predicted"] == pytest.approx(m["fwd_bwd_ms"] / m["auto_pick_ms"])
    table = json.loads((tmp_path / "real" / "auto.json").read_text())
    assert table["pick"] == m["auto_pick"] and len(table["candidates"]) == m["auto_candidates"]
    # The timed come first, fastest first; then the rest by the model's price.
    timed = [c["timed_ms"] is not None for c in table["candidates"]]
    assert timed == sorted(timed, reverse=True) and timed[0]
    rows = list(zip(table["candidates"], timed, strict=True))
    for group in (True, False):
        ms = [c["predicted_ms"] for c, t in rows if t is group]
        assert ms == sorted(ms)


def test_auto_simulates_the_allgathers_overlap_both_ways(tmp_path):
    """A window's halo is exchanged, not gathered: auto prices the all-gather with its default
    (no split around the exchange) and with the overlap, and records both."""
    import attngym

    attngym.run(
        overrides=["topology=auto", "topology.simulate=true", "topology.world_size=4",
                   "topology.layout=contiguous", "topology.options.candidates=[allgather]",
                   "attention=sliding_window", "++attention.window_size=64", "device=cpu",
                   "shape.seq_len=1024", "shape.heads=2", "shape.head_dim=8", "validate=false",
                   "baselines=[]", "benchmark.warmup=0", "benchmark.repeats=1", "logger=none"],
        run_dir=tmp_path / "sim",
    )  # fmt: skip
    table = json.loads((tmp_path / "sim" / "auto.json").read_text())
    options = sorted(json.dumps(c["options"]) for c in table["candidates"])
    assert sorted(set(options)) == ['{"overlap": true}', "{}"], options


def test_auto_weighs_a_users_balancer_named_in_its_layouts(tmp_path, monkeypatch):
    """`topology.options.layouts` takes a balancer by import path, as topology.layout does: the
    schemes that take a user's balancer are simulated on it beside the layouts named."""
    import attngym
    from attngym.errors import ConfigError

    (tmp_path / "mybal.py").write_text(
        "def striped(seq_len, world_size):\n"
        "    chunks = [[] for _ in range(world_size)]\n"
        "    for i, offset in enumerate(range(0, seq_len, 64)):\n"
        "        chunks[i % world_size].append((offset, 64))\n"
        "    return chunks\n"
    )
    monkeypatch.chdir(tmp_path)
    common = ["topology=auto", "topology.simulate=true", "topology.world_size=2",
              "attention=causal", "device=cpu", "shape.seq_len=512", "shape.heads=2",
              "shape.head_dim=8", "validate=false", "baselines=[]", "benchmark.warmup=0",
              "benchmark.repeats=1", "logger=none"]  # fmt: skip
    attngym.run(
        overrides=[*common, "topology.options.layouts=[zigzag,mybal.striped]"],
        run_dir=tmp_path / "sim",
    )
    table = json.loads((tmp_path / "sim" / "auto.json").read_text())
    tried = {(c["scheme"], c["layout"]) for c in table["candidates"]}
    assert {("ring", "mybal.striped"), ("allgather", "mybal.striped")} <= tried
    assert ("ulysses", "mybal.striped") not in tried  # Ulysses takes contiguous or zigzag
    with pytest.raises(ConfigError, match="unknown layout 'zigzg'.*did you mean 'zigzag'") as err:
        attngym.run(overrides=[*common, "topology.options.layouts=[zigzg]"], run_dir=tmp_path / "x")
    assert err.value.key == "topology.options.layouts"


def _causal_item(seq_len: int, name: str = "ring"):
    from torch.nn.attention.flex_attention import create_block_mask

    from attngym.distributed.model.simulate import Item

    mask = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, seq_len, seq_len, "cpu")
    key = (name, (1, 2, seq_len, 8), seq_len)
    return Item(key=key, fwd=lambda: None, bwd=None, block_masks=(mask,))


def test_the_model_times_a_few_items_of_a_kind_and_prices_the_rest_by_their_blocks():
    from attngym.distributed.model.simulate import ItemTime, ModelTimer, block_units

    timed = []

    def device_time(item, which):  # a device whose time is 0.5 ms + 0.01 ms a block unit
        timed.append(item.key)
        return ItemTime(0.5 + 0.01 * block_units(item), host_ms=0.1)

    model = ModelTimer(device_time)
    sizes = (1024, 128, 4096, 512, 2048, 256, 8192)
    prices = {n: model(_causal_item(n), "fwd") for n in sizes}
    # The first, then those outside what was timed by more than half, three at most.
    assert [key[2] for key in timed] == [1024, 128, 4096]
    for n, price in prices.items():  # a line through the samples: exact on a linear device
        assert price.ms == pytest.approx(0.5 + 0.01 * block_units(_causal_item(n)), rel=1e-9)
        assert price.host_ms == pytest.approx(0.1)
    model(_causal_item(512, name="allgather"), "fwd")  # another kind is fitted on its own
    model(_causal_item(512), "bwd")  # and another pass
    assert len(timed) == 5
    graphed = model.with_graphs()(_causal_item(2048), "fwd")
    assert graphed.ms == prices[2048].ms and graphed.host_ms < 0.1  # one replay issues it
    assert len(timed) == 5


def test_the_overlaps_parts_are_priced_apart_from_the_one_call():
    """The all-gather's overlap runs two calls a rank, the received rows' a short one with a
    merge: priced on the one call's line, its fixed cost raised every call's price (on CPU
    ranks the overlap's model price was 1.45-1.7 times its timing)."""
    import dataclasses

    from attngym.distributed.model.simulate import ItemTime, ModelTimer, block_units

    def device_time(item, which):  # the received part: a merge's 2 ms whatever its blocks
        fixed = 2.0 if "received" in item.key else 0.0
        return ItemTime(fixed + 0.01 * block_units(item), host_ms=0.1)

    def part(n, *names):
        item = _causal_item(n, name="allgather")
        return dataclasses.replace(item, key=("allgather", *names, *item.key[1:]))

    model = ModelTimer(device_time)
    for n in (512, 2048):
        model(part(n, "received"), "fwd")
        model(part(n, "own"), "fwd")
    one_call = model(part(1024), "fwd")  # the one call's first: timed, then priced by its line
    assert one_call.ms == pytest.approx(0.01 * block_units(_causal_item(1024)))
    priced = model(part(1200), "fwd")
    assert priced.ms == pytest.approx(0.01 * block_units(_causal_item(1200)), rel=1e-6)


def test_the_fit_never_prices_below_zero_or_falls_with_size():
    from attngym.distributed.model.simulate import _fit

    assert _fit([(10.0, 2.0)]) == (0.0, 0.2)  # one sample: through the origin
    assert _fit([(10.0, 1.0), (20.0, 5.0)]) == pytest.approx((0.0, 0.22))  # no negative a
    assert _fit([(10.0, 3.0), (20.0, 1.0)]) == (2.0, 0.0)  # a falling line: flat
    assert _fit([(0.0, 1.0), (10.0, 2.0), (20.0, 3.0)]) == pytest.approx((1.0, 0.1))


def test_auto_times_a_shortlist_and_keeps_its_answer_for_the_same_question(tmp_path):
    import attngym
    from attngym.errors import ConfigError
    from attngym.runner.tasks.cp_auto import CONFIRM_MARGIN, SHORTLIST_MARGIN

    common = ["topology=auto", "topology.simulate=true", "topology.world_size=2",
              "attention=document", "device=cpu", "shape.seq_len=512", "shape.heads=2",
              "shape.head_dim=8", "validate=false", "baselines=[]", "benchmark.warmup=0",
              "benchmark.repeats=1", "logger=none", "topology.options.shortlist=2"]  # fmt: skip
    first = attngym.run(overrides=common, run_dir=tmp_path / "first")
    assert first["auto_cached"] is None
    table = json.loads((tmp_path / "first" / "auto.json").read_text())
    timed = [c for c in table["candidates"] if c["timed_ms"] is not None]
    # The shortlist: 1 or 2 (how many depends on this CPU's timings), each (its fastest
    # transport) within the margin of the model's best; then any the model prices under the
    # fastest timed by more than CONFIRM_MARGIN, until none is left.
    fastest: dict[tuple, float] = {}
    for c in timed:
        candidate = (c["scheme"], c["layout"], json.dumps(c["options"]))
        fastest[candidate] = min(fastest.get(candidate, c["model_ms"]), c["model_ms"])
    best = min(c["model_ms"] for c in table["candidates"])
    assert 1 <= first["auto_timed"] == len(fastest)
    assert any(ms <= best * (1 + SHORTLIST_MARGIN) for ms in fastest.values())
    assert table["candidates"][0] in timed  # the pick is a timed one
    pick_ms = table["candidates"][0]["timed_ms"]
    ratios: dict[tuple, list[float]] = {}  # each way's timed over modelled times
    for c in timed:
        ratios.setdefault(_way(c), []).append(c["timed_ms"] / c["model_ms"])
    for c in table["candidates"]:
        if c["timed_ms"] is None:
            seen = ratios.get(_way(c), [1.0])
            assert c["model_ms"] * sum(seen) / len(seen) >= pick_ms * (1 - CONFIRM_MARGIN)
    assert all(not c["cuda_graph"] for c in table["candidates"])  # no graphs on a CPU
    again = attngym.run(overrides=common, run_dir=tmp_path / "again")
    assert again["auto_cached"] and again["auto_pick"] == first["auto_pick"]
    assert "auto_simulated" not in again and again["auto_timed"] == first["auto_timed"]
    assert json.loads((tmp_path / "again" / "auto.json").read_text()) == table
    other = attngym.run(overrides=[*common, "shape.heads=4"], run_dir=tmp_path / "other")
    assert other["auto_cached"] is None  # another question
    fresh = attngym.run(overrides=[*common, "topology.options.reuse=false"],
                        run_dir=tmp_path / "fresh")  # fmt: skip
    assert fresh["auto_cached"] is None
    every_key = ["topology.options.reuse=false", "topology.options.shortlist=0"]
    every = attngym.run(overrides=[*common, *every_key], run_dir=tmp_path / "every")
    rows = json.loads((tmp_path / "every" / "auto.json").read_text())["candidates"]
    ways = {(c["scheme"], c["layout"], json.dumps(c["options"]), c["cuda_graph"]) for c in rows}
    assert every["auto_timed"] == len(ways) > 2  # 0: every candidate timed (its best transport)
    with pytest.raises(ConfigError, match="integer >= 0, got -1") as err:
        attngym.run(overrides=[*common, "topology.options.shortlist=-1"], run_dir=tmp_path / "x")
    assert err.value.key == "topology.options.shortlist"


def test_a_candidate_the_model_prices_under_the_fastest_timed_one_is_timed_too():
    """The model priced a workload's all-gather at 5.38 ms a batch and Ulysses at 6.44, 20 %
    behind, outside the shortlist's margin; timed, they took 7.63 and 6.37 ms (one H100). Once
    the all-gather's timing is in, Ulysses is timed and wins; the ring (model 9.29) is not."""
    from attngym.runner.tasks.cp_auto import SHORTLIST_MARGIN, Priced, _confirm, _shortlist

    timings = {"allgather": 7.63, "ulysses": 6.37, "ring": 9.40}
    rows = [Priced(s, "contiguous", {}, False, "nccl", model_ms=ms)
            for s, ms in (("allgather", 5.38), ("ulysses", 6.44), ("ring", 9.29))]  # fmt: skip
    asked = []

    def time_one(row):
        asked.append(row.scheme)
        row.timed_ms = timings[row.scheme]

    assert 5.38 * (1 + SHORTLIST_MARGIN) < 6.44  # outside the shortlist
    for row in _shortlist(rows, 3):
        time_one(row)
    assert asked == ["allgather"]
    _confirm(rows, time_one)
    assert asked == ["allgather", "ulysses"] and min(rows, key=lambda r: r.ms).scheme == "ulysses"


def _way(c: dict) -> tuple:
    return c["scheme"], json.dumps(c["options"], sort_keys=True)


# auto.json of `topology=auto` with every candidate timed, window(1024) and four documents of 32K
# at 128K, P=8, one H100 (2026-12-06): (scheme, layout, options, twin_of, graphs, model, timed).
# Asked with the shortlist of the model's three best, auto picked 9.2 % and 5.8 % behind the best.
WINDOW_1206 = [
    ("allgather", "contiguous", {}, None, True, 0.962, 0.993),
    ("allgather", "zigzag", {}, None, True, 0.965, 1.000),
    ("allgather", "contiguous", {}, None, False, 0.962, 0.998),
    ("ring", "contiguous", {}, None, True, 0.998, 1.037),
    ("allgather", "contiguous", {"overlap": True}, {}, True, 1.144, 0.910),
    ("allgather", "zigzag", {"overlap": True}, {}, True, 1.144, 1.038),
    ("allgather", "contiguous", {"overlap": True}, {}, False, 1.312, 0.914),
    ("ulysses", "contiguous", {}, None, True, 2.026, 2.026),
]
DOCUMENTS_1206 = [
    ("allgather", "balanced", {"overlap": False}, {}, True, 9.018, 10.199),
    ("allgather", "balanced", {"overlap": False}, {}, False, 9.018, 10.212),
    ("hybrid", "contiguous", {"a2a_size": 2, "across": "allgather"}, None, False, 10.313, 10.313),
    ("hybrid", "contiguous", {"a2a_size": 2, "across": "ring"}, None, False, 10.325, 10.336),
    ("allgather", "balanced", {}, None, True, 10.451, 9.613),
    ("allgather", "balanced", {}, None, False, 10.451, 9.596),
    ("ulysses", "contiguous", {}, None, False, 10.682, 10.69),
    ("allgather", "zigzag", {}, None, True, 11.170, 9.641),
    ("ring", "zigzag", {}, None, True, 13.914, 13.95),
]


@pytest.mark.parametrize("table", [WINDOW_1206, DOCUMENTS_1206], ids=["window", "documents"])
def test_the_shortlist_times_each_way_once_with_its_twin_and_picks_within_5_percent(table):
    """The model ranked the all-gather's two ways of one call wrongly on both problems (the
    overlapped one at 0.66-0.91 of its price on the window, the plain one at 1.13 on the
    documents), and its three best were one way in three layouts or graphs. Timing each way's
    best with its twin, then whatever its way's error puts under the fastest, the pick is
    within 5 % of every candidate timed, at four timings or fewer."""
    from attngym.runner.tasks.cp_auto import (
        CONFIRM_MARGIN,
        Priced,
        _confirm,
        _scaled_by_way,
        _shortlist,
    )

    rows = [Priced(s, layout, own, graph, "nccl", model_ms=model, twin_of=twin)
            for s, layout, own, twin, graph, model, _ in table]  # fmt: skip
    timings = {r.candidate: t[-1] for r, t in zip(rows, table, strict=True)}
    asked = []

    def time_one(row):
        asked.append(row.candidate)
        row.timed_ms = timings[row.candidate]

    shortlist = _shortlist(rows, 3)
    assert len({r.way for r in shortlist}) == len(shortlist)  # one of each way
    assert any(shortlist[0].twins(r) for r in shortlist)  # the model's best, with its twin
    for row in shortlist:
        time_one(row)
    _confirm(rows, time_one, cost=_scaled_by_way(rows))
    pick = min((r for r in rows if r.timed_ms is not None), key=lambda r: r.ms)
    assert pick.ms <= min(timings.values()) * (1 + CONFIRM_MARGIN)
    assert len(asked) == len(set(asked)) <= 4


def test_the_runner_up_is_priced_in_the_picks_currency():
    """A busy machine timed the pick four times slower than the model's price: an untimed
    runner-up's price is scaled alike, never set beside the timing as is."""
    from attngym.runner.tasks.cp_auto import Priced, _runner_up

    pick = Priced("ring", "contiguous", {}, False, "gloo", model_ms=36.0, timed_ms=138.0)
    other = Priced("ulysses", "contiguous", {}, False, "gloo", model_ms=63.0)
    second, ms = _runner_up(pick, [pick, other])
    assert second is other and ms == pytest.approx(63.0 * 138.0 / 36.0) and ms >= pick.ms
    timed = Priced("allgather", "balanced", {}, False, "gloo", model_ms=30.0, timed_ms=140.0)
    assert _runner_up(pick, [pick, timed, other]) == (timed, 140.0)
    assert _runner_up(pick, [pick]) == (None, None)
    # A twin the model prices alike costs the pick's time exactly, not a rounding below it.
    ms = 25.42579199823509  # 3.0 * ms / 3.0 rounds below ms
    pick = Priced("ulysses", "contiguous", {}, False, "gloo", model_ms=3.0, timed_ms=ms)
    twin = Priced("ulysses", "zigzag", {}, False, "gloo", model_ms=3.0)
    assert _runner_up(pick, [pick, twin]) == (twin, pick.timed_ms)


def test_an_untimed_runner_up_priced_below_the_pick_is_said_to_be_a_tie():
    """_confirm leaves untimed a candidate priced within its margin of the pick's timing: the
    why names it a tie, not a negative margin."""
    from attngym.runner.tasks.cp_auto import Priced, _why

    fabric, prediction = SimpleNamespace(name="h200_nvlink"), SimpleNamespace()
    pick = Priced("ring", "contiguous", {}, False, "nccl", model_ms=10.0, timed_ms=10.0,
                  result=(None, None, None, fabric, prediction))  # fmt: skip
    other = Priced("ulysses", "contiguous", {}, False, "nccl", model_ms=9.8)
    why = _why(pick, other, 9.8, bound=False)
    assert "not timed, is priced 2.0% below it" in why and "a tie" in why
    assert "2.0% faster than ulysses" in _why(pick, other, 10.2, bound=False)


def test_graphs_that_cannot_speed_a_candidate_up_price_it_without_a_second_simulation():
    """Graphs shorten only the host's time: a candidate whose every rank is bound by its device
    (here a CPU's, its host time 0) is priced with graphs as without them, not simulated again,
    and that price is the graphs' model's own."""
    from attngym.runner.config import Benchmark, Settings, Shape, Topology
    from attngym.runner.tasks.cp_auto import ChoiceProgress, Pricing, _candidate
    from attngym.runner.tasks.cp_setup import CPRun
    from attngym.runner.tasks.cp_simulate import simulated

    settings = Settings(
        attention={"name": "causal"}, device="cpu",
        shape=Shape(batch=1, heads=2, seq_len=512, head_dim=8),
        topology=Topology(kind="auto", world_size=2, simulate=True,
                          options={"candidates": ["allgather", "ulysses"]}),
        benchmark=Benchmark(warmup=0, repeats=1), baselines=(),
    )  # fmt: skip
    pricing = Pricing(CPRun.of(settings))
    pricing.graphs = (False, True)  # as on a GPU
    metrics: dict = {}
    with ChoiceProgress(pricing.planned_count(settings), metrics) as progress:
        rows, _ = pricing.modelled(settings, progress)
    plain = {r.candidate for r in rows if not r.cuda_graph}
    graphed = [r for r in rows if r.cuda_graph]
    assert len(plain) >= 2 and len({r.candidate for r in graphed}) == len(plain)
    assert metrics["auto_simulated"] == metrics["auto_planned"] == len(plain)
    for row in graphed:
        alike = _candidate(settings, row.scheme, row.layout, "gloo", False, row.own)
        result = simulated(CPRun.of(alike), pricing.inputs, pricing.device,
                           timer=pricing.models[True])  # fmt: skip
        again = pricing.price(settings, (row.scheme, row.layout, row.own), result, True)
        assert [r.model_ms for r in again if r.transport == row.transport] == [
            pytest.approx(row.model_ms)
        ]


def test_double_zigzag_is_tried_only_where_the_layouts_name_it():
    """Ulysses' four rounds on double_zigzag measured slower than its one call on packed
    documents, and a ring or an all-gather on it runs zigzag's calls on twice the chunks: auto
    tries it where topology.options.layouts names it, for every scheme that takes it."""
    from attngym.runner.config import Settings, Shape, Topology
    from attngym.runner.tasks.cp_auto import Pricing
    from attngym.runner.tasks.cp_setup import CPRun

    def planned(**options):
        settings = Settings(
            attention={"name": "causal"}, device="cpu",
            shape=Shape(batch=1, heads=2, seq_len=512, head_dim=8),
            topology=Topology(kind="auto", world_size=2, simulate=True, layout="auto",
                              options=options),
        )  # fmt: skip
        return {(name, layout) for name, layout, _ in Pricing(CPRun.of(settings)).planned(settings)}

    default = planned()
    assert {layout for _, layout in default} == {"contiguous", "zigzag", "balanced"}
    assert ("ring", "balanced") in default and ("ulysses", "zigzag") in default
    named = planned(layouts=["double_zigzag"])
    assert {name for name, _ in named} >= {"ring", "allgather", "ulysses"}
    assert {layout for _, layout in named} == {"double_zigzag"}
