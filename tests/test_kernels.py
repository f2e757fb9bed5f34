"""Eager FlexAttention (the CPU "flex" backend) against the float64 reference, for every variant.

Tolerance: eager flex on CPU materialises the float32 score matrix and applies the same callbacks,
so the only difference from the float64 reference is float32 rounding (eps 6e-8) of D=16 dot
products, the softmax and an S<=256-term sum of O(1) values: measured < 1e-6 for O(1) scores, so
atol = rtol = 1e-5 leaves a 10x margin while a wrong mask, offset or head index (errors of 1e-2
and up) fails. Score mods that make scores large (relative_position adds up to S-1) lose absolute
precision in proportion: a float32 score of magnitude M is off by up to M * 6e-8, which exp() turns
into a relative error of each weight (measured 1.3e-5 in out at M = 255). The tolerance therefore
grows linearly once the largest score M exceeds 64: 1e-5 * max(1, M / 64).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from attngym import reference
from attngym.kernels import attend_chunk, block_mask_is_empty, make_block_mask
from attngym.variants import Variant, compose, get, names

B, H, D = 2, 4, 16
S = 128
BLOCK = (32, 32)


def catalogue_case(name: str, seq_len: int) -> Variant:
    """An instance of every catalogue variant that fits `seq_len` tokens (seq_len % 32 == 0).

    Sizes are deliberately not multiples of the block size, so block edges cut through windows,
    chunks and documents.
    """
    params = {
        "full": {},
        "causal": {},
        "sliding_window": {"window_size": 13},
        "bidirectional_sliding_window": {"window_size": 13},
        "dilated_sliding_window": {"window_size": 20, "dilation": 3},
        "sliding_window_sinks": {"window_size": 17, "num_sinks": 5},
        "prefix_lm": {"prefix_length": 37},
        "document": {"doc_lengths": [29, 3, seq_len - 72, 40]},
        "chunked_causal": {"chunk_size": 24},
        "natten": {"canvas_w": 16, "canvas_h": seq_len // 16, "kernel_w": 5, "kernel_h": 4},
        "alibi": {"num_heads": H},
        "softcap": {"soft_cap": 0.8},
        "relative_position": {},
        "gemma2": {"window_size": 13, "soft_cap": 0.8},
        "global_sliding_window": {"window_size": 13, "global_tokens": [0, 41]},
        "shared_prefix": {
            "doc_lengths": [23, 11, seq_len - 60, 26],
            "prefix_of": [0, 0, 0, 3],
        },
        "block_diffusion": {"clean_length": seq_len // 2, "block_size": 24},
    }
    if name not in params:
        raise KeyError(f"no test case for variant {name!r}: add one to catalogue_case")
    return get(name, **params[name])


def all_cases(seq_len: int) -> dict[str, Variant]:
    cases = {n: catalogue_case(n, seq_len) for n in names()}
    cases["sliding_window+softcap"] = compose(cases["sliding_window"], cases["softcap"])
    cases["document+alibi"] = compose(cases["document"], cases["alibi"])
    return cases


CASE_IDS = sorted(all_cases(S))


def rand_qkv(rng, seq_len: int, kv_heads: int = H):
    q = torch.randn(B, H, seq_len, D, generator=rng)
    k = torch.randn(B, kv_heads, seq_len, D, generator=rng)
    v = torch.randn(B, kv_heads, seq_len, D, generator=rng)
    return q, k, v


def tolerance(q, k, variant: Variant) -> dict[str, float]:
    """atol = rtol = 1e-5, widened for cases whose largest score M exceeds 64 (module docstring)."""
    k = k.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    score = (q.double() @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    if variant.score_mod is not None:
        pos = torch.arange(q.shape[2])
        b, h, q_idx, kv_idx = reference.index_grids(q.shape[0], q.shape[1], pos, pos)
        score = variant.score_mod(score, b, h, q_idx, kv_idx)
    tol = 1e-5 * max(1.0, score.abs().max().item() / 64)
    return {"rtol": tol, "atol": tol}


def test_every_variant_has_a_case():
    for name in names():
        catalogue_case(name, S)  # raises KeyError for a variant added without a case


@pytest.mark.parametrize("case", CASE_IDS)
def test_flex_matches_reference(rng, case):
    variant = all_cases(S)[case]
    variant.check_seq_len(S)
    q, k, v = rand_qkv(rng, S)
    out, lse = attend_chunk(q, k, v, variant, backend="flex", block_size=BLOCK, compile=False)
    want_out, want_lse = reference.attention(q, k, v, variant.score_mod, variant.mask_mod)
    tol = tolerance(q, k, variant)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert out.shape == q.shape and lse.shape == q.shape[:3]
    torch.testing.assert_close(out.double(), want_out, **tol)
    torch.testing.assert_close(lse.double(), want_lse, **tol)


# chunk pairs (q chunk, kv chunk) of a 4-chunk sequence: below, on and above the diagonal
PAIRS = [(1, 0), (3, 3), (2, 0), (0, 3)]
SC = 256
CHUNK = SC // 4


def chunk_of_full(q, k, v, variant: Variant, i: int, j: int):
    """Rows of q chunk i attending only to keys of kv chunk j, from the full-sequence reference:
    the variant's mask AND "key in chunk j", so no offset arithmetic is shared with the code."""
    lo, hi = j * CHUNK, (j + 1) * CHUNK

    def in_chunk(b, h, q_idx, kv_idx):
        keep = (kv_idx >= lo) & (kv_idx < hi)
        return keep if variant.mask_mod is None else keep & variant.mask_mod(b, h, q_idx, kv_idx)

    out, lse = reference.attention(q, k, v, variant.score_mod, in_chunk)
    rows = slice(i * CHUNK, (i + 1) * CHUNK)
    return out[:, :, rows], lse[:, :, rows]


