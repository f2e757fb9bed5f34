"""Context parallelism on CUDA ranks: NCCL and copy-engine transports, compiled flex chunks.

Ranks share GPUs modulo the device count; copy_engine runs with two or more GPUs, or on one GPU
when TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1. Inputs are float32 and the flex kernel computes in
float32 (TF32 off by default), so outputs and gradients match the float64 reference to ~1e-5
relative; 2e-3 leaves room for the flex kernel's own accumulation order.
"""

from __future__ import annotations

import functools

import pytest
import torch

from attngym import reference, variants
from attngym.distributed import allgather_attention, ring_attention, shard, ulysses_attention
from attngym.distributed.ranks.launch import launch

from .gpu_ranks import relative_errors, skip_reason, transports

REL = 2e-3
BF16_REL = 1e-2  # bf16 outputs and gradients (8 bits of mantissa) against float64


def _variants(names):
    """The variants the ranks check: masks that skip different (q, kv) chunk pairs."""
    made = {
        "causal": lambda: variants.get("causal"),
        "sliding_window": lambda: variants.get("sliding_window", window_size=200),
        "document": lambda: variants.get("document", doc_lengths=[300, 500, 224]),
    }
    return {name: made[name]() for name in names}


SCHEMES = {"ring": ring_attention, "allgather": allgather_attention}


