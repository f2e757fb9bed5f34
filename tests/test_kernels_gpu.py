"""Compiled FlexAttention on CUDA in bf16 against the float64 reference, forward and backward.

Run on a GPU machine with `pytest -m gpu tests/test_kernels_gpu.py`; without CUDA every test here is
skipped by the `gpu` marker (tests/conftest.py).

Tolerance: norm-wise relative error ||a - b|| / ||b|| <= 2e-2 for out, lse and the gradients of q, k
and v. Both sides see the same bf16 inputs (the reference upcasts them to float64), so what differs
is the kernel's own rounding: bf16 has a unit roundoff of 2^-9 ~ 2e-3, and the kernel rounds the
probabilities to bf16 before P @ V and its outputs and gradients to bf16 at the end; those
rounding errors are independent per element, so norm-wise they stay near 2e-3 instead of growing
with S. The backward chains a few more such roundings (dP, then dS = P * (dP - delta), then dS @ K
and dS^T @ Q), which we expect to land around 5e-3 to 1e-2. 2e-2 keeps a margin over that and is
still far below what a wrong mask, offset or head index produces (norm-wise errors of 1e-1 and up).
"""

from __future__ import annotations

import pytest
import torch

from attngym import reference
from attngym.kernels import attend_chunk
from attngym.variants import Variant, compose, get, names

pytestmark = pytest.mark.gpu

B, H, D = 2, 4, 64
S = 256
REL_TOL = 2e-2


def catalogue_case(name: str, seq_len: int) -> Variant:
    """An instance of every catalogue variant that fits `seq_len` tokens (seq_len % 64 == 0)."""
    params = {
        "full": {},
        "causal": {},
        "sliding_window": {"window_size": 37},
        "bidirectional_sliding_window": {"window_size": 37},
        "dilated_sliding_window": {"window_size": 50, "dilation": 3},
        "sliding_window_sinks": {"window_size": 33, "num_sinks": 5},
        "prefix_lm": {"prefix_length": 77},
        "document": {"doc_lengths": [61, 3, seq_len - 124, 60]},
        "chunked_causal": {"chunk_size": 48},
        "natten": {"canvas_w": 16, "canvas_h": seq_len // 16, "kernel_w": 5, "kernel_h": 4},
        "alibi": {"num_heads": H},
        "softcap": {"soft_cap": 0.8},
        "relative_position": {},
        "gemma2": {"window_size": 37, "soft_cap": 0.8},
        "global_sliding_window": {"window_size": 37, "global_tokens": [0, 101]},
        "shared_prefix": {
            "doc_lengths": [61, 23, seq_len - 140, 56],
            "prefix_of": [0, 0, 0, 3],
        },
        "block_diffusion": {"clean_length": seq_len // 2, "block_size": 48},
    }
    if name not in params:
        raise KeyError(f"no GPU test case for variant {name!r}: add one to catalogue_case")
    return get(name, **params[name])


def all_cases(seq_len: int) -> dict[str, Variant]:
    cases = {n: catalogue_case(n, seq_len) for n in names()}
    cases["sliding_window+softcap"] = compose(cases["sliding_window"], cases["softcap"])
    cases["document+alibi"] = compose(cases["document"], cases["alibi"])
    return cases


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each variant is a new score_mod/mask_mod, hence a recompile of the one compiled
    flex_attention; resetting keeps every test under Dynamo's recompile limit (past it, Dynamo
    would silently run eagerly and this file would stop testing the compiled kernel)."""
    torch._dynamo.reset()
    yield


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def check_against_reference(variant, q_len, kv_len, *, q_offset=0, kv_offset=0, kv_heads=H):
    """Compiled bf16 flex vs float64 reference on one chunk pair: out, lse and their gradients."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    variant = variant.to("cuda")

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=dtype)

    q = randn(B, H, q_len, D).requires_grad_()
    k = randn(B, kv_heads, kv_len, D).requires_grad_()
    v = randn(B, kv_heads, kv_len, D).requires_grad_()
    dout = randn(B, H, q_len, D)
    dlse = randn(B, H, q_len, dtype=torch.float32)

    out, lse = attend_chunk(
        q,
        k,
        v,
        variant,
        q_offset=torch.tensor(q_offset, device="cuda"),
        kv_offset=torch.tensor(kv_offset, device="cuda"),
        backend="flex",
        compile=True,
    )
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    # rows with no key in this chunk pair have lse = -inf: they take no lse gradient
    kept = torch.isfinite(lse)
    loss = (out.float() * dout.float()).sum() + torch.where(kept, lse * dlse, 0).sum()
    grads = torch.autograd.grad(loss, (q, k, v))

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want_out, want_lse = reference.attention(
        q64,
        k64,
        v64,
        variant.score_mod,
        variant.mask_mod,
        q_positions=torch.arange(q_len, device="cuda") + q_offset,
        kv_positions=torch.arange(kv_len, device="cuda") + kv_offset,
    )
    want_kept = torch.isfinite(want_lse)
    assert torch.equal(kept, want_kept), "rows without keys differ from the reference"
    assert torch.isneginf(lse[~kept]).all()
    want_loss = (want_out * dout.double()).sum() + torch.where(
        want_kept, want_lse * dlse.double(), 0
    ).sum()
    want_grads = torch.autograd.grad(want_loss, (q64, k64, v64))

    errors = {"out": rel_err(out, want_out), "lse": rel_err(lse[kept], want_lse[kept])}
    errors.update(
        {f"d{n}": rel_err(g, w) for n, g, w in zip("qkv", grads, want_grads, strict=True)}
    )
    bad = {n: e for n, e in errors.items() if not e <= REL_TOL}
    assert not bad, f"relative errors above {REL_TOL}: {bad} (all: {errors})"


