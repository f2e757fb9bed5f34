"""flex's backward op for one chunk pair, from the whole rows' out and lse, in one process.

Eager, the op is PyTorch's dense implementation, in float64 for float64 inputs, so a pair's
gradients summed over the kv chunks match the float64 reference to rounding (1e-10 is far above
the ~1e-15 seen and far below a wrong lse base, offset or weight, which give errors of order 1).
The same call traced by Dynamo (backend aot_eager: Dynamo and AOTAutograd, no Triton) checks the
form the compiled CUDA path hands to torch.compile, and that each variant's graphs get their own
compiled entry.
"""

from __future__ import annotations

import pytest
import torch

from attngym import kernels, reference, variants
from attngym.distributed.call import flex_backward
from attngym.distributed.call.cp import resolve_backward

TOL = 1e-10
S, HALF = 32, 16


def _cases():
    return {
        "causal": variants.get("causal"),
        "alibi": variants.get("alibi", num_heads=4),
        "document+alibi": variants.compose(
            variants.get("document", doc_lengths=[10, 14, 8]), variants.get("alibi", num_heads=4)
        ),
    }


def _problem(variant):
    gen = torch.Generator().manual_seed(3)
    q, dout = (torch.randn(2, 4, S, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, 2, S, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = reference.attention(*leaves, variant.score_mod, variant.mask_mod)
    rows = slice(HALF, S)
    want = torch.autograd.grad(out[:, :, rows], leaves, dout[:, :, rows])
    return q, k, v, out.detach(), lse.detach(), dout, want


def _pair_args(variant, q, k, v, out, lse, dout, kv0):
    block_mask = kernels.make_block_mask(
        variant,
        HALF,
        HALF,
        q_offset=HALF,
        kv_offset=kv0,
        block_size=(8, 8),
        full_when_unmasked=True,
    )
    rows, cols = slice(HALF, S), slice(kv0, kv0 + HALF)
    return flex_backward.op_args(
        q[:, :, rows],
        k[:, :, cols],
        v[:, :, cols],
        out[:, :, rows],
        lse[:, :, rows],
        dout[:, :, rows],
        variant,
        q_offset=HALF,
        kv_offset=kv0,
        block_mask=block_mask,
        scale=None,
        kernel_options=None,
    )


def _sum_pairs(variant, call, problem):
    q, k, v, out, lse, dout, _ = problem
    got = [torch.zeros_like(q[:, :, HALF:]), torch.zeros_like(k), torch.zeros_like(v)]
    for kv0 in (0, HALF):
        graphs, args = _pair_args(variant, q, k, v, out, lse, dout, kv0)
        dq, dk, dv = call(graphs, args)
        got[0] += dq
        got[1][:, :, kv0 : kv0 + HALF] += dk
        got[2][:, :, kv0 : kv0 + HALF] += dv
    return got


@pytest.mark.parametrize("tables", [False, True], ids=["offsets", "tables"])
@pytest.mark.parametrize("case", list(_cases()))
def test_eager_op_gives_each_pairs_share_of_the_gradient(case, tables, monkeypatch):
    """Each pair's share, with the chunk offsets as 0-d inputs and as position tables (the FLASH
    form, kernels.offsets_as_tables)."""
    monkeypatch.setattr(kernels, "offsets_as_tables", lambda kernel_options: tables)
    variant = _cases()[case]
    problem = _problem(variant)
    got = _sum_pairs(variant, lambda graphs, args: flex_backward._call_op(*args), problem)
    want = problem[-1]
    errors = [
        (got[0] - want[0][:, :, HALF:]).abs().max().item(),
        (got[1] - want[1]).abs().max().item(),
        (got[2] - want[2]).abs().max().item(),
    ]
    assert max(errors) < TOL, f"{case}: max |err| of dq, dk, dv = {errors}"


def test_the_op_reads_a_given_lse_of_some_rows_as_a_contiguous_tensor():
    """A call over some of a shard's rows (the overlapped all-gather's received rows) passes a
    row slice of the shard's converted lse. flex's Triton kernels index the lse as (B·H, rows)
    whatever its strides, so the op must get those rows packed, with their values unchanged."""
    variant = _cases()["causal"]
    q, k, v, out, lse, dout, _ = _problem(variant)
    rows = slice(HALF, S)
    whole = flex_backward.kernel_lse(lse, None, q.dtype)
    assert not whole[:, :, rows].is_contiguous()  # the case this guards
    block_mask = kernels.make_block_mask(variant, HALF, S, q_offset=HALF, block_size=(8, 8))
    _, args = flex_backward.op_args(
        q[:, :, rows], k, v, out[:, :, rows], lse[:, :, rows], dout[:, :, rows], variant,
        q_offset=HALF, kv_offset=0, block_mask=block_mask, scale=None, kernel_options=None,
        lse2=whole[:, :, rows],
    )  # fmt: skip
    lse2 = args[4]
    assert lse2.is_contiguous()
    assert torch.equal(lse2, whole[:, :, rows])


def test_dynamo_traces_the_op_once_per_variant_and_reuses_it():
    import torch._dynamo.testing

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(flex_backward._call_op, backend=counter, dynamic=False, fullgraph=True)

    def call(graphs, args):
        graphs.ready_for_dynamo()
        return compiled(*args)

    made = _cases()  # one Variant object per case: its graphs are built once
    frames = []
    for case in ("causal", "document+alibi", "causal"):
        variant = made[case]
        problem = _problem(variant)
        got = _sum_pairs(variant, call, problem)
        want = problem[-1]
        assert (got[0] - want[0][:, :, HALF:]).abs().max().item() < TOL, case
        assert (got[1] - want[1]).abs().max().item() < TOL, case
        frames.append(counter.frame_count)
    # One compile per variant's graphs (both chunk pairs share it); the first variant's entry is
    # reused afterwards (a GraphModule's type is unique, so the guards tell the graphs apart).
    assert frames == [1, 2, 2]


def test_after_an_auto_failure_only_auto_falls_back(monkeypatch):
    """Once flex's op failed under backward=auto, auto re-runs forwards; an explicit 'flex', or
    auto with FLASH (whose backward cannot differentiate a re-run's lse), still calls the op (and
    would raise), it never falls back silently."""
    from types import SimpleNamespace

    from attngym.distributed.call.cp import CPOptions

    monkeypatch.setattr(flex_backward, "_FAILED", ["RuntimeError: an earlier failure"])
    monkeypatch.setattr(flex_backward, "attend_backward", lambda *a, **kw: "the op ran")
    t = torch.randn(1, 1, 4, 2)
    saved = SimpleNamespace(q=t, out=t, lse=t[..., 0], dout=t, lse2=None)
    flash = {"BACKEND": "FLASH"}
    for backward, options, want in (
        ("auto", None, None), ("flex", None, "the op ran"), ("auto", flash, "the op ran")
    ):  # fmt: skip
        call = SimpleNamespace(
            options=CPOptions(backward=backward, kernel_options=options), variant=None
        )
        got = flex_backward.pair_grads(call, saved, slice(0, 4), t, t, (0, 4), (0, 4), None)
        assert got == want, (backward, options)
        resolved = resolve_backward(call.options)
        assert resolved == ("recompute" if want is None else "flex"), (backward, options)


def test_flash_refuses_the_recompute_backward(monkeypatch):
    """FLASH has no lse gradient, which a re-run pair needs: recompute is refused with it, and
    without flex's backward op a FLASH CP backward says so instead of recomputing."""
    from attngym.distributed.call.cp import CPOptions

    with pytest.raises(ValueError, match="backward='recompute' .* FLASH"):
        CPOptions(backward="recompute", kernel_options={"BACKEND": "FLASH"})
    CPOptions(backward="recompute", kernel_options={"BACKEND": "TRITON"})
    monkeypatch.setattr(flex_backward, "available", lambda: (False, "no such op"))
    with pytest.raises(ValueError, match="FLASH needs flex's backward op .*no such op"):
        resolve_backward(CPOptions(kernel_options={"BACKEND": "FLASH"}))
    assert resolve_backward(CPOptions()) == "recompute"


def test_variants_whose_graphs_trace_alike_share_one_compile():
    """A workload's batches: each a new document variant of its own lengths, the same mask code.
    They share the first one's graphs (one compile in all), each exact with its own documents;
    a variant whose code differs (another window) compiles its own."""
    import torch._dynamo.testing

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(flex_backward._call_op, backend=counter, dynamic=False, fullgraph=True)

    def call(graphs, args):
        graphs.ready_for_dynamo()
        return compiled(*args)

    batches = [variants.get("document", doc_lengths=lengths)
               for lengths in ([10, 14, 8], [3, 20, 9], [32])]  # fmt: skip
    windows = [variants.get("sliding_window", window_size=w) for w in (5, 9)]
    frames = []
    for variant in [*batches, *windows]:
        problem = _problem(variant)
        got = _sum_pairs(variant, call, problem)
        want = problem[-1]
        assert (got[0] - want[0][:, :, HALF:]).abs().max().item() < TOL
        assert (got[1] - want[1]).abs().max().item() < TOL
        assert (got[2] - want[2]).abs().max().item() < TOL
        frames.append(counter.frame_count)
    assert frames == [1, 1, 1, 2, 3]
