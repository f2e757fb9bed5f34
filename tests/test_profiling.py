"""Profilers: the seed's kernel profiler, chrome traces, and the registered profiler factories."""

from __future__ import annotations

import inspect
import json
import os

import pytest
import torch

from attngym import profiling, registry, utils


def work(rng):
    a = torch.randn(64, 64, generator=rng)
    return (a @ a).relu().sum()


def test_seed_signature():
    params = inspect.signature(utils.cuda_kernel_profiler).parameters.values()
    assert [(p.name, p.default) for p in params] == [("kernel_pattern", "flash_attncute")]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only behaviour")
def test_cuda_kernel_profiler_runs_on_cpu(rng):
    with utils.cuda_kernel_profiler("gemm") as result:
        work(rng)
    assert result == {"found": False, "kernel_names": []}


def test_chrome_trace_writes_json_with_events(rng, tmp_path):
    path = tmp_path / "traces" / "trace.json"
    with profiling.chrome_trace(path) as result:
        work(rng)
    assert result["trace_path"] == str(path)
    assert isinstance(result["kernel_names"], list)
    trace = json.loads(path.read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any("matmul" in n or "mm" in n for n in names), sorted(names)[:20]


def test_chrome_trace_disabled_profiles_nothing(rng, tmp_path):
    with profiling.chrome_trace(tmp_path / "t.json", enabled=False) as result:
        work(rng)
    assert result == {}
    assert not (tmp_path / "t.json").exists()


def test_registered_profilers(rng, tmp_path):
    assert {"none", "kernels", "trace"} <= set(registry.names("profiler"))

    with registry.build("profiler", "none", run_dir=tmp_path) as result:
        work(rng)
    assert result == {}

    with registry.build("profiler", "kernels", run_dir=tmp_path, rank=1) as result:
        work(rng)
    assert isinstance(result["found"], bool) and isinstance(result["kernel_names"], list)
    kernels = (tmp_path / "kernels_rank1.txt").read_text().split()
    assert kernels == result["kernel_names"]

    with registry.build("profiler", "trace", run_dir=tmp_path) as result:
        work(rng)
    assert result["trace_path"] == str(tmp_path / "trace_rank0.json")
    assert json.loads((tmp_path / "trace_rank0.json").read_text())["traceEvents"]


def test_profiler_factories_reject_unknown_parameters(tmp_path):
    with pytest.raises(ValueError, match="kernel_pattern"):
        registry.build("profiler", "trace", run_dir=tmp_path, kernel_pattern="x")


@pytest.mark.gpu
def test_cuda_kernel_profiler_finds_a_kernel():
    a = torch.randn(512, 512, device="cuda")
    with utils.cuda_kernel_profiler("gemm") as result:
        a @ a
        torch.cuda.synchronize()
    assert result["kernel_names"]
    assert result["found"] == any("gemm" in n for n in result["kernel_names"])


def test_a_trace_prints_no_usdt_lines(tmp_path, capfd):
    # Kineto writes `USDT: ... profiler_start` / `profiler_stop` to fd 2 on every profile.
    with profiling.chrome_trace(tmp_path / "t.json"):
        torch.ones(3).sum()
    assert "USDT:" not in capfd.readouterr().err


def test_only_usdt_lines_are_dropped(capfd):
    with profiling._without_usdt_lines():
        os.write(2, b"USDT:2026-01-01 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"a real warning\n")
    assert capfd.readouterr().err == "a real warning\n"