@pytest.mark.parametrize("case", sorted(all_cases(S)))
def test_compiled_flex_matches_reference(case):
    check_against_reference(all_cases(S)[case], S, S)


@pytest.mark.parametrize("case", ["causal", "sliding_window_sinks", "document+alibi", "natten"])
def test_compiled_flex_chunk_pair_at_offsets(case):
    # q chunk 3 of 4 against kv chunk 2: global positions through 0-d tensor offsets; all but
    # causal leave some rows without a key there (out 0, lse -inf)
    chunk = S // 4
    check_against_reference(
        all_cases(S)[case], chunk, chunk, q_offset=3 * chunk, kv_offset=2 * chunk
    )


@pytest.mark.parametrize("case", ["causal", "alibi", "document+alibi"])
def test_compiled_flex_gqa(case):
    check_against_reference(all_cases(S)[case], S, S, kv_heads=2)


@pytest.mark.parametrize("case", ["causal", "document+alibi", "sliding_window+softcap"])
def test_flash_backend_matches_reference(case):
    """BACKEND=FLASH (flash-attn-4, where installed): its kernel runs, out, lse and the gradients
    through out match the reference, and the lse carries no gradient (FLASH has none)."""
    pytest.importorskip("flash_attn.cute")
    from attngym.device import get_flash_block_size
    from attngym.profiling import cuda_kernel_profiler

    variant = all_cases(S)[case].to("cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (
        torch.randn(B, H, S, D, generator=gen, device="cuda", dtype=torch.bfloat16)
        for _ in range(4)
    )
    inputs = tuple(t.requires_grad_() for t in (q, k, v))
    with cuda_kernel_profiler("flash_attncute") as kernels:
        out, lse = attend_chunk(
            *inputs,
            variant,
            backend="flex",
            block_size=get_flash_block_size(),
            kernel_options={"BACKEND": "FLASH"},
        )
    assert kernels["found"], kernels["kernel_names"]
    assert not lse.requires_grad
    grads = torch.autograd.grad(out, inputs, dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in inputs)
    want_out, want_lse = reference.attention(q64, k64, v64, variant.score_mod, variant.mask_mod)
    want_grads = torch.autograd.grad(want_out, (q64, k64, v64), dout.double())
    errors = {"out": rel_err(out, want_out), "lse": rel_err(lse, want_lse)}
    errors.update(
        {f"d{n}": rel_err(g, w) for n, g, w in zip("qkv", grads, want_grads, strict=True)}
    )
    bad = {n: e for n, e in errors.items() if not e <= REL_TOL}
    assert not bad, f"relative errors above {REL_TOL}: {bad} (all: {errors})"
