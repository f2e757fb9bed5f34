"""Device resolution, the flash block size, device facts and peak memory."""

from __future__ import annotations

import inspect
import logging
import pathlib
import sys

import pytest
import torch

from attngym import device, utils


def test_seed_signature():
    params = inspect.signature(utils.get_flash_block_size).parameters.values()
    assert [(p.name, p.default) for p in params] == [("device", "cuda")]


def test_flash_block_size_on_cpu():
    assert utils.get_flash_block_size("cpu") == (128, 128)


@pytest.mark.parametrize("name", ["cpu", "CPU", " cpu ", torch.device("cpu")])
def test_resolve_device_accepts_cpu(name):
    assert device.resolve_device(name) == torch.device("cpu")


def test_auto_without_cuda_is_cpu_and_logged(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level(logging.INFO, logger="attngym.device"):
        assert device.resolve_device("auto") == torch.device("cpu")
    assert "device=auto resolved to cpu" in caplog.text


@pytest.mark.parametrize("name", ["cuda", "cuda:0", "cuda:3"])
def test_explicit_cuda_without_cuda_is_an_error(monkeypatch, name):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"device='cuda.*not available.*device='cpu'"):
        device.resolve_device(name)


@pytest.mark.parametrize("name", ["tpu", "cuda:x", "", 3, None])
def test_unknown_device_names_list_the_choices(name):
    with pytest.raises(ValueError, match="device must be one of auto, cpu, cuda, cuda:N"):
        device.resolve_device(name)


def test_device_info_on_cpu():
    info = device.device_info("cpu")
    assert info["type"] == "cpu"
    assert info["torch"] == torch.__version__
    assert info["capability"] is None
    assert info["count"] >= 1 and info["name"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="resets the peak RSS via /proc")
def test_cpu_peak_memory_sees_an_allocation_and_resets():
    size = 256 << 20
    device.reset_peak_memory("cpu")
    before = device.peak_memory_bytes("cpu")
    block = torch.empty(size, dtype=torch.uint8)
    block.fill_(7)  # touch every page so it is resident
    peak = device.peak_memory_bytes("cpu")
    assert peak >= before + size * 0.9
    del block
    device.reset_peak_memory("cpu")
    assert device.peak_memory_bytes("cpu") < peak - size * 0.5  # the large block went back


@pytest.mark.gpu
def test_cuda_facts_and_memory():
    major, _ = torch.cuda.get_device_capability()
    assert utils.get_flash_block_size() == ((256, 128) if major >= 10 else (128, 128))
    info = device.device_info("cuda")
    assert info["type"] == "cuda" and info["capability"].startswith(str(major))
    held = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")
    live = device.reset_peak_memory("cuda")
    assert live >= held.numel()
    x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    assert device.peak_memory_bytes("cuda") - live >= x.numel()
    assert device.resolve_device("auto") == torch.device("cuda")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_cpu_peak_is_the_regions_own_not_what_the_process_already_holds():
    size = 128 << 20
    held = torch.empty(2 * size, dtype=torch.uint8)
    held.fill_(1)  # an earlier job's leftovers: resident before the region starts
    with device.peak_memory("cpu") as first:
        block = torch.empty(size, dtype=torch.uint8)
        block.fill_(7)
        del block
    with device.peak_memory("cpu") as second:
        pass
    assert size * 0.9 <= first["bytes"] < 2 * size  # the block, not the 256 MB held before
    assert second["bytes"] < size * 0.5  # a later region is not charged for the earlier one
    del held


def test_cpu_name_is_a_model_not_the_architecture():
    name = device.device_info("cpu")["name"]
    assert name == device.cpu_model() and name
    cpuinfo = pathlib.Path("/proc/cpuinfo")
    if cpuinfo.exists() and "model name" in cpuinfo.read_text():
        assert name not in ("x86_64", "aarch64")
