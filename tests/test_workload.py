"""Workloads of packed documents: the draw and the packing, the config's checks, and a run that
validates and times every batch (rows in batches.csv, aggregates in metrics.json)."""

from __future__ import annotations

import csv
import json
import statistics

import pytest

from attngym import workload
from attngym.errors import ConfigError
from attngym.runner.config import check_config
from attngym.variants.spec import build_variant, with_documents


@pytest.mark.parametrize("distribution", ["fixed", "uniform", "lognormal", "zipf"])
def test_every_batch_packs_documents_into_the_sequence_exactly(distribution):
    made = workload.batches(distribution, count=20, seq_len=4096, seed=3, length=700,
                            min_len=32, max_len=3000, median=300)  # fmt: skip
    assert len(made) == 20
    for docs in made:
        assert sum(docs) == 4096 and min(docs) >= 1
        assert max(docs[:-1], default=0) <= 3000  # only the last one is cut to fit
    again = workload.batches(distribution, count=20, seq_len=4096, seed=3, length=700,
                             min_len=32, max_len=3000, median=300)  # fmt: skip
    assert again == made  # seeded
    if distribution == "fixed":
        assert made[0] == (700,) * 5 + (596,)


def test_a_lognormal_corpus_has_its_median_and_a_long_tail():
    docs = [n for b in workload.batches("lognormal", count=64, seq_len=131072, median=2048,
                                        sigma=1.2, max_len=65536) for n in b[:-1]]  # fmt: skip
    assert 1700 < statistics.median(docs) < 2500
    assert max(docs) > 16 * 2048  # the tail reaches far past the median


def test_a_file_gives_lengths_or_whole_batches(tmp_path):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("# a corpus\n300\n500\n\n224\n")
    assert workload.batches("file", count=2, seq_len=1024, file=lengths) == [
        (300, 500, 224), (300, 500, 224),
    ]  # fmt: skip
    given = tmp_path / "batches.txt"
    given.write_text("[1000, 24]\n[1024]\n[24, 1000]\n")
    assert workload.batches("file", count=2, seq_len=1024, file=given) == [(1000, 24), (1024,)]
    with pytest.raises(workload.WorkloadError, match="gives 3 batches, fewer than 4"):
        workload.batches("file", count=4, seq_len=1024, file=given)
    given.write_text("[1000, 20]\n")
    with pytest.raises(workload.WorkloadError, match=r"batches.txt:1: the lengths sum to 1020"):
        workload.batches("file", count=1, seq_len=1024, file=given)
    lengths.write_text("300\nabc\n")
    with pytest.raises(workload.WorkloadError, match=r"lengths.txt:2: 'abc' is not a positive"):
        workload.batches("file", count=1, seq_len=1024, file=lengths)


def _config(**workload_keys):
    return {"attention": {"name": "document", "doc_lengths": [512, 512]},
            "shape": {"seq_len": 1024},
            "workload": {"name": "documents", **workload_keys}}  # fmt: skip


def test_a_bad_workload_is_one_line_naming_its_key(tmp_path):
    with pytest.raises(ConfigError) as info:
        check_config(_config(distribution="file"))
    assert info.value.key == "workload.file"
    with pytest.raises(ConfigError) as info:
        check_config(_config(distribution="file", file=str(tmp_path / "none.txt")))
    assert info.value.key == "workload.file" and "cannot read" in str(info.value)
    with pytest.raises(ConfigError) as info:
        check_config(_config(min_len=100, max_len=50))
    assert info.value.key == "workload.max_len"
    with pytest.raises(ConfigError) as info:
        check_config({**_config(), "attention": {"name": "causal"}})
    assert info.value.key == "workload" and "has no documents" in str(info.value)
    with pytest.raises(ConfigError) as info:
        check_config(_config(distribution="gamma"))
    assert info.value.key == "workload.distribution"
    assert check_config(_config())["workload"]["batches"] == 16  # accepted, the defaults


