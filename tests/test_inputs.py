"""Seeded inputs: the same draw for the same shape and seed, shaped for GQA."""

from __future__ import annotations

import pytest
import torch

from attngym.inputs import TORCH_DTYPES, make_inputs, torch_dtype
from attngym.runner.config import Shape


def test_make_inputs_are_seeded_random_and_shaped():
    shape = Shape(batch=1, heads=2, kv_heads=1, seq_len=128, head_dim=16)
    q, k, v, g = make_inputs(shape, 3, "cpu", torch.float32)
    assert q.shape == (1, 2, 128, 16) and k.shape == v.shape == (1, 1, 128, 16)
    assert g.shape == q.shape and q.std() > 0.5 and not torch.equal(q, g)
    q2, *_ = make_inputs(shape, 3, "cpu", torch.float32, requires_grad=True)
    assert torch.equal(q, q2.detach()) and q2.requires_grad


def test_torch_dtype_names():
    assert torch_dtype("bfloat16") is torch.bfloat16 and set(TORCH_DTYPES) >= {"float32", "float64"}
    with pytest.raises(ValueError, match=r"unknown dtype 'float8'.*float16"):
        torch_dtype("float8")


def test_the_draw_is_the_same_however_many_threads_draw_its_chunks(monkeypatch):
    from attngym import inputs

    monkeypatch.setattr(inputs, "DRAW_CHUNK", 1000)  # q of 4,096 numbers: five chunks
    shape = Shape(batch=1, heads=2, seq_len=128, head_dim=16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = make_inputs(shape, 5, "cpu", torch.float32)
        torch.set_num_threads(max(2, threads))
        many = make_inputs(shape, 5, "cpu", torch.float32)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(one, many, strict=True))
    flat = one[0].flatten()
    assert not torch.equal(flat[:1000], flat[1000:2000])  # each chunk its own numbers
    assert not torch.equal(make_inputs(shape, 6, "cpu", torch.float32)[0], one[0])
