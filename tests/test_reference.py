"""The dense oracle against torch's SDPA and against its own conventions.

Everything runs in float64, where SDPA's math path and the reference differ only by summation
order: for these sizes (S <= 64, D = 16, O(1) inputs) that is ~1e-15, so 1e-12 leaves three orders
of margin while still catching any real difference (a wrong scale or mask moves results by > 1e-2).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from attngym import reference
from attngym.variants import compose, get

TOL64 = {"rtol": 1e-12, "atol": 1e-12}


def rand(rng, *shape, dtype=torch.float64, grad=False):
    return torch.randn(*shape, generator=rng, dtype=dtype).requires_grad_(grad)


def qkv(rng, b=2, h=4, g=4, s=48, d=16, grad=False):
    """Random (B, H, S, D) queries and (B, G, S, D) keys and values, float64."""
    q = rand(rng, b, h, s, d, grad=grad)
    return q, rand(rng, b, g, s, d, grad=grad), rand(rng, b, g, s, d, grad=grad)


def independent_lse(q, k, scale, causal):
    """logsumexp over keys of the scaled (optionally causal) scores, written out directly."""
    score = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    if causal:
        s = score.shape[-1]
        score = score.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), -math.inf)
    return torch.logsumexp(score, dim=-1)


@pytest.mark.parametrize("name", ["full", "causal"])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_matches_sdpa_forward_and_backward(rng, name, scale):
    q, k, v = qkv(rng, grad=True)
    variant = get(name)
    out, lse = reference.attention(q, k, v, variant.score_mod, variant.mask_mod, scale=scale)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=name == "causal", scale=scale)
    torch.testing.assert_close(out, want, **TOL64)
    eff_scale = scale if scale is not None else 1 / math.sqrt(q.shape[-1])
    torch.testing.assert_close(lse, independent_lse(q, k, eff_scale, name == "causal"), **TOL64)

    dout = rand(rng, *out.shape)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    want_grads = torch.autograd.grad(want, (q, k, v), dout)
    for got, exp in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, exp, **TOL64)


def test_gqa_matches_sdpa(rng):
    q, k, v = qkv(rng, h=6, g=2, grad=True)
    out, _ = reference.attention(q, k, v, None, get("causal").mask_mod)
    # query head h reads kv head h // 3: the same as repeating each kv head 3 times
    want = F.scaled_dot_product_attention(
        q, k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1), is_causal=True
    )
    torch.testing.assert_close(out, want, **TOL64)
    dout = rand(rng, *out.shape)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    want_grads = torch.autograd.grad(want, (q, k, v), dout)
    for got, exp in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, exp, **TOL64)


def test_gqa_matches_sdpa_enable_gqa(rng):
    q, k, v = qkv(rng, h=4, g=1)
    out, _ = reference.attention(q, k, v)
    want = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.testing.assert_close(out, want, **TOL64)


def test_fully_masked_rows_give_zero_out_minus_inf_lse_and_zero_grads(rng):
    q, k, v = qkv(rng, s=16, grad=True)

    def mask_mod(b, h, q_idx, kv_idx):  # rows 0..2 have no key at all
        return (q_idx >= 3) & (kv_idx <= q_idx)

    out, lse = reference.attention(q, k, v, None, mask_mod)
    assert torch.equal(out[:, :, :3], torch.zeros_like(out[:, :, :3]))
    assert torch.isneginf(lse[:, :, :3]).all()
    assert torch.isfinite(lse[:, :, 3:]).all()

    finite = torch.isfinite(lse)
    loss = (out * rand(rng, *out.shape)).sum() + (lse[finite] * rand(rng, int(finite.sum()))).sum()
    dq, dk, dv = torch.autograd.grad(loss, (q, k, v))
    for g in (dq, dk, dv):
        assert torch.isfinite(g).all()
    assert torch.equal(dq[:, :, :3], torch.zeros_like(dq[:, :, :3]))
    assert dq[:, :, 3:].abs().sum() > 0

    # the kept rows are exactly causal attention restricted to rows >= 3
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out[:, :, 3:], want[:, :, 3:], **TOL64)


def test_q_positions_subset_equals_rows_of_full(rng):
    q, k, v = qkv(rng, s=64)
    variant = compose(get("sliding_window", window_size=9), get("alibi", num_heads=4))
    out, lse = reference.attention(q, k, v, variant.score_mod, variant.mask_mod)
    rows = torch.tensor([0, 5, 17, 40, 63])
    sub_out, sub_lse = reference.attention(
        q[:, :, rows], k, v, variant.score_mod, variant.mask_mod, q_positions=rows
    )
    torch.testing.assert_close(sub_out, out[:, :, rows], **TOL64)
    torch.testing.assert_close(sub_lse, lse[:, :, rows], **TOL64)


def test_kv_positions_chunk_equals_full_with_keys_restricted(rng):
    q, k, v = qkv(rng, s=64)
    variant = compose(get("causal"), get("relative_position"))
    lo, hi = 16, 40

    def in_chunk(b, h, q_idx, kv_idx):
        return variant.mask_mod(b, h, q_idx, kv_idx) & (kv_idx >= lo) & (kv_idx < hi)

    out, lse = reference.attention(q, k, v, variant.score_mod, in_chunk)
    chunk_out, chunk_lse = reference.attention(
        q[:, :, 32:],
        k[:, :, lo:hi],
        v[:, :, lo:hi],
        variant.score_mod,
        variant.mask_mod,
        q_positions=torch.arange(32, 64),
        kv_positions=torch.arange(lo, hi),
    )
    torch.testing.assert_close(chunk_out, out[:, :, 32:], **TOL64)
    torch.testing.assert_close(chunk_lse, lse[:, :, 32:], **TOL64)


def test_float32_mode_close_to_float64(rng):
    q, k, v = qkv(rng)
    variant = compose(get("causal"), get("softcap", soft_cap=5.0))
    out64, lse64 = reference.attention(q, k, v, variant.score_mod, variant.mask_mod)
    out32, lse32 = reference.attention(
        q, k, v, variant.score_mod, variant.mask_mod, dtype=torch.float32
    )
    assert out32.dtype == lse32.dtype == torch.float32
    assert out64.dtype == lse64.dtype == torch.float64
    # float32 rounding (eps 6e-8) over D=16 products and 48-term sums of O(1) values: ~1e-6
    torch.testing.assert_close(out32.double(), out64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse32.double(), lse64, rtol=1e-5, atol=1e-5)


def test_score_mod_backward_passes_gradcheck(rng):
    q, k, v = qkv(rng, b=1, h=2, g=1, s=6, d=4, grad=True)
    variant = compose(get("sliding_window", window_size=2), get("softcap", soft_cap=1.5))

    def fn(q, k, v):
        out, lse = reference.attention(q, k, v, variant.score_mod, variant.mask_mod)
        return out, lse

    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_value_head_dim_may_differ(rng):
    q, k, _ = qkv(rng, s=8)
    v = rand(rng, 2, 4, 8, 24)
    out, _ = reference.attention(q, k, v)
    assert out.shape == (2, 4, 8, 24)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), **TOL64)


def test_rejects_bad_dtype_and_shapes(rng):
    q, k, v = qkv(rng, s=8)
    with pytest.raises(ValueError, match="dtype"):
        reference.attention(q, k, v, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="4-D"):
        reference.attention(q[0], k, v)
    with pytest.raises(ValueError, match="kv heads"):
        reference.attention(q, k[:, :3], v[:, :3])


def test_accepts_float32_inputs_in_float64_mode(rng):
    q, k, v = qkv(rng, s=8)
    out, lse = reference.attention(q.float(), k.float(), v.float())
    assert out.dtype == lse.dtype == torch.float64
