"""The context-parallel tasks end to end: `python -m attngym +experiment=...` on 2 gloo ranks.

What a user runs on a CPU box: ranks are spawned by the run, validated against the float64
reference, timed, compared with one device, and the run folder holds the metrics, the pictures
and the other rank's log. float32 on CPU: the reference chunk kernel computes in float32, so
errors stay near 1e-6; 1e-4 leaves room for the merge order.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from attngym.runner.config import Benchmark, Settings, Shape, Topology
from attngym.runner.tasks.context_parallel import torch_cp_skip_reason
from attngym.runner.tasks.phases import NO_CPU_BWD
from attngym.validation import add_failure


@pytest.mark.parametrize(
    ("experiment", "layout"),
    [
        ("ring_attention", "contiguous"),
        ("allgather_attention", "zigzag"),
        ("ulysses_attention", "zigzag"),
    ],
)
def test_cp_experiment_runs_validated_on_cpu(tmp_path, experiment, layout):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "attngym",
            f"+experiment={experiment}",
            f"topology.layout={layout}",
            "shape.seq_len=512",
            "shape.heads=2",
            "logger=none",
            f"hydra.run.dir={run_dir}",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "ATTNGYM_PROGRESS": "0"},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["status"] == "ok" and metrics["validation"] == "ok"
    assert metrics["topology"] == experiment.split("_")[0]
    assert (metrics["world_size"], metrics["transport"], metrics["layout"]) == (2, "gloo", layout)
    assert metrics["err_out_rel"] < 1e-4 and metrics["err_dq_rel"] < 1e-4
    assert metrics["err_dk_rel"] < 1e-4 and metrics["err_dv_rel"] < 1e-4
    if experiment == "ulysses_attention":  # one flex call per rank over the whole sequence
        assert metrics["pairs_computed"] == 2 and metrics["load_imbalance"] == 1.0  # summed
        assert metrics["err_lse_max_abs"] is None  # ulysses keeps no lse to compare
    else:
        assert metrics["pairs_skipped"] > 0  # causal: some (q chunk, kv chunk) pairs are empty
    assert metrics["efficiency"] > 0 and metrics["single_fwd_ms"] > 0
    assert metrics["efficiency_fwd_bwd"] > 0 and metrics["single_fwd_bwd_ms"] > 0
    for key in ("efficiency", "efficiency_fwd_bwd"):  # 5 calls a side: the interval holds it
        lo, hi = metrics[f"{key}_ci95"]
        assert lo <= metrics[key] <= hi
    # CPU peak memory is what the timed region adds to the process's resident set: none grows
    # when the allocator reuses freed pages, and that is recorded as not measured (None), never
    # as 0 B (> 0 on GPUs).
    for key in ("peak_mem_bytes", "torch_cp_peak_mem_bytes"):
        assert metrics[key] is None or metrics[key] > 0, key
    assert metrics["load_imbalance"] >= 1.0
    # How near the limit, as one device's run says it: the causal mask keeps (S + 1) / 2S of the
    # entries (exact), and a CPU says in one place what it cannot measure.
    assert metrics["mask_density"] == pytest.approx(513 / 1024)
    assert metrics["flops_spent_over_kept"] == pytest.approx((1 - metrics["sparsity"]) * 1024 / 513)
    assert metrics["not_measured"].startswith("fraction of peak (no peak for cpu devices); energy")
    assert metrics["fwd_peak_fraction"] is None and "fwd_joules" not in metrics
    # PyTorch's own CP ran on the same shards (the presets list it): its forward agrees with
    # attngym's on the validated rows (both float32 over the same blocks: ~1e-7 measured), its
    # backward is recorded as missing on CPU.
    assert metrics["torch_cp_status"] == "ok" and metrics["torch_cp_validation"] == "ok"
    assert metrics["torch_cp_err_out_rel"] < 1e-5
    assert metrics["torch_cp_bwd_status"] == NO_CPU_BWD
    assert metrics["torch_cp_fwd_ms"] > 0 and metrics["attngym_over_torch_cp_fwd"] > 0
    assert "torch_cp_fwd_bwd_ms" not in metrics
    for name in ("heatmap.png", "block_mask.png", "rank1.log"):
        assert (run_dir / name).stat().st_size > 0, name
    assert "efficiency" in proc.stdout and "transport" in proc.stdout


def test_cp_sweep_under_torchrun_runs_every_job_in_the_same_ranks(tmp_path):
    """`torchrun -m attngym -m ...`: each rank runs the jobs in turn (compiled kernels and process
    group stay warm between them); rank 0 alone writes metrics, pictures and the summary."""
    sweep_dir = tmp_path / "sweep"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "HYDRA_"))}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "-m",
            "attngym",
            "-m",
            f"hydra.sweep.dir={sweep_dir}",
            "+experiment=ring_attention",
            "topology.world_size=2",
            "shape.seq_len=256,512",
            "shape.heads=2",
            "logger=none",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "ATTNGYM_PROGRESS": "0"},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    # Rank 1 leaves the summary to rank 0.
    assert (proc.stdout + proc.stderr).count("summary in") == 1
    rows = (sweep_dir / "summary.csv").read_text().splitlines()
    assert len(rows) == 3 and all(",ok," in row for row in rows[1:]), rows
    summary = (sweep_dir / "summary.md").read_text()
    assert "efficiency_fwd_bwd" in summary and "step_transfer_ms" in summary
    assert "attngym_over_torch_cp_fwd" in summary and "load_imbalance" in summary
    for job in ("0", "1"):
        metrics = json.loads((sweep_dir / job / "metrics.json").read_text())
        assert metrics["validation"] == "ok" and metrics["efficiency_fwd_bwd"] > 0
        assert "rank 1 done" in (sweep_dir / job / "rank1.log").read_text()
        assert "rank 1" not in (sweep_dir / job / "attngym.log").read_text()  # rank 0's alone


WRAPPER = """
import os
import attngym.runner.tasks.context_parallel as cp
from attngym.runner import cli