@pytest.mark.parametrize("case", CASE_IDS)
def test_chunk_pairs_match_blocks_of_full_sequence(rng, case):
    variant = all_cases(SC)[case]
    q, k, v = rand_qkv(rng, SC)
    tol = tolerance(q, k, variant)  # over the whole sequence: a bound for every chunk
    for i, j in PAIRS:
        qs, ks = slice(i * CHUNK, (i + 1) * CHUNK), slice(j * CHUNK, (j + 1) * CHUNK)
        want_out, want_lse = chunk_of_full(q, k, v, variant, i, j)
        for backend in ("flex", "reference"):
            out, lse = attend_chunk(
                q[:, :, qs],
                k[:, :, ks],
                v[:, :, ks],
                variant,
                q_offset=i * CHUNK,
                kv_offset=j * CHUNK,
                backend=backend,
                block_size=BLOCK,
                compile=False,
            )

            def msg(m, where=f"{backend}, q chunk {i}, kv chunk {j}"):
                return f"{where}: {m}"

            # rows with no key in this chunk: out 0 and lse -inf on both sides
            torch.testing.assert_close(out.double(), want_out, **tol, msg=msg)
            torch.testing.assert_close(lse.double(), want_lse, **tol, msg=msg)


def test_tensor_offsets_equal_int_offsets(rng):
    """Context parallelism passes offsets as 0-d tensors (no recompile per chunk)."""
    variant = all_cases(SC)["document+alibi"]
    q, k, v = rand_qkv(rng, SC)
    args = (q[:, :, 128:192], k[:, :, 64:128], v[:, :, 64:128], variant)
    kw = {"backend": "flex", "block_size": BLOCK, "compile": False}
    a = attend_chunk(*args, q_offset=128, kv_offset=64, **kw)
    b = attend_chunk(*args, q_offset=torch.tensor(128), kv_offset=torch.tensor(64), **kw)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_position_tables_equal_offsets(rng, monkeypatch):
    """Under FLASH the shifted callbacks read position tables (kernels.offsets_as_tables): the
    same scores and mask as the 0-d offsets, the block mask's own mask_mod included; and the
    head shift read from a table gives the same ALiBi scores."""
    from attngym import kernels

    variant = all_cases(SC)["document+alibi"]
    q, k, v = rand_qkv(rng, SC)
    args = (q[:, :, 128:192], k[:, :, 64:128], v[:, :, 64:128], variant)
    kw = {"q_offset": 128, "kv_offset": 64, "backend": "flex", "block_size": BLOCK}
    want = attend_chunk(*args, compile=False, **kw)
    monkeypatch.setattr(kernels, "offsets_as_tables", lambda kernel_options: True)
    seen = []
    flex = kernels.torch.nn.attention.flex_attention.flex_attention

    def recording(*a, block_mask=None, **kw):
        seen.append(block_mask.mask_mod)
        return flex(*a, block_mask=block_mask, **kw)

    monkeypatch.setattr(kernels.torch.nn.attention.flex_attention, "flex_attention", recording)
    got = attend_chunk(*args, compile=False, **kw)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    b, h = torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)
    m, n = torch.tensor(5), torch.tensor(40)
    _, offset_mask = kernels.shifted_mods(variant, 128, 64, "cpu")
    assert seen[0](b, h, m, n) == offset_mask(b, h, m, n)

    def maps(fn):  # the tensors the mask_mod's position maps read
        cells = [c.cell_contents for c in fn.__closure__]
        at = [f for f in cells if getattr(f, "__name__", "") in ("q_at", "kv_at")]
        return [c.cell_contents.shape for f in at for c in f.__closure__]

    assert maps(seen[0]) == [(64,), (64,)] and maps(offset_mask) == [(), ()]
    alibi = get("alibi", num_heads=8)
    by_offset = kernels.shifted_heads(alibi, 4, "cpu")
    by_table = kernels.shifted_heads(alibi, 4, "cpu", heads=4)
    score = torch.tensor(0.5)
    for head in range(4):
        hh = torch.tensor(head)
        assert by_table.score_mod(score, b, hh, m, n) == by_offset.score_mod(score, b, hh, m, n)


