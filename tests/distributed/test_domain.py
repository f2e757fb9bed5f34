"""NVLink-domain detection and the copy-engine argument/misuse checks that need no CUDA."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from attngym.distributed.transport import copy_engine, domain
from attngym.distributed.transport.copy_engine import CopyEngineAllGather, CopyEngineChannel
from attngym.distributed.transport.parts import ChannelSteps as _ChannelSteps
from attngym.distributed.transport.parts import as_parts as _as_parts


@pytest.fixture(autouse=True)
def _fresh_probe_cache():
    domain._fabric_domain.cache_clear()
    yield
    domain._fabric_domain.cache_clear()


# ----------------------------------------------------------------------------- nvlink_domain


def test_import_pulls_in_no_heavy_module():
    code = (
        "import sys, attngym.distributed.transport.copy_engine\n"
        "import attngym.distributed.transport.domain\n"
        "bad = [m for m in ('cuda.bindings', 'torch.distributed._symmetric_memory') "
        "if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_nvlink_domain_is_host_name_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert domain.nvlink_domain() == socket.gethostname()


def test_nvlink_domain_falls_back_when_nvml_is_absent(monkeypatch, caplog):
    monkeypatch.setattr(domain, "_gpu_uuid", lambda device: "GPU-0000")
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    probed = []
    monkeypatch.setattr(domain, "_run_probe", lambda uuid: probed.append(uuid))
    with caplog.at_level("INFO", logger=domain.__name__):
        assert domain.nvlink_domain() == socket.gethostname()
    assert probed == []  # no subprocess when the package is missing
    assert "nvidia-ml-py" in caplog.text


@pytest.mark.parametrize(
    "source, reason",
    [
        ("import os; os._exit(139)", "exited with status 139"),
        ("print('not json')", "printed no answer"),
        ("import json; print(json.dumps({'reason': 'NVML: Not Supported'}))", "Not Supported"),
    ],
)
def test_nvlink_domain_falls_back_when_the_probe_fails(monkeypatch, caplog, source, reason):
    """A crashing, confused or refusing NVML probe never reaches the caller."""
    monkeypatch.setattr(domain, "_gpu_uuid", lambda device: "GPU-0000")
    monkeypatch.setitem(sys.modules, "pynvml", type(sys)("pynvml"))
    monkeypatch.setattr(domain, "_PROBE_SOURCE", source)
    with caplog.at_level("INFO", logger=domain.__name__):
        assert domain.nvlink_domain() == socket.gethostname()
    assert reason in caplog.text


def test_nvlink_domain_uses_the_fabric_when_the_probe_answers(monkeypatch):
    monkeypatch.setattr(domain, "_gpu_uuid", lambda device: "GPU-0000")
    monkeypatch.setitem(sys.modules, "pynvml", type(sys)("pynvml"))
    answer = "nvlink-fabric:ab12:7"
    monkeypatch.setattr(
        domain, "_PROBE_SOURCE", f"import json; print(json.dumps({{'domain': {answer!r}}}))"
    )
    assert domain.nvlink_domain() == answer
    monkeypatch.setattr(domain, "_PROBE_SOURCE", "raise SystemExit(3)")
    assert domain.nvlink_domain() == answer  # probed once per GPU, then cached


def test_in_one_nvlink_domain_needs_a_process_group():
    if dist.is_initialized():
        pytest.skip("a default process group exists in this process")
    with pytest.raises(RuntimeError, match="initialised"):
        domain.in_one_nvlink_domain()


def _domain_worker(rank: int, world: int, init_file: str, split: bool, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        if split:
            domain.nvlink_domain = lambda device=None: f"host-{rank}"
        results[rank] = domain.in_one_nvlink_domain()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("split", [False, True])
def test_in_one_nvlink_domain_on_two_gloo_ranks(split):
    with tempfile.TemporaryDirectory() as tmp:
        results = mp.get_context("spawn").Manager().dict()
        mp.spawn(
            _domain_worker,
            args=(2, os.path.join(tmp, "init"), split, results),
            nprocs=2,
            join=True,
        )
    assert dict(results) == {0: not split, 1: not split}


# ----------------------------------------------------------------------------- copy-engine checks


GOOD = dict(dtype=torch.bfloat16, device="cuda")


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(part_shape=(), num_parts=2, dim=0), "part_shape"),
        (dict(part_shape=(2, 0), num_parts=2, dim=0), "part_shape"),
        (dict(part_shape=(2, 4), num_parts=0, dim=0), "num_parts"),
        (dict(part_shape=(2, 4), num_parts=2, dim=2), "dim"),
        (dict(part_shape=(2, 4), num_parts=2, dim=0, dtype="bf16"), "dtype"),
        (dict(part_shape=(2, 4), num_parts=2, dim=0, device="cpu"), "device"),
        (dict(part_shape=(2, 4), num_parts=2, dim=0, timeout_s=0), "timeout_s"),
    ],
)
def test_all_gather_rejects_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name}"):
        CopyEngineAllGather(**{**GOOD, **kwargs})


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(part_shape=(2, -1), num_parts=2), "part_shape"),
        (dict(part_shape=(2, 4), num_parts=True), "num_parts"),
        (dict(part_shape=(2, 4), num_parts=2, device="meta"), "device"),
        (dict(part_shape=(2, 4), num_parts=2, timeout_s=-1.0), "timeout_s"),
    ],
)
def test_channel_rejects_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name}"):
        CopyEngineChannel(**{**GOOD, **kwargs})


def test_good_arguments_get_as_far_as_the_process_group():
    """Accepted arguments fail only on what is missing here: a process group."""
    if dist.is_initialized():
        pytest.skip("a default process group exists in this process")
    with pytest.raises(RuntimeError, match="torch.distributed"):
        CopyEngineAllGather((2, 4, 8), 2, -1, **GOOD)
    with pytest.raises(RuntimeError, match="torch.distributed"):
        CopyEngineChannel([2, 4, 8], 2, **GOOD, timeout_s=5)


def _no_cuda_worker(rank: int, init_file: str, errors) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        for make in (
            lambda: CopyEngineChannel((4, 8), 2, **GOOD, src=2),
            lambda: CopyEngineChannel((4, 8), 2, **GOOD),
        ):
            try:
                make()
            except (ValueError, RuntimeError) as exc:
                errors[(rank, len(errors))] = f"{type(exc).__name__}: {exc}"
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_copy_engine_with_a_group_but_no_cuda():
    with tempfile.TemporaryDirectory() as tmp:
        errors = mp.get_context("spawn").Manager().dict()
        mp.spawn(_no_cuda_worker, args=(os.path.join(tmp, "init"), errors), nprocs=2, join=True)
    messages = sorted(errors.values())
    assert len(messages) == 4
    assert (
        sum(m.startswith("ValueError: src: expected a group rank in [0, 2)") for m in messages) == 2
    )
    assert (
        sum(m.startswith("RuntimeError: copy-engine transports need CUDA") for m in messages) == 2
    )


def test_as_parts_accepts_a_sequence_or_a_stacked_tensor(rng):
    k, v = torch.randn(3, 4, generator=rng), torch.randn(3, 4, generator=rng)
    for given in ([k, v], (k, v), torch.stack([k, v])):
        got = _as_parts(given, 2, (3, 4), torch.float32, torch.device("cpu"))
        assert len(got) == 2 and torch.equal(got[0], k) and torch.equal(got[1], v)
    strided = torch.randn(4, 3, generator=rng).t()
    (got,) = _as_parts([strided], 1, (3, 4), torch.float32, torch.device("cpu"))
    assert got.is_contiguous() and torch.equal(got, strided)


@pytest.mark.parametrize(
    "parts, match",
    [
        (lambda k: [k], r"parts: expected 2 tensors, got 1"),
        (lambda k: [k, k[:1]], r"parts\[1\]: expected shape"),
        (lambda k: [k, k.double()], r"parts\[1\]: expected dtype"),
        (lambda k: torch.stack([k, k, k]), r"parts: expected a tensor of shape \(2, 3, 4\)"),
        (lambda k: [k, 3], r"parts\[1\]: expected a tensor"),
    ],
)
def test_as_parts_rejects_wrong_parts(rng, parts, match):
    k = torch.randn(3, 4, generator=rng)
    with pytest.raises(ValueError, match=match):
        _as_parts(parts(k), 2, (3, 4), torch.float32, torch.device("cpu"))


def test_channel_steps_accept_a_ring_sequence_twice():
    steps = _ChannelSteps()
    for _ in range(2):
        for i in range(4):
            if i + 1 < 4:
                steps.on_send(i)
            if i > 0:
                steps.on_release(i)
            if i + 1 < 4:
                steps.on_recv(i + 1)
        assert steps.held == set()


@pytest.mark.parametrize(
    "calls, match",
    [
        ([("send", 1)], r"send\(1\) out of order"),
        ([("send", 0), ("send", 2)], r"send\(2\) out of order"),
        ([("recv", 0)], r"recv .* >= 1"),
        ([("recv", 2)], r"recv\(2\) out of order"),
        ([("recv", 1), ("recv", 2), ("recv", 3)], r"step 1, which is still held"),
        ([("release", 1)], r"release\(1\) without a matching recv\(1\)"),
        ([("recv", 1), ("release", 1), ("release", 1)], r"release\(1\) without"),
        ([("recv", 1), ("recv", 1)], r"recv\(1\) twice"),
        ([("recv", 1), ("release", 1), ("recv", 2), ("recv", 2)], r"recv\(2\) twice"),
        ([("recv", 1), ("release", 1), ("recv", 2), ("recv", 1)], r"recv\(1\) starts a new"),
    ],
)
def test_channel_steps_reject_misuse(calls, match):
    steps = _ChannelSteps()
    *ok, (last, i) = calls
    for name, j in ok:
        getattr(steps, f"on_{name}")(j)
    with pytest.raises((RuntimeError, ValueError), match=match):
        getattr(steps, f"on_{last}")(i)


def test_channel_steps_reject_a_non_int_step():
    with pytest.raises(ValueError, match="^i: expected an int step"):
        _ChannelSteps().on_send(1.0)


def test_watchdog_expires_a_stuck_wait():
    """The watchdog calls the owner back once a wait outlives its deadline, not before."""
    expired = []

    class Owner:
        def _expire(self, item):
            expired.append(item.what)

    class Event:
        def __init__(self, done):
            self.done = done

        def query(self):
            return self.done

    dog = copy_engine._Watchdog()
    now = copy_engine.time.monotonic()
    dog.watch(copy_engine._Watch(Owner(), Event(False), now - 1.0, 0, "stuck"))
    dog.watch(copy_engine._Watch(Owner(), Event(True), now - 1.0, 1, "finished"))
    dog.watch(copy_engine._Watch(Owner(), Event(False), now + 60.0, 2, "pending"))
    deadline = now + 5.0
    while not expired and copy_engine.time.monotonic() < deadline:
        copy_engine.time.sleep(0.01)
    copy_engine.time.sleep(0.05)
    assert expired == ["stuck"]