real = cp.one_device


def failing(job):
    if job.seq_len == 512 and os.environ["RANK"] == "0" and "FAIL" in os.environ:
        raise RuntimeError("injected failure on rank 0")
    return real(job)


cp.one_device = failing
cli.entry()
"""


def test_torchrun_sweep_stops_at_a_rank_failure_and_resumes(tmp_path):
    """A failure on one rank may leave the ranks at different collectives: the sweep stops at once
    (no rank waits for a peer's timeout), the summary covers the jobs so far, and the same command
    run again skips the jobs already ok."""
    script = tmp_path / "wrap.py"
    script.write_text(WRAPPER)
    sweep_dir = tmp_path / "sweep"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "HYDRA_"))}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        str(script),
        "-m",
        f"hydra.sweep.dir={sweep_dir}",
        "+experiment=ring_attention",
        "topology.world_size=2",
        "topology.timeout_s=60",
        "shape.seq_len=256,512,1024",
        "shape.heads=2",
        "logger=none",
    ]
    env.update(ATTNGYM_PROGRESS="0")
    failed = subprocess.run(
        command, capture_output=True, text=True, timeout=50, env={**env, "FAIL": "1"}
    )  # well inside topology.timeout_s: nobody waited for a peer to time out
    assert failed.returncode != 0
    assert "stopping the sweep" in failed.stdout + failed.stderr
    rows = (sweep_dir / "summary.csv").read_text().splitlines()
    assert len(rows) == 3 and ",ok," in rows[1] and "injected failure" in rows[2], rows
    assert not (sweep_dir / "2").exists()
    resumed = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert "already ok" in resumed.stdout + resumed.stderr
    rows = (sweep_dir / "summary.csv").read_text().splitlines()
    assert len(rows) == 4 and all(",ok," in row for row in rows[1:]), rows


def _settings(**topology):
    return Settings(
        attention={"name": "causal"},
        device="cpu",
        shape=Shape(batch=1, heads=2, seq_len=topology.pop("seq_len", 512), head_dim=8),
        topology=Topology(**{"kind": "ring", "world_size": 2, **topology}),
        benchmark=Benchmark(warmup=0, repeats=1),
        baselines=("torch_cp",),
    )


def _first_on_device(rank, world_size, devices):
    """Every rank's answer for `devices` (one device name per rank), gathered on every rank."""
    from attngym.runner.tasks.context_parallel import first_on_device

    mine = first_on_device(torch.device(devices[rank]), rank, world_size)
    every = [None] * world_size
    torch.distributed.all_gather_object(every, mine)
    return every


@pytest.mark.parametrize(
    ("devices", "first"),
    [(("cpu", "cpu", "cpu"), [True, False, False]), (("cpu", "meta", "cpu"), [True, True, False])],
)
def test_the_lowest_rank_on_a_device_speaks_for_it(devices, first):
    """Energy is read from a device's counter, which holds every process on it: of the ranks that
    share a device only the lowest counts it."""
    from attngym.distributed.ranks.launch import launch

    assert launch(_first_on_device, 3, args=(devices,), timeout_s=60) == first


def test_every_topology_is_a_registered_task_and_its_spec_the_registry_entry():
    from attngym import registry
    from attngym.distributed.schemes.topologies import TOPOLOGIES

    assert (
        registry.names("topology")
        == sorted(TOPOLOGIES)
        == ["allgather", "auto", "custom", "hybrid", "ring", "ulysses"]
    )
    for name, spec in TOPOLOGIES.items():
        assert registry.get("topology", name) is spec and spec.name == name
        assert name in registry.names("task")
        # The spec's function is its algorithm module's public one.
        module = sys.modules[spec.attention.__module__]
        assert module.__name__.startswith("attngym.distributed.")
        assert getattr(module, spec.attention.__name__) is spec.attention
    from attngym.distributed.schemes.hybrid import HybridOptions

    assert registry.get("topology", "hybrid").options is HybridOptions
    assert registry.get("topology", "ulysses").layouts == ("contiguous", "zigzag", "double_zigzag")
    assert registry.get("topology", "hybrid").layouts == ("contiguous", "zigzag")
    with pytest.raises(ValueError, match=r"unknown topology 'rnig'.*did you mean 'ring'"):
        registry.get("topology", "rnig")


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({}, None),
        ({"layout": "zigzag"}, None),
        ({"layout": "balanced"}, None),  # resharded into PyTorch's balancers' placements
        ({"seq_len": 384}, "divisible by world_size x 128"),
        ({"block_size": (64, 64)}, "PyTorch's CP uses (128, 128) blocks"),
        ({"backend": "gloo"}, "crashed on gloo"),
        ({"backend": "gloo", "device_type": "cpu"}, None),
    ],
)
def test_torch_cp_skip_reasons_name_what_differs(change, reason):
    settings = _settings(**{k: v for k, v in change.items() if k in ("layout", "seq_len")})
    if "block_size" in change:
        settings.block_size = change["block_size"]
    where = {k: v for k, v in change.items() if k in ("device_type", "backend")}
    got = torch_cp_skip_reason(settings, 2, **where)
    assert got is None if reason is None else reason in got