def test_block_mask_empty_above_the_diagonal(rng):
    causal = get("causal")
    above = make_block_mask(causal, 64, 64, q_offset=0, kv_offset=64, block_size=BLOCK)
    on = make_block_mask(causal, 64, 64, q_offset=64, kv_offset=64, block_size=BLOCK)
    below = make_block_mask(causal, 64, 64, q_offset=64, kv_offset=0, block_size=BLOCK)
    assert block_mask_is_empty(above)
    assert not block_mask_is_empty(on)
    assert not block_mask_is_empty(below)  # every block full: counted via full_kv_num_blocks
    assert not block_mask_is_empty(make_block_mask(get("full"), 64, 64, block_size=BLOCK))

    # a skipped pair would have contributed nothing: out 0, lse -inf
    q, k, v = rand_qkv(rng, 64)
    out, lse = attend_chunk(q, k, v, causal, kv_offset=64, backend="flex", block_mask=above)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isneginf(lse).all()


def test_block_mask_is_empty_for_distant_window_chunks():
    window = get("sliding_window", window_size=13)
    far = make_block_mask(window, 64, 64, q_offset=192, kv_offset=0, block_size=BLOCK)
    near = make_block_mask(window, 64, 64, q_offset=64, kv_offset=0, block_size=BLOCK)
    assert block_mask_is_empty(far)
    assert not block_mask_is_empty(near)


@pytest.mark.parametrize("case", ["causal", "alibi", "document+alibi"])
def test_gqa_matches_reference(rng, case):
    variant = all_cases(S)[case]
    q, k, v = rand_qkv(rng, S, kv_heads=2)
    out, lse = attend_chunk(q, k, v, variant, backend="flex", block_size=BLOCK, compile=False)
    want_out, want_lse = reference.attention(q, k, v, variant.score_mod, variant.mask_mod)
    tol = tolerance(q, k, variant)
    torch.testing.assert_close(out.double(), want_out, **tol)
    torch.testing.assert_close(lse.double(), want_lse, **tol)