def _worker(
    rank, world_size, transport, variant_names, backward="auto", layouts=None, schemes=None,
    **scheme_options,
):  # fmt: skip
    device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator().manual_seed(0)
    S = 1024
    q = torch.randn(1, 4, S, 64, generator=gen).to(device)
    k, v = (torch.randn(1, 2, S, 64, generator=gen).to(device) for _ in range(2))
    dout = torch.randn(q.shape, generator=gen).to(device)
    errors = {}
    for name, variant in _variants(variant_names).items():
        variant = variant.to(device)
        qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
        ref_out, _ = reference.attention(qr, kr, vr, None, variant.mask_mod)
        ref_out.backward(dout.double())
        for fn in (SCHEMES[n] for n in schemes or SCHEMES):
            for layout in layouts or ("contiguous", "zigzag"):
                q_s, k_s, v_s = (
                    shard(t, rank, world_size, layout, variant=variant).requires_grad_()
                    for t in (q, k, v)
                )
                out = fn(
                    q_s, k_s, v_s, variant, layout=layout, transport=transport, backward=backward,
                    **scheme_options,
                )  # fmt: skip
                out.backward(shard(dout, rank, world_size, layout, variant=variant))
                errors[(name, fn.__name__, layout)] = relative_errors(
                    (out, q_s.grad, k_s.grad, v_s.grad),
                    (ref_out, qr.grad, kr.grad, vr.grad),
                    world_size,
                    layout,
                    variant,
                )
    return errors


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("variant", ["causal", "sliding_window", "document"])
@pytest.mark.parametrize("transport", transports())
def test_cp_on_cuda_matches_reference(transport, variant, scheme, monkeypatch):
    ranks = min(max(2, torch.cuda.device_count()), 4) if transport == "nccl" else 2
    if (reason := skip_reason(transport, ranks)) is not None:
        pytest.skip(reason)
    if torch.cuda.device_count() < ranks:
        monkeypatch.setenv("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "1")
    errors = launch(
        _worker,
        ranks,
        args=(transport, (variant,), "auto", None, (scheme,)),
        device="cuda",
        timeout_s=300,
    )
    for case, rel in errors.items():
        assert max(rel) < REL, f"{transport} {case}: relative errors of out, dq, dk, dv = {rel}"


@pytest.mark.gpu
@pytest.mark.parametrize("transport", transports())
def test_overlapped_allgather_on_cuda_matches_reference(transport, monkeypatch):
    """The all-gather's exchange overlapped with its own keys' call: the received rows' partial
    merged into theirs, and in the backward their dq added to the own keys' (several row
    ranges of one sum), on every layout."""
    if (reason := skip_reason(transport, 2)) is not None:
        pytest.skip(reason)
    if torch.cuda.device_count() < 2:
        monkeypatch.setenv("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "1")
    layouts = ("contiguous", "zigzag", "balanced")
    args = (transport, ("sliding_window", "document"), "auto", layouts, ("allgather",))
    worker = functools.partial(_worker, overlap=True)
    errors = launch(worker, 2, args=args, device="cuda", timeout_s=300)
    for case, rel in errors.items():
        assert max(rel) < REL, f"{transport} {case}: relative errors of out, dq, dk, dv = {rel}"


def _two_layers_worker(rank, world_size, transport):
    """Two calls of the same shapes (two layers) before one backward: the first call's saved keys
    must not be the transport's buffer, which the second call overwrites."""
    device = torch.device("cuda", torch.cuda.current_device())
    variant = variants.get("causal").to(device)
    gen = torch.Generator().manual_seed(1)
    S = 1024
    q, q2, dout = (torch.randn(1, 4, S, 64, generator=gen).to(device) for _ in range(3))
    k, v, k2, v2 = (torch.randn(1, 2, S, 64, generator=gen).to(device) for _ in range(4))
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    ref_out, _ = reference.attention(qr, kr, vr, None, variant.mask_mod)
    ref_out.backward(dout.double())
    errors = {}
    for fn in (ring_attention, allgather_attention):
        q_s, k_s, v_s = (shard(t, rank, world_size, "zigzag").requires_grad_() for t in (q, k, v))
        other = [shard(t, rank, world_size, "zigzag") for t in (q2, k2, v2)]
        out = fn(q_s, k_s, v_s, variant, layout="zigzag", transport=transport)
        fn(*other, variant, layout="zigzag", transport=transport)  # a second layer's forward
        out.backward(shard(dout, rank, world_size, "zigzag"))
        errors[fn.__name__] = relative_errors(
            (out, q_s.grad, k_s.grad, v_s.grad),
            (ref_out, qr.grad, kr.grad, vr.grad),
            world_size,
            "zigzag",
        )
    return errors


@pytest.mark.gpu
@pytest.mark.parametrize("transport", transports())
def test_a_second_call_before_the_backward_leaves_the_first_exact(transport, monkeypatch):
    if (reason := skip_reason(transport, 2)) is not None:
        pytest.skip(reason)
    if torch.cuda.device_count() < 2:
        monkeypatch.setenv("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "1")
    errors = launch(_two_layers_worker, 2, args=(transport,), device="cuda", timeout_s=300)
    for case, rel in errors.items():
        assert max(rel) < REL, f"{transport} {case}: relative errors of out, dq, dk, dv = {rel}"


@pytest.mark.multigpu
def test_auto_transport_picks_copy_engine_inside_one_host():
    errors = launch(_worker, 2, args=("auto", ("causal",)), device="cuda", timeout_s=300)
    for case, rel in errors.items():
        assert max(rel) < REL, f"auto {case}: {rel}"


@pytest.mark.multigpu
@pytest.mark.parametrize("backward", ["flex", "recompute"])
def test_ring_backward_modes_and_balanced_layout(backward):
    """The ring's backward through flex's compiled backward op (no forward re-run) and through
    re-run forwards; both topologies on the mask-balanced layout."""
    errors = launch(
        _worker,
        2,
        args=("auto", ("causal", "document"), backward, ("zigzag", "balanced")),
        device="cuda",
        timeout_s=300,
    )
    for case, rel in errors.items():
        assert max(rel) < REL, f"backward={backward} {case}: {rel}"


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["causal", "document+alibi"])
def test_compiled_flex_backward_op_matches_reference(case):
    """One chunk pair's gradient from the whole rows' out and lse through flex's compiled
    backward op, against the float64 reference restricted to that pair's keys."""
    from attngym import kernels
    from attngym.distributed.call.flex_backward import attend_backward

    S = 512
    made = {
        "causal": variants.get("causal"),
        "document+alibi": variants.compose(
            variants.get("document", doc_lengths=[100, 300, 112]),
            variants.get("alibi", num_heads=4),
        ),
    }
    variant = made[case].to("cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, dout = (torch.randn(1, 4, S, 64, generator=gen, device="cuda") for _ in range(2))
    k, v = (torch.randn(1, 2, S, 64, generator=gen, device="cuda") for _ in range(2))
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    out, lse = reference.attention(q64, k64, v64, variant.score_mod, variant.mask_mod)
    rows, half = slice(S // 2, S), S // 2
    # The reference gradient of the last q chunk's rows alone (the pairs computed below).
    want = torch.autograd.grad(out[:, :, rows], (q64, k64, v64), dout.double()[:, :, rows])
    got = [torch.zeros_like(t, dtype=torch.float64) for t in (q, k, v)]
    for kv0 in (0, half):  # the two kv chunks of the last q chunk
        block_mask = kernels.make_block_mask(
            variant, half, half, q_offset=half, kv_offset=kv0, device="cuda",
            full_when_unmasked=True,
        )  # fmt: skip
        dq, dk, dv = attend_backward(
            q[:, :, rows], k[:, :, kv0 : kv0 + half], v[:, :, kv0 : kv0 + half],
            out[:, :, rows].float(), lse[:, :, rows], dout[:, :, rows], variant,
            q_offset=half, kv_offset=kv0, block_mask=block_mask,
        )  # fmt: skip
        got[0][:, :, rows] += dq
        got[1][:, :, kv0 : kv0 + half] += dk
        got[2][:, :, kv0 : kv0 + half] += dv
    got[0] = got[0][:, :, rows]
    for name, g, w in zip(("dq", "dk", "dv"), got, (want[0][:, :, rows], *want[1:]), strict=True):
        rel = ((g - w).norm() / w.norm()).item()
        assert rel < REL, f"{case} {name}: relative error {rel}"


def _flash_worker(rank, world_size, transport):
    """Each topology's forward and backward with BACKEND=FLASH on bf16 inputs against the float64
    reference: the relative errors of out, dq, dk, dv."""
    from attngym.device import get_flash_block_size

    device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator().manual_seed(2)
    S, blocks = 2048, get_flash_block_size(device)
    q, k, v, dout = (torch.randn(1, 4, S, 128, generator=gen).to(device) for _ in range(4))
    errors = {}
    cases = {
        "causal": variants.get("causal"),
        "document": variants.get("document", doc_lengths=[600, 1000, 448]),
    }
    for name, variant in cases.items():
        variant = variant.to(device)
        qr, kr, vr = (t.bfloat16().double().requires_grad_() for t in (q, k, v))
        ref_out, _ = reference.attention(qr, kr, vr, None, variant.mask_mod)
        ref_out.backward(dout.bfloat16().double())
        for fn in (ring_attention, allgather_attention, ulysses_attention):
            q_s, k_s, v_s = (
                shard(t, rank, world_size, "zigzag").bfloat16().requires_grad_() for t in (q, k, v)
            )
            out = fn(
                q_s, k_s, v_s, variant, layout="zigzag", transport=transport,
                block_size=blocks, kernel_options={"BACKEND": "FLASH"},
            )  # fmt: skip
            out.backward(shard(dout, rank, world_size, "zigzag").bfloat16())
            errors[(name, fn.__name__)] = relative_errors(
                (out, q_s.grad, k_s.grad, v_s.grad),
                (ref_out, qr.grad, kr.grad, vr.grad),
                world_size,
                "zigzag",
            )
    return errors


@pytest.mark.gpu
@pytest.mark.parametrize("transport", transports())
def test_flash_backend_runs_every_topologys_forward_and_backward(transport, monkeypatch):
    """BACKEND=FLASH in the CP forward and backward (the ring's backward through flex's op, which
    takes no lse gradient; the others through the kernel's own), against the float64 reference
    of the same bf16 inputs: within bf16's rounding of the output and the gradients."""
    from attngym.tuning import flash_importable

    if not flash_importable():
        pytest.skip("flash-attn-4 is not installed (the FLASH backend's kernels)")
    if (reason := skip_reason(transport, 2)) is not None:
        pytest.skip(reason)
    if torch.cuda.device_count() < 2:
        monkeypatch.setenv("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "1")
    errors = launch(_flash_worker, 2, args=(transport,), device="cuda", timeout_s=500)
    for case, rel in errors.items():
        assert max(rel) < BF16_REL, f"{transport} {case}: rel. errors of out, dq, dk, dv = {rel}"


@pytest.mark.gpu
def test_compiled_sums_match_eager_ones_on_accumulator_views():
    """The fused (compiled) merge and sum give the rows the eager ones give, empty rows
    included, written into a view of a larger tensor as the accumulators write them."""
    from attngym.distributed.call.merge import compiled_sums, merged_weights, weighted_sum

    gen = torch.Generator(device="cuda").manual_seed(0)
    outs = [torch.randn(1, 4, 256, 64, generator=gen, device="cuda").bfloat16() for _ in range(5)]
    lses = [torch.randn(1, 4, 256, generator=gen, device="cuda") for _ in range(5)]
    for lse_i in lses:
        lse_i[0, 0, :7] = float("-inf")  # rows no pair reached
    lses[2][0, 1, :5] = float("-inf")  # rows one pair does not reach
    weights_of, summed = compiled_sums()
    want_lse, want_ws = merged_weights(lses)
    lse, ws = weights_of(lses)
    # float32 both ways; the fused kernel may round exp/log differently by an ulp or two.
    torch.testing.assert_close(lse, want_lse, rtol=1e-6, atol=1e-6)
    rows = slice(128, 384)
    want, got = (torch.zeros(1, 4, 512, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    weighted_sum(outs, want_ws, torch.float32, torch.bfloat16, want[:, :, rows])
    summed(outs, ws, torch.float32, torch.bfloat16, got[:, :, rows])
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)  # a bf16 ulp
    assert (got[0, 0, 128:135] == 0).all() and (got[:, :, :128] == 0).all()
    plain = summed(outs, None, torch.float32, torch.bfloat16)  # the gradients' sum
    want = weighted_sum(outs, None, torch.float32, torch.bfloat16)
    torch.testing.assert_close(plain.float(), want.float(), rtol=1e-2, atol=1e-2)


def _graph_worker(rank, world_size):
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator().manual_seed(rank)
    variant = variants.get("causal")
    static = [torch.randn(1, 4, 512, 64, generator=gen).to(device) for _ in range(3)]

    def call():
        with torch.no_grad():
            return ring_attention(*static, variant, layout="zigzag", transport="copy_engine")

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # compile, plan and allocate the channels outside the capture
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    fresh = [torch.randn(t.shape, generator=gen).to(device) for t in static]
    for t, f in zip(static, fresh, strict=True):
        t.copy_(f)
    graph.replay()
    torch.cuda.synchronize()
    want = call()
    dist.barrier()
    return ((out - want).norm() / want.norm()).item()


@pytest.mark.multigpu
def test_ring_forward_replays_in_a_cuda_graph():
    """The whole CP forward (copy-engine ring, compiled chunk kernels, fused merges) captured
    once and replayed on new inputs gives the eager result (no host sync inside the call)."""
    rel = launch(_graph_worker, 2, device="cuda", timeout_s=300)
    assert rel < 1e-5, rel


def _graphed_fwd_bwd_worker(rank, world_size, transport, scheme, variant_name, layout):
    """The whole CP call, forward and backward, through torch.cuda.make_graphed_callables (its
    warm-up, then one graph each way), replayed twice on new inputs: out and dq, dk, dv against
    the eager call on the same inputs (a second replay finds the signal pads as the first left
    them)."""
    device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator().manual_seed(rank)
    variant = _variants([variant_name])[variant_name].to(device)
    fn = {"ring": ring_attention, "allgather": allgather_attention,
          "ulysses": ulysses_attention}[scheme]  # fmt: skip

    def draw():
        q = torch.randn(1, 4, 512, 64, generator=gen).to(device).requires_grad_()
        return q, *(torch.randn(1, 2, 512, 64, generator=gen).to(device).requires_grad_()
                    for _ in range(2))  # fmt: skip

    def call(q, k, v):
        return fn(q, k, v, variant, layout=layout, transport=transport)

    graphed = torch.cuda.make_graphed_callables(call, draw())
    errors = []
    for _ in range(2):
        qkv, dout = draw(), torch.randn(1, 4, 512, 64, generator=gen).to(device)
        out = graphed(*qkv)
        got = [out.detach(), *torch.autograd.grad(out, qkv, dout)]
        out = call(*qkv)
        want = [out.detach(), *torch.autograd.grad(out, qkv, dout)]
        torch.cuda.synchronize()
        errors += [((g - w).norm() / w.norm()).item() for g, w in zip(got, want, strict=True)]
    return errors


GRAPHED = [
    ("ring", "causal", "zigzag"),
    ("allgather", "sliding_window", "contiguous"),  # the uneven exchange of a halo
    ("allgather", "document", "balanced"),  # the overlapped exchange
    ("ulysses", "document", "contiguous"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("transport", transports())
@pytest.mark.parametrize("scheme, variant, layout", GRAPHED)
def test_cp_forward_and_backward_replay_as_cuda_graphs(
    scheme, variant, layout, transport, monkeypatch
):
    """A whole CP call captured as CUDA graphs, forward and backward (PyTorch's
    make_graphed_callables), gives the eager result on new inputs: no host sync and no host
    state in the call that a replay would miss (what topology.options.cuda_graph relies on)."""
    if (reason := skip_reason(transport, 2)) is not None:
        pytest.skip(reason)
    if torch.cuda.device_count() < 2:
        monkeypatch.setenv("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "1")
    rel = launch(_graphed_fwd_bwd_worker, 2, args=(transport, scheme, variant, layout),
                 device="cuda", timeout_s=300)  # fmt: skip
    assert max(rel) < 1e-5, f"{scheme} {variant} {transport}: out, dq, dk, dv rel. errors {rel}"


def _bits_worker(rank, world_size, transport, calls):
    """Each scheme's output and gradients, called `calls` times on the same inputs: a digest per
    call of every rank's bits (gathered), so a read that races a transfer's arrival, or a sum
    whose order changes, shows as a second digest."""
    import hashlib

    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator().manual_seed(5)
    S = 1024  # the documents of _variants
    q, dout = (torch.randn(1, 4, S, 64, generator=gen).to(device) for _ in range(2))
    k, v = (torch.randn(1, 2, S, 64, generator=gen).to(device) for _ in range(2))
    cases = [("ring", "sliding_window", "contiguous", {}), ("ring", "document", "zigzag", {}),
             ("allgather", "document", "balanced", {"overlap": True}),
             ("ulysses", "document", "contiguous", {})]  # fmt: skip
    fns = {**SCHEMES, "ulysses": ulysses_attention}
    digests = {}
    for scheme, name, layout, options in cases:
        variant = _variants([name])[name].to(device)
        for _ in range(calls):
            q_s, k_s, v_s = (
                shard(t, rank, world_size, layout, variant=variant).requires_grad_()
                for t in (q, k, v)
            )
            out = fns[scheme](q_s, k_s, v_s, variant, layout=layout, transport=transport,
                              **options)  # fmt: skip
            out.backward(shard(dout, rank, world_size, layout, variant=variant))
            bits = torch.cat([t.detach().flatten() for t in (out, q_s.grad, k_s.grad, v_s.grad)])
            every = [torch.empty_like(bits) for _ in range(world_size)]
            dist.all_gather(every, bits)
            digest = hashlib.sha256(torch.cat(every).cpu().numpy().tobytes()).hexdigest()
            digests.setdefault((scheme, name, layout), []).append(digest)
    return digests


@pytest.mark.gpu
@pytest.mark.parametrize("transport", transports())
def test_cp_on_cuda_gives_the_same_bits_call_after_call_and_process_after_process(
    transport, monkeypatch
):
    """What made the CPU parity differ from run to run was a first call's kernel choice; on CUDA
    the transports' streams and the copy engine's signals are the suspects: every call of every
    scheme, in two fresh pairs of ranks, must give one set of bits."""
    if (reason := skip_reason(transport, 2)) is not None:
        pytest.skip(reason)
    if torch.cuda.device_count() < 2:
        monkeypatch.setenv("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "1")
    runs = [launch(_bits_worker, 2, args=(transport, 4), device="cuda", timeout_s=300)
            for _ in range(2)]  # fmt: skip
    for case in runs[0]:
        seen = {d for run in runs for d in run[case]}
        assert len(seen) == 1, f"{transport} {case}: {len(seen)} different results in 8 calls"
