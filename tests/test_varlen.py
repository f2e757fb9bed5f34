"""FlashAttention's varlen kernels as contenders: each variant's varlen form is its mask (checked
against a dense reference built here from the form alone), the packing round-trips, and on CUDA
the kernels' output matches the float64 reference (GQA too)."""

from __future__ import annotations

import pytest
import torch

from attngym import reference, variants, varlen
from attngym.variants.base import Varlen


def _dense_from_form(form: Varlen, seq_len: int) -> torch.Tensor:
    """The (S, S) mask FlashAttention computes for a varlen form: same document, and
    -left <= kv - q <= right inside it (-1: unbounded); built position by position."""
    docs = torch.zeros(seq_len, dtype=torch.long)
    start = 0
    for d, n in enumerate(form.documents or (seq_len,)):
        docs[start : start + n] = d
        start += n
    keep = torch.zeros(seq_len, seq_len, dtype=torch.bool)
    for q in range(seq_len):
        for kv in range(seq_len):
            ahead = kv - q
            keep[q, kv] = (
                docs[q] == docs[kv]
                and (form.left < 0 or -ahead <= form.left)
                and (form.right < 0 or ahead <= form.right)
            )
    return keep


CASES = [
    ("full", {}),
    ("causal", {}),
    ("sliding_window", {"window_size": 7}),
    ("bidirectional_sliding_window", {"window_size": 5}),
    ("document", {"doc_lengths": [11, 3, 26]}),
    ("document", {"doc_lengths": [11, 3, 26], "causal": False}),
]


@pytest.mark.parametrize("name, params", CASES)
def test_each_varlen_form_is_its_variants_mask(name, params):
    v = variants.get(name, **params)
    pos = torch.arange(40)
    want = reference.dense_mask(v.mask_mod, 1, 1, pos, pos)[0, 0]
    assert torch.equal(_dense_from_form(v.varlen, 40), want)


def test_composed_documents_and_window_keep_what_both_keep():
    docs = variants.get("document", doc_lengths=[11, 3, 26])
    v = variants.compose(docs, variants.get("sliding_window", window_size=4))
    assert v.varlen == Varlen(documents=(11, 3, 26), left=4, right=0)
    pos = torch.arange(40)
    assert torch.equal(_dense_from_form(v.varlen, 40), reference.dense_mask(v.mask_mod, 1, 1, pos,
                                                                            pos)[0, 0])  # fmt: skip
    other = variants.get("document", doc_lengths=[20, 20])
    assert variants.compose(docs, other).varlen is None  # two splits: no one varlen form
    capped = variants.compose(variants.get("causal"), variants.get("softcap", soft_cap=20.0))
    assert capped.varlen is None  # a score_mod


def test_what_no_varlen_kernel_runs_is_refused_with_the_reason():
    cpu = torch.device("cpu")
    assert varlen.refusal("varlen", variants.get("causal"), cpu, torch.bfloat16).startswith(
        "a CUDA kernel"
    )
    cuda = torch.device("cuda")
    assert "float32" in varlen.refusal("varlen", variants.get("causal"), cuda, torch.float32)
    prefix = variants.get("prefix_lm", prefix_length=8)
    assert varlen.refusal("varlen", prefix, cuda, torch.bfloat16) == (
        "no varlen form (documents and a window only)"
    )
    alibi = variants.get("alibi", num_heads=4)
    assert varlen.refusal("flash_varlen", alibi, cuda, torch.bfloat16) == (
        "no varlen form: a score_mod"
    )


def test_packing_round_trips_and_offsets_cover_every_document_of_every_batch():
    gen = torch.Generator().manual_seed(0)
    t = torch.randn(3, 4, 40, 8, generator=gen)
    packed = varlen.pack(t)
    assert packed.shape == (120, 4, 8)
    assert torch.equal(packed[40 + 7], t[1, :, 7])  # batch 1, position 7
    assert torch.equal(varlen.unpack(packed, 3), t)
    cu, longest = varlen.offsets(Varlen(documents=(11, 3, 26)), 2, 40, torch.device("cpu"))
    assert cu.tolist() == [0, 11, 14, 40, 51, 54, 80] and cu.dtype == torch.int32
    assert longest == 26
    assert varlen.offsets(Varlen(), 2, 40, torch.device("cpu"))[0].tolist() == [0, 40, 80]


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", varlen.KERNELS)
@pytest.mark.parametrize("name, params", [c for c in CASES if c[0] != "full"] + [("full", {})])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_varlen_kernels_match_the_float64_reference_on_cuda(kernel, name, params, kv_heads):
    """bf16 inputs: out, dq, dk, dv within bf16's tolerance of float64 (as flex's are)."""
    device = torch.device("cuda")
    v = variants.get(name, **params).to(device)
    why = varlen.refusal(kernel, v, device, torch.bfloat16, gqa=kv_heads != 4)
    if why is not None:
        pytest.skip(why)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 40, 64, generator=gen)
    k, val = (torch.randn(2, kv_heads, 40, 64, generator=gen) for _ in range(2))
    dout = torch.randn(q.shape, generator=gen)
    leaves = [varlen.pack(t).to(device, torch.bfloat16).requires_grad_() for t in (q, k, val)]
    out = varlen.call(kernel, v, *leaves, 2)()
    out.backward(varlen.pack(dout).to(device, torch.bfloat16))
    ref_leaves = [t.double().requires_grad_() for t in (q, k, val)]
    ref, _ = reference.attention(*ref_leaves, None, v.to("cpu").mask_mod)
    ref.backward(dout.double())
    got = [varlen.unpack(out.detach(), 2), *(varlen.unpack(t.grad, 2) for t in leaves)]
    for g, w in zip(got, [ref, *(t.grad for t in ref_leaves)], strict=True):
        err = ((g.double().cpu() - w).norm() / w.norm()).item()
        assert err < 2e-2, (kernel, name, kv_heads, err)