def test_eager_flex_does_not_warn_about_compile(rng):
    from torch.nn.attention import flex_attention as flex_module

    # torch warns once per process; forget that it already did, so the check is meaningful
    getattr(flex_module, "_WARNINGS_SHOWN", set()).discard("flex_attention_performance")
    q, k, v = rand_qkv(rng, 64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        attend_chunk(q, k, v, get("causal"), backend="flex", block_size=BLOCK, compile=False)
    assert not [w for w in caught if "without torch.compile" in str(w.message)]


def test_flash_path_returns_an_lse_without_gradient(rng, monkeypatch):
    """FLASH's backward has no dLSE: its compiled flex returns a detached lse, out keeps its graph.

    CPU flex has no autograd, so flex_attention is stood in for by the differentiable reference.
    """
    import torch.nn.attention.flex_attention as fa

    from attngym.kernels import _flex_attention_constant_lse, compiled_flex_attention

    def reference_flex(q, k, v, **_):
        out, lse = reference.attention(q, k, v)
        return out, fa.AuxOutput(lse=lse)

    monkeypatch.setattr(fa, "flex_attention", reference_flex)
    q, k, v = (t.double().requires_grad_(True) for t in rand_qkv(rng, S))
    out, out_lse = _flex_attention_constant_lse(q, k, v, return_aux=fa.AuxRequest(lse=True))
    assert out.requires_grad and not out_lse.requires_grad
    expected, lse = reference.attention(q, k, v)
    torch.testing.assert_close(out_lse, lse.detach())
    (grad,) = torch.autograd.grad(out.sum(), q)
    (expected_grad,) = torch.autograd.grad(expected.sum(), q)
    torch.testing.assert_close(grad, expected_grad)
    compiled = compiled_flex_attention("default", lse_grad=False)
    assert compiled._torchdynamo_orig_callable is _flex_attention_constant_lse
    assert compiled_flex_attention()._torchdynamo_orig_callable is fa.flex_attention


def test_flash_lse_is_scaled_back_where_pytorch_scales_it(rng, monkeypatch):
    """Older PyTorch multiplies FLASH's natural-base lse by ln 2; attend_chunk undoes just that."""
    import math

    import torch.nn.attention.flex_attention as fa

    from attngym import kernels

    def flash_like(q, k, v, **_):  # out and lse as such a PyTorch returns them from FLASH
        out, lse = reference.attention(q, k, v, dtype=torch.float32)
        return out, fa.AuxOutput(lse=lse * math.log(2))

    monkeypatch.setattr(fa, "flex_attention", flash_like)
    monkeypatch.setattr(kernels, "flash_lse_scaled_by_ln2", lambda: True)
    q, k, v = rand_qkv(rng, S)
    full = get("full")
    flash = {"BACKEND": "FLASH"}
    _, lse = attend_chunk(q, k, v, full, backend="flex", compile=False, kernel_options=flash)
    _, expected = reference.attention(q, k, v)
    torch.testing.assert_close(lse, expected.float(), atol=1e-5, rtol=1e-5)
    _, lse = attend_chunk(q, k, v, full, backend="flex", compile=False)  # not FLASH: as returned
    torch.testing.assert_close(lse, expected.float() * math.log(2), atol=1e-5, rtol=1e-5)


def test_this_pytorch_is_recognised(monkeypatch):
    """torch 2.13 has the fix, 2.11 does not; judged from the source, else from the version."""
    import inspect

    from attngym.kernels import flash_lse_scaled_by_ln2

    version = tuple(int(x) for x in torch.__version__.split(".")[:2])
    if version not in ((2, 11), (2, 13)):
        pytest.skip(f"not checked on torch {torch.__version__}")
    assert flash_lse_scaled_by_ln2() == (version == (2, 11))

    def no_source(_):
        raise OSError("could not get source code")

    monkeypatch.setattr(inspect, "getsource", no_source)
    assert flash_lse_scaled_by_ln2.__wrapped__() == (version == (2, 11))


def _random_rule_cases(count: int, seed: int = 0):
    """Variants with a block rule on random lengths, chunks, offsets and block sizes."""
    import random

    rng = random.Random(seed)
    for _ in range(count):
        seq = rng.choice([256, 300, 1000, 1537, 2048])
        kind = rng.choice(["causal", "sliding_window", "document", "bidirectional_document"])
        if kind == "causal":
            variant = get("causal")
        elif kind == "sliding_window":
            variant = get("sliding_window", window_size=rng.choice([1, 50, 127, 128, 300]))
        else:
            lengths: list[int] = []
            while sum(lengths) < seq:
                lengths.append(min(rng.randrange(1, 400), seq - sum(lengths)))
            variant = get("document", doc_lengths=lengths, causal=kind == "document")
        seq_q, seq_kv = rng.choice([seq, seq // 2, seq // 3]), rng.choice([seq, seq // 2])
        offsets = rng.randrange(0, seq - seq_q + 1), rng.randrange(0, seq - seq_kv + 1)
        block = rng.choice([(128, 128), (64, 128), (16, 16), (128, 64)])
        yield pytest.param(variant, seq_q, seq_kv, offsets, block, id=f"{kind}-{seq}-{block}")


@pytest.mark.parametrize("variant, seq_q, seq_kv, offsets, block", _random_rule_cases(24))
def test_block_rule_builds_the_block_mask_create_block_mask_builds(
    variant, seq_q, seq_kv, offsets, block
):
    """A variant's closed-form block classes (Variant.block_rule) give create_block_mask's
    BlockMask: the same partial and full blocks, in both directions, for any chunk pair."""
    from torch.nn.attention.flex_attention import create_block_mask

    from attngym import kernels

    _, mask_mod = kernels.shifted_mods(variant, *offsets, "cpu")
    want = create_block_mask(mask_mod, None, None, seq_q, seq_kv, device="cpu", BLOCK_SIZE=block)
    got = make_block_mask(
        variant, seq_q, seq_kv, q_offset=offsets[0], kv_offset=offsets[1], block_size=block
    )
    for side in ("kv", "full_kv", "q", "full_q"):  # the listed blocks, in order, both ways
        num, want_num = getattr(got, f"{side}_num_blocks"), getattr(want, f"{side}_num_blocks")
        assert torch.equal(num, want_num), side
        listed, want_listed = getattr(got, f"{side}_indices"), getattr(want, f"{side}_indices")
        for row, n in enumerate(num[0, 0].tolist()):
            assert torch.equal(listed[0, 0, row, :n], want_listed[0, 0, row, :n]), (side, row)
    assert torch.equal(got.to_dense(), want.to_dense())


def test_block_masks_are_kept_only_inside_a_run():
    """Inside kept_block_masks() (a job, a CP rank) a mask is built once and reused; outside,
    or after it, each call builds its own, so a library caller holds no masks it did not ask for."""
    from attngym import kernels

    variant = get("document", doc_lengths=[100, 156])
    assert make_block_mask(variant, 256, 256) is not make_block_mask(variant, 256, 256)
    with kernels.kept_block_masks():
        kept = make_block_mask(variant, 256, 256)
        with kernels.kept_block_masks():  # nested: the same store
            assert make_block_mask(variant, 256, 256) is kept
        assert make_block_mask(variant.to("cpu"), 256, 256) is kept
        assert make_block_mask(variant, 256, 256, block_size=(64, 64)) is not kept
    assert make_block_mask(variant, 256, 256) is not kept


def test_a_recompile_limit_hit_is_an_error_not_an_eager_fallback():
    """Past Dynamo's recompile limit flex would run eagerly (every score materialised) and be
    timed as flex: attngym makes the limit a hard error for the whole process."""
    import torch._dynamo

    from attngym import kernels

    config = torch._dynamo.config
    saved = config.fail_on_recompile_limit_hit
    try:
        config.fail_on_recompile_limit_hit = False
        kernels.raise_recompile_limits()
        assert config.fail_on_recompile_limit_hit is True
        assert config.recompile_limit >= kernels.RECOMPILE_LIMIT
    finally:
        config.fail_on_recompile_limit_hit = saved
