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