def test_a_batch_sets_the_documents_of_a_composed_entry_and_keeps_the_rest():
    entry = {"name": "doc_window", "compose": [
        {"name": "document", "doc_lengths": [512, 512]},
        {"name": "sliding_window", "window_size": 64},
    ]}  # fmt: skip
    batch = with_documents(entry, (100, 900, 24))
    assert batch["compose"][0]["doc_lengths"] == [100, 900, 24]
    assert batch["compose"][1] == {"name": "sliding_window", "window_size": 64}
    variant = build_variant(batch, seq_len=1024)
    assert variant.varlen.documents == (100, 900, 24) and variant.varlen.left == 64


def test_a_workload_run_validates_and_times_every_batch(tmp_path, attngym_cli):
    args = ["workload=documents", "attention=document", "workload.batches=3",
            "workload.median=100", "shape.seq_len=512", "shape.heads=2", "shape.head_dim=16",
            "benchmark.warmup=0", "benchmark.repeats=2", "logger=none", "device=cpu",
            f"hydra.run.dir={tmp_path / 'run'}"]  # fmt: skip
    done = attngym_cli(args, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    with (tmp_path / "run" / "batches.csv").open() as f:
        rows = list(csv.DictReader(f))
    want = workload.batches("lognormal", count=3, seq_len=512, median=100)
    assert [int(r["documents"]) for r in rows] == [len(b) for b in want]
    assert [int(r["doc_len_max"]) for r in rows] == [max(b) for b in want]
    assert all(r["validation"] == "ok" and float(r["err_out_rel"]) < 1e-4 for r in rows)
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["workload_batches"] == 3 and metrics["validation"] == "ok"
    times = [float(r["fwd_ms"]) for r in rows]
    assert metrics["fwd_ms_mean"] == pytest.approx(statistics.fmean(times))
    assert metrics["fwd_ms_max"] == pytest.approx(max(times))
    assert metrics["tokens_per_s"] == pytest.approx(3 * 512 / (sum(times) / 1e3))
    assert "batches" in done.stdout and "tokens/s" in done.stdout
    assert (tmp_path / "run" / "batches.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.slow
def test_a_sweep_of_schemes_draws_each_jobs_batches(tmp_path, attngym_cli):
    args = ["-m", "workload=documents", "attention=document", "workload.batches=2",
            "workload.median=100", "shape.seq_len=512", "shape.heads=2", "shape.head_dim=16",
            "topology=ring,allgather", "topology.world_size=2", "benchmark.warmup=0",
            "benchmark.repeats=1", "baselines=[]", "logger=none",
            f"hydra.sweep.dir={tmp_path / 'sweep'}"]  # fmt: skip
    done = attngym_cli(args, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    from attngym.runner.pictures import batch_series

    with (tmp_path / "sweep" / "0" / "batches.csv").open() as f:
        rows = list(csv.DictReader(f))
    drawn = batch_series(rows, "ring", contenders=False)
    assert len(drawn["series"]["ring"]) == 2 and drawn["time_label"] == "fwd+bwd time (ms)"
    assert (tmp_path / "sweep" / "batches.png").read_bytes().startswith(b"\x89PNG")


def test_a_simulated_runs_batches_are_drawn_from_its_predictions():
    """Simulated ranks time nothing of their own: the picture draws the scheme's predicted time
    and PyTorch's CP with each balancer, fwd+bwd, not the best balancer twice."""
    from attngym.runner.pictures import batch_series

    rows = [{"doc_len_max": str(n), "fwd_ms": "", "fwd_bwd_ms": "",
             "predicted_fwd_ms": "1.0", "predicted_fwd_bwd_ms": str(n / 1000),
             "predicted_torch_cp_head_tail_fwd_bwd_ms": "9.0",
             "predicted_torch_cp_ptrr_fwd_bwd_ms": str(n / 900),
             "predicted_torch_cp_fwd_bwd_ms": str(n / 900), "single_fwd_bwd_ms": "30.0"}
            for n in (4096, 16384)]  # fmt: skip
    drawn = batch_series(rows, "ring (8 ranks)")
    assert drawn["time_label"] == "fwd+bwd time (ms)"
    assert drawn["series"] == {
        "ring (8 ranks), predicted": [(4096.0, 4.096), (16384.0, 16.384)],
        "torch_cp head_tail, predicted": [(4096.0, 9.0), (16384.0, 9.0)],
        "torch_cp ptrr, predicted": [(4096.0, 4096 / 900), (16384.0, 16384 / 900)],
    }
    measured = [{**r, "fwd_bwd_ms": "2.0", "varlen_fwd_bwd_ms": "3.0"} for r in rows]
    assert set(batch_series(measured, "flex")["series"]) == {"flex", "varlen"}


@pytest.mark.slow
@pytest.mark.parametrize("topology", ["ring", "allgather", "ulysses"])
def test_every_batch_of_a_cp_workload_matches_float64_forward_and_backward(
    tmp_path, attngym_cli, topology
):
    """Given batches on two CPU ranks (the reference kernel gives the CP call a backward): a
    batch of one document, and a document longer than a rank's shard of 256 tokens; each
    batch's out, dq, dk and dv against float64, and its placement planned (and timed)."""
    (tmp_path / "given.txt").write_text("[300, 200, 12]\n[512]\n[100, 412]\n")
    layout = "balanced" if topology != "ulysses" else "zigzag"
    args = ["workload=documents", "workload.distribution=file", "workload.file=given.txt",
            "workload.batches=3", "attention=document", f"topology={topology}",
            "topology.world_size=2", f"topology.layout={layout}", "shape.seq_len=512",
            "shape.heads=2", "shape.head_dim=16", "benchmark.warmup=0", "benchmark.repeats=1",
            "logger=none", f"hydra.run.dir={tmp_path / 'run'}"]  # fmt: skip
    done = attngym_cli(args, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    with (tmp_path / "run" / "batches.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [int(r["documents"]) for r in rows] == [3, 1, 2]
    for r in rows:
        assert r["validation"] == "ok"
        errors = [float(r[k]) for k in ("err_out_rel", "err_dq_rel", "err_dk_rel", "err_dv_rel")]
        assert max(errors) < 1e-4, (r["batch"], errors)  # float32 ranks against float64
        assert float(r["planning_ms"]) > 0
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["workload_batches"] == 3 and metrics["planning_ms_max"] > 0


@pytest.mark.slow
def test_the_ranks_start_once_for_all_batches(tmp_path, monkeypatch):
    """A CP workload starts its ranks once: each batch is their next run, not a new launch."""
    import attngym
    from attngym.distributed.ranks import launch as launching

    launches = []
    real = launching.launch
    monkeypatch.setattr(launching, "launch", lambda *a, **k: launches.append(a) or real(*a, **k))
    metrics = attngym.run(
        overrides=["workload=documents", "workload.batches=2", "workload.median=100",
                   "attention=document", "topology=ring", "topology.world_size=2",
                   "shape.seq_len=256", "shape.heads=2", "shape.head_dim=8", "baselines=[]",
                   "benchmark.warmup=0", "benchmark.repeats=1", "logger=none", "device=cpu"],
        run_dir=tmp_path / "run",
    )  # fmt: skip
    assert len(launches) == 1
    assert metrics["workload_batches_done"] == 2 and metrics["validation"] == "ok"
    with (tmp_path / "run" / "batches.csv").open() as f:
        assert len(list(csv.DictReader(f))) == 2


DOC_WINDOW = '''
import torch

def doc_window(doc_lengths, window=64, device="cpu"):
    """A causal window inside each document: the document ids from the batch's lengths."""
    ids = torch.repeat_interleave(torch.arange(len(doc_lengths)), torch.tensor(doc_lengths))
    ids = ids.to(device)

    def mask_mod(b, h, q_idx, kv_idx):
        same = ids[q_idx] == ids[kv_idx]
        return same & (q_idx >= kv_idx) & (q_idx - kv_idx <= window)

    return mask_mod
'''


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_your_own_factory_gets_each_batchs_documents(tmp_path, attngym_cli, ranks):
    """A mask factory that takes doc_lengths is called with each batch's (no value needed in
    the config); every batch validated against float64, on one device and on two CPU ranks
    (forward and backward there)."""
    (tmp_path / "docmasks.py").write_text(DOC_WINDOW)
    topology = ["topology=ring", "topology.world_size=2", "topology.layout=balanced"]
    args = ["workload=documents", "workload.batches=2", "workload.median=120",
            "attention=custom", "attention.mask_mod=docmasks.doc_window",
            "attention.mask_args.window=16", "shape.seq_len=512", "shape.heads=2",
            "shape.head_dim=16", "benchmark.warmup=0", "benchmark.repeats=1", "logger=none",
            "device=cpu", f"hydra.run.dir={tmp_path / 'run'}",
            *(topology if ranks == 2 else [])]  # fmt: skip
    done = attngym_cli(args, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    want = workload.batches("lognormal", count=2, seq_len=512, median=120)
    assert f"doc_window(doc_lengths={list(want[0])}, window=16" in done.stdout  # as it was read
    with (tmp_path / "run" / "batches.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 and all(r["validation"] == "ok" for r in rows)
    for row, docs in zip(rows, want, strict=True):  # each batch's mask is its documents' windows
        kept = sum(min(i, 16) + 1 for n in docs for i in range(n))
        assert float(row["mask_density"]) == pytest.approx(kept / 512**2, rel=1e-6)
    if ranks == 2:
        assert all(float(r["err_dq_rel"]) < 1e-4 for r in rows)


# topology=auto on the batches given in given.txt, two simulated CPU ranks.
AUTO_ON_GIVEN_BATCHES = [
    "workload=documents", "workload.distribution=file", "workload.file=given.txt",
    "attention=document", "topology=auto", "topology.simulate=true", "topology.world_size=2",
    "device=cpu", "shape.seq_len=512", "shape.heads=2", "shape.head_dim=8", "validate=false",
    "baselines=[]", "benchmark.warmup=0", "benchmark.repeats=1", "logger=none",
]  # fmt: skip


@pytest.mark.slow
def test_auto_picks_one_scheme_for_the_whole_workload_and_prices_picking_per_batch(
    tmp_path, monkeypatch
):
    import attngym
    from attngym import viz

    (tmp_path / "given.txt").write_text("[512]\n[64, 64, 64, 64, 256]\n")
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    drawn, draw = [], viz.save_batch_times

    def drawing(series, path, **kw):  # batches.png: which lines it draws
        drawn.append(list(series))
        return draw(series, path, **kw)

    monkeypatch.setattr(viz, "save_batch_times", drawing)
    metrics = attngym.run(
        overrides=[*AUTO_ON_GIVEN_BATCHES, "workload.batches=2"],
        run_dir=run,
    )  # fmt: skip
    table = json.loads((run / "auto.json").read_text())
    assert table["pick"] == metrics["auto_pick"] and len(table["per_batch_best"]) == 2
    first = table["candidates"][0]  # the least total over both batches
    assert metrics["auto_pick"].startswith(f"{first['scheme']}/{first['layout']}")
    assert metrics["topology"] == first["scheme"]  # every batch ran the one pick
    assert metrics["layout"] == first["layout"]
    rounds = ", in rounds" * bool(metrics.get("pipeline"))
    # batches.png: the pick's line, named with its layout
    assert drawn == [[f"{first['scheme']}, {first['layout']}{rounds} (2 ranks), predicted"]]
    assert all(c["predicted_ms"] >= first["predicted_ms"] for c in table["candidates"])
    assert first["predicted_ms"] == pytest.approx(sum(first["batches_ms"]) / 2)
    # The pick was timed on one typical batch, its price on the other scaled by it.
    assert table["timed_on_batch"] in (0, 1) and metrics["auto_timed"] >= 1
    assert first["timed_over_model"] is not None
    for c in table["candidates"]:  # each batch's price is the model's, times the ratio if timed
        assert c["predicted_ms"] == pytest.approx(c["model_ms"] * (c["timed_over_model"] or 1))
    # Picking per batch: each batch's best, plus the planning its switches cost.
    best = sum(min(c["batches_ms"][i] for c in table["candidates"]) for i in (0, 1))
    assert metrics["auto_dynamic_switches"] in (0, 1)
    assert (metrics["auto_dynamic_cost_ms"] > 0) == (metrics["auto_dynamic_switches"] == 1)
    gain = 1 - (best + metrics["auto_dynamic_cost_ms"]) / (2 * first["predicted_ms"])
    assert metrics["auto_dynamic_gain"] == pytest.approx(gain)
    assert metrics["workload_batches_done"] == 2
    with (run / "batches.csv").open() as f:  # a simulated batch's placement planned and timed
        assert all(float(r["planning_ms"]) > 0 for r in csv.DictReader(f))


@pytest.mark.slow
def test_auto_prices_every_candidate_on_three_probe_batches_then_those_within_reach(
    tmp_path, monkeypatch
):
    """A workload's candidates are all priced on the least, median and most causal work and
    those that could win timed on one of them; after them only the calls within REACH of the
    best (with their twins) are simulated again, and the count of simulations planned comes out
    right."""
    import attngym
    from attngym.runner.tasks import cp_auto

    (tmp_path / "given.txt").write_text(
        "[512]\n[64, 64, 64, 64, 256]\n[256, 256]\n[128, 128, 128, 128]\n[384, 128]\n"
    )
    assert cp_auto._probes([(512,), (64,) * 4 + (256,), (256, 256), (128,) * 4, (384, 128)]) == [
        0,  # the most work
        2,  # the median
        3,  # the least
    ]
    reached = []

    def allgather_only(probed, factor):  # as if the model put every other scheme out of reach
        calls = {r.call for rows in probed for r in rows.values()}
        reached.append(dict(factor))  # the timings on a probe, taken before
        return {c for c in calls if c[0] == "allgather"}

    monkeypatch.setattr(cp_auto, "_within_reach", allgather_only)
    monkeypatch.chdir(tmp_path)
    metrics = attngym.run(
        overrides=[*AUTO_ON_GIVEN_BATCHES, "workload.batches=5"],
        run_dir=tmp_path / "run",
    )  # fmt: skip
    table = json.loads((tmp_path / "run" / "auto.json").read_text())
    assert len(reached) == 1 and table["probe_batches"] == [0, 2, 3]
    assert reached[0] and table["timed_on_batch"] in (0, 2, 3)
    assert {c["scheme"] for c in table["candidates"]} == {"allgather"}
    assert table["left_after_probes"] and all(
        not label.startswith("allgather/") for label in table["left_after_probes"]
    )
    assert metrics["auto_pick"].startswith("allgather/")
    assert metrics["auto_simulated"] == metrics["auto_planned"]  # the skipped ones not counted


def test_within_reach_keeps_calls_priced_at_most_reach_times_the_best_and_their_twins():
    from attngym.runner.tasks.cp_auto import REACH, Priced, _within_reach

    def rows(**prices):
        made = {}
        for name, (ms, own, twin) in prices.items():
            scheme, layout = name.split("_")
            row = Priced(scheme, layout, own, False, "nccl", model_ms=ms, twin_of=twin)
            made[row.candidate, row.transport] = row
        return made

    probe = rows(
        allgather_balanced=(1.0, {}, None),
        allgather_zigzag=(REACH + 0.5, {"overlap": True}, {}),  # out of reach
        ring_balanced=(REACH - 0.1, {}, None),
        ulysses_contiguous=(REACH + 0.1, {}, None),
    )
    overlap = Priced("allgather", "balanced", {"overlap": True}, False, "nccl", 9.0, twin_of={})
    probe[overlap.candidate, overlap.transport] = overlap  # far out, but a kept call's twin
    calls = _within_reach([probe, probe], {})
    assert calls == {("allgather", "balanced", "{}"), ("ring", "balanced", "{}")}
    assert overlap.call in calls
    # Timed on a probe: the ring twice its price (out of reach), Ulysses 0.8 of it (in).
    ring, ulysses = (next(k for k in probe if k[0][0] == s) for s in ("ring", "ulysses"))
    calls = _within_reach([probe, probe], {ring: 2.0, ulysses: 0.8})
    assert calls == {("allgather", "balanced", "{}"), ("ulysses", "contiguous", "{}")}