def test_torch_cp_disagreement_fails_the_run_verdict():
    agreed = {"validation": "ok", "torch_cp_validation": "ok"}
    add_failure(agreed, agreed["torch_cp_validation"], "attngym and torch_cp disagree")
    assert agreed["validation"] == "ok"
    bad = "failed: torch_cp_err_out_rel=0.3 > 0.0002 (float32)"
    alone = {"validation": "ok", "torch_cp_validation": bad}
    add_failure(alone, alone["torch_cp_validation"], "attngym and torch_cp disagree")
    assert alone["validation"] == (
        "failed: attngym and torch_cp disagree: torch_cp_err_out_rel=0.3 > 0.0002 (float32)"
    )
    both = {"validation": "failed: err_out_rel=0.5 > 0.0001 (float32)", "torch_cp_validation": bad}
    add_failure(both, both["torch_cp_validation"], "attngym and torch_cp disagree")
    assert (
        both["validation"].startswith("failed: err_out_rel=0.5")
        and "disagree" in both["validation"]
    )


@pytest.mark.multigpu
@pytest.mark.parametrize(
    ("experiment", "layout"), [("ring_attention", "zigzag"), ("allgather_attention", "contiguous")]
)
def test_cp_run_on_two_gpus_times_torch_cp_forward_and_backward(
    tmp_path, attngym_cli, experiment, layout
):
    """On CUDA the contender runs both passes, on the same shards, next to attngym's numbers.
    bf16: both kernels are within 2e-2 of the float64 reference, so of each other within 4e-2."""
    run_dir = tmp_path / "run"
    proc = attngym_cli(
        [
            f"+experiment={experiment}",
            "topology.world_size=2",
            f"topology.layout={layout}",
            "shape.seq_len=8192",
            "shape.heads=4",
            "shape.head_dim=64",
            "logger=none",
            f"hydra.run.dir={run_dir}",
        ],
        tmp_path,
        env={"ATTNGYM_PROGRESS": "0", "NCCL_NVLS_ENABLE": "0"},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["validation"] == "ok" and metrics["torch_cp_validation"] == "ok"
    assert (metrics["torch_cp_status"], metrics["torch_cp_bwd_status"]) == ("ok", "ok")
    assert metrics["torch_cp_err_out_rel"] < 4e-2
    for name in ("torch_cp_fwd_ms", "torch_cp_fwd_bwd_ms", "attngym_over_torch_cp_fwd_bwd"):
        assert metrics[name] > 0, name
    assert metrics["peak_mem_bytes"] > 0 and metrics["torch_cp_peak_mem_bytes"] > 0


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("topology", "layout", "attention"),
    [("ring", "zigzag", "causal"), ("allgather", "contiguous", "sliding_window")],
)
def test_cp_run_with_cuda_graphs_is_validated_and_timed(
    tmp_path, attngym_cli, topology, layout, attention
):
    """topology.cuda_graph=true: each rank's call captured as forward and backward graphs, the
    replays validated against float64 and timed, the one-device call graphed alike (two ranks
    share one GPU over the copy engine where the box has one)."""
    run_dir = tmp_path / "run"
    one_gpu = torch.cuda.device_count() < 2
    proc = attngym_cli(
        [
            f"topology={topology}",
            "topology.world_size=2",
            f"topology.layout={layout}",
            "topology.cuda_graph=true",
            *(["topology.transport=copy_engine"] if one_gpu else []),
            f"attention={attention}",
            "shape.seq_len=4096",
            "shape.heads=4",
            "shape.head_dim=64",
            "baselines=[]",
            "logger=none",
            f"hydra.run.dir={run_dir}",
        ],
        tmp_path,
        env={"ATTNGYM_PROGRESS": "0", "NCCL_NVLS_ENABLE": "0",
             **({"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1"} if one_gpu else {})},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["validation"] == "ok", metrics
    for name in ("fwd_ms", "bwd_ms", "fwd_bwd_ms", "single_fwd_bwd_ms"):
        assert metrics[name] > 0, name


@pytest.mark.gpu
def test_a_call_that_cannot_be_captured_is_refused_naming_the_key():
    """A call that reads a value back to the host mid-call cannot be a CUDA graph: the run
    fails on topology.cuda_graph, not on a CUDA error."""
    from attngym.errors import ConfigError
    from attngym.runner.tasks import phases

    x = torch.randn(64, device="cuda", requires_grad=True)

    def attend():
        return x * (2.0 if x.sum().item() > 0 else 3.0)  # .item(): a host sync

    rank = phases.Rank(attend=attend, leaves=(x,), grad_out=torch.ones_like(x),
                       device=x.device, warmup=1, repeats=1)  # fmt: skip
    with pytest.raises(ConfigError, match="cannot be captured") as info:
        phases.graphed(rank)
    assert info.value.key == "topology.cuda_graph"


def test_ulysses_heads_and_layout_are_checked_before_any_rank_starts():
    from attngym.errors import ConfigError
    from attngym.runner.tasks.context_parallel import check_hardware
    from attngym.runner.tasks.cp_setup import CPRun

    settings = _settings(kind="ulysses", world_size=3, seq_len=768)  # 2 heads over 3 ranks
    with pytest.raises(ConfigError, match=r"shape.heads: 2 query heads cannot be split over 3"):
        check_hardware(CPRun.of(settings))
    allowed = r"contiguous, double_zigzag, zigzag"
    with pytest.raises(ConfigError, match=rf"topology.layout: .*'balanced'.*{allowed}"):
        check_hardware(CPRun.of(_settings(kind="ulysses", layout="balanced")))
    check_hardware(CPRun.of(_settings(kind="ulysses", layout="zigzag")))


def test_hybrid_task_on_four_ranks_matches_the_reference(tmp_path):
    """topology=hybrid: Ulysses in two groups of 2 gloo ranks, ring across them, the task end to
    end. The task is called with its Settings, not through the CLI: the CLI's config check
    refuses more ranks than CPU cores (attngym.estimate), and this box has 2; the composition of
    topology=hybrid is checked in tests/test_config.py."""
    from attngym import registry

    settings = _settings(kind="hybrid", world_size=4, options={"a2a_size": 2})
    settings.validate_rows = 64
    metrics = registry.get("task", "hybrid")(settings, tmp_path)
    assert metrics["validation"] == "ok"
    assert (metrics["topology"], metrics["world_size"], metrics["transport"]) == (
        "hybrid",
        4,
        "gloo",
    )
    assert (metrics["a2a_size"], metrics["across"]) == (2, "ring")
    # float32 against the float64 reference, as the module docstring says.
    for name in ("err_out_rel", "err_dq_rel", "err_dk_rel", "err_dv_rel"):
        assert metrics[name] < 1e-4, name
    assert metrics["step_transfer_ms"] is None  # two levels of transfers: no one step
    assert metrics["err_lse_max_abs"] is None  # an lse of head slices: none reported
    # PyTorch's CP on the same shards agrees (both float32 over the same blocks).
    assert metrics["torch_cp_status"] == "ok" and metrics["torch_cp_validation"] == "ok"
    assert metrics["efficiency"] > 0 and metrics["pairs_computed"] > 0
    # Causal over the 2 groups in contiguous order: the second group attends more blocks.
    assert metrics["load_imbalance"] > 1.0


def test_hybrid_layout_is_checked_before_any_rank_starts():
    from attngym.errors import ConfigError
    from attngym.runner.tasks.context_parallel import check_hardware
    from attngym.runner.tasks.cp_setup import CPRun

    with pytest.raises(ConfigError, match=r"topology.layout: .*'balanced'.*contiguous, zigzag"):
        check_hardware(CPRun.of(_settings(kind="hybrid", layout="balanced")))
    check_hardware(CPRun.of(_settings(kind="hybrid", layout="zigzag")))


def test_hybrid_group_size_from_the_domains_is_checked_as_config(tmp_path):
    """a2a_size=None takes the ranks of one NVLink domain (here the host: all 4), known only on
    the ranks: 2 heads cannot be split over 4, a ConfigError naming shape.heads (exit 2), not a
    rank failure."""
    from attngym import registry
    from attngym.errors import ConfigError

    settings = _settings(kind="hybrid", world_size=4)
    with pytest.raises(ConfigError, match=r"shape.heads: 2 query heads cannot be split over 4"):
        registry.get("task", "hybrid")(settings, tmp_path)


def test_one_device_comparison_out_of_memory_keeps_the_run(caplog, monkeypatch):
    """The whole problem on one device is optional: out of memory there leaves the comparison
    empty (or the forward's alone) and a warning, not a failed run that loses its measurements."""
    from types import SimpleNamespace

    from attngym import bench, variants
    from attngym.bench import Timing
    from attngym.distributed import CPOptions
    from attngym.runner.tasks.context_parallel import one_device

    settings = _settings()
    shape = settings.shape
    whole = [torch.randn(1, shape.heads, shape.seq_len, shape.head_dim) for _ in range(4)]
    done = Timing.from_times([1.0])
    job = SimpleNamespace(
        rank=0, settings=settings, seq_len=shape.seq_len, device=torch.device("cpu"),
        timings={"fwd": Timing.from_times([0.5]), "fwd_bwd": done},
        whole=whole, variant=variants.get("causal"), block_mask=None, world_size=2, kind="ring",
        options=CPOptions(),
    )  # fmt: skip
    for fails_at, want in ((1, {}), (2, {"single_fwd_ms": 1.0, "efficiency": 1.0})):
        calls = []

        def time_fn(fn, fails_at=fails_at, calls=calls, **kwargs):
            calls.append(fn)
            if len(calls) == fails_at:  # wrapped, as a compiler may raise it
                try:
                    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64 GiB")
                except torch.OutOfMemoryError as oom:
                    raise RuntimeError("compiling failed") from oom
            return done

        monkeypatch.setattr(bench, "time_fn", time_fn)
        with caplog.at_level("WARNING"):
            metrics = one_device(job)
        assert {k: v for k, v in metrics.items() if v is not None} == want
        assert "does not fit on one device (CUDA out of memory." in caplog.text
    # Any other failure is the run's.
    monkeypatch.setattr(bench, "time_fn", lambda fn, **kwargs: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        one_device(job)


def _phases_recording_rank(rank, world_size, settings):
    """The CP task's rank body with tasks.phases.time_passes recording what it is asked."""
    import attngym.runner.tasks.context_parallel as cp
    from attngym.runner.tasks import phases

    real, seen = phases.time_passes, []

    def recording(rank_ctx, passes, call=None, **kwargs):
        seen.append((passes, call is None, rank_ctx.max_over_ranks is phases._same))
        return real(rank_ctx, passes, call, **kwargs)

    phases.time_passes = recording
    metrics = cp._rank_run(rank, world_size, settings, "ring")
    return {**metrics, "time_passes": seen}


TIMING_KEYS = {
    "first_call_s",
    "peak_mem_bytes",
    "fwd_ms",
    "fwd_ms_min",
    "fwd_ms_max",
    "bwd_ms",
    "fwd_bwd_ms",
    "fwd_tflops",
    "bwd_tflops",
    "fwd_bwd_tflops",
}


def test_single_and_cp_tasks_time_through_the_same_phases(tmp_path):
    """Both tasks time their measured call with tasks.phases (the single device at world size
    1), so first_call_s, the pass timings and peak_mem_bytes are the same keys with one meaning."""
    from attngym.distributed.ranks.launch import launch
    from attngym.runner.tasks import single

    settings = _settings(seq_len=256)
    settings.validate_rows = 16
    cp_metrics = launch(_phases_recording_rank, 2, args=(settings,), timeout_s=120)
    assert cp_metrics["validation"] == "ok"
    # attngym's passes over the ranks (the CPU ranks have a backward), torch_cp's forward alone
    # (flex has no CPU backward) over the ranks, once with each of PyTorch's balancers that place
    # causal (head-tail, PTRR), the one-device run's at world size 1.
    assert cp_metrics["time_passes"] == [
        (("fwd", "bwd", "fwd_bwd"), True, False),
        (("fwd",), False, False),
        (("fwd",), False, False),
        (("fwd", "fwd_bwd"), True, True),
    ]
    one = single.run(
        Settings(
            attention={"name": "causal"},
            shape=settings.shape,
            benchmark=settings.benchmark,
            baselines=(),
            validate_rows=16,
        ),
        tmp_path,
    )
    for metrics in (cp_metrics, one):
        assert set(metrics) >= TIMING_KEYS
        assert metrics["fwd_ms"] > 0 and metrics["first_call_s"] > 0
    assert cp_metrics["bwd_ms"] > 0 and one["bwd_ms"] is None  # flex has no CPU backward
    assert one["bwd_status"] == NO_CPU_BWD and cp_metrics["bwd_status"] == "ok"


def test_torch_cp_runs_each_of_pytorchs_balancers_beside_a_balanced_layout(tmp_path, attngym_cli):
    """attngym balanced against PyTorch's CP with head-tail and PTRR (its shards resharded into
    each one's placement), each validated against attngym's output; per-document head-tail
    skipped with why (these documents are not multiples of 2 x 2 ranks), the fastest named."""
    args = ["attention=document", "topology=ring", "topology.world_size=2",
            "topology.layout=balanced", "shape.seq_len=512", "shape.heads=2", "shape.head_dim=16",
            "benchmark.warmup=0", "benchmark.repeats=1", "logger=none",
            f"hydra.run.dir={tmp_path / 'run'}"]  # fmt: skip
    done = attngym_cli(args, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    m = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert m["torch_cp_status"] == "ok" and m["torch_cp_validation"] == "ok"
    assert m["torch_cp_head_tail_status"] == m["torch_cp_ptrr_status"] == "ok"
    assert "divisible by 2 x 2" in m["torch_cp_per_document_head_tail_status"]
    fastest = min(("head_tail", "ptrr"), key=lambda b: m[f"torch_cp_{b}_fwd_ms"])
    assert m["torch_cp_balancer"] == fastest
    assert m["torch_cp_fwd_ms"] == m[f"torch_cp_{fastest}_fwd_ms"]
    assert m["torch_cp_err_out_rel"] < 1e-5  # float32 on both sides


def test_the_metric_table_names_pytorchs_balancers():
    from attngym.distributed.schemes.torch_cp import BALANCERS
    from attngym.metrics import PLACEHOLDERS

    assert PLACEHOLDERS["balancer"][0].split("|") == list(BALANCERS)
