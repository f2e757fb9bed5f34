"""Context-parallel runs (ring and all-gather): spawn the ranks, check, time, report.

The parent process checks what it can without tensors (transport against the device, ranks
against GPUs, the variant, seq_len against the layout) and raises ConfigError before any rank
starts; then attngym.distributed.launch runs `_rank_run` on every rank. Every rank:

1. resolves the transport (collective on CUDA: the NVLink-domain check) and draws the same seeded
   whole-sequence inputs (attngym.tasks.common.make_inputs), then takes its shard in the layout;
2. runs one forward (+ backward when passes include bwd; on CPU the reference chunk kernel gives
   one) timed apart (compilation on CUDA);
3. validates: gathers the output (and lse) shards, and the gradients for an output gradient kept on
   the sampled rows only, and compares them with the float64 dense reference on those rows;
4. times fwd, bwd, fwd+bwd together with its peers (bench.time_fn; every rank makes the same
   calls), then one instrumented forward (per-step compute, pairs, bytes), a transfer-only pass
   (per-step transfer time) and, on rank 0, the whole problem on one device with the same kernel
   (single_fwd_ms, efficiency).

Rank 0's metrics come back to the caller; the other ranks log to rank<N>.log in the run folder.
Shape legend: B batch, H query heads, G kv heads, S sequence, D head dim, R validated rows.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from attngym import kernels, reference, registry
from attngym.config import Settings
from attngym.errors import ConfigError
from attngym.tasks import common

log = logging.getLogger(__name__)


def check_hardware(settings: Settings) -> None:
    """ConfigError for what cannot run here, before any tensor work (no collective needed).

    transport=copy_engine on CPU (and any transport that cannot move this device's tensors) fails
    on `topology.transport`; more ranks than GPUs fails on `topology.world_size` unless
    TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 allows several ranks per GPU. Ranks outside one
    NVLink domain with copy_engine are caught on the ranks (resolve_transport).
    """
    from attngym.distributed import launch, layout
    from attngym.distributed.transport import check_transport

    topo = settings.topology
    check_transport(topo.transport, settings.device, key="topology.transport")
    if settings.device == "cuda" and not launch.under_torchrun():
        gpus = torch.cuda.device_count()
        overlap = os.environ.get("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES") == "1"
        if topo.world_size > gpus and not overlap:
            raise ConfigError(
                "topology.world_size",
                f"{topo.world_size} ranks but {gpus} GPU(s); use at most {gpus} (or auto), or "
                "set TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 to share GPUs between ranks",
            )
    try:
        layout.check_seq_len(settings.shape.seq_len, topo.world_size, topo.layout)
    except ValueError as err:
        raise ConfigError("shape.seq_len", str(err)) from None


def run_context_parallel(settings: Settings, run_dir: Path, kind: str) -> dict[str, Any]:
    """Check, launch the ranks, and return rank 0's metrics (kind: "ring" or "allgather")."""
    from attngym.distributed.launch import launch

    check_hardware(settings)
    common.build_variant(settings.attention, seq_len=settings.shape.seq_len)  # errors early
    metrics = common.base_metrics(settings)
    metrics.update(
        launch(
            _rank_run,
            settings.topology.world_size,
            args=(settings, kind),
            device=settings.device,
            timeout_s=settings.topology.timeout_s,
            run_dir=run_dir,
        )
    )
    return metrics


@registry.register("task", "ring")
def run(settings: Settings, run_dir: Path) -> dict[str, Any]:
    """Ring attention over topology.world_size ranks; see the module docstring."""
    return run_context_parallel(settings, run_dir, "ring")


def _rank_run(rank: int, world_size: int, settings: Settings, kind: str) -> dict[str, Any]:
    import torch.distributed as dist

    from attngym import bench
    from attngym.distributed import allgather_attention, ring_attention, shard, unshard
    from attngym.distributed.ring import CPStats
    from attngym.distributed.transport import resolve_transport

    topo = settings.topology
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if settings.device == "cuda"
        else torch.device("cpu")
    )
    dtype = common.torch_dtype(settings.dtype)
    shape = settings.shape
    seq_len = shape.seq_len
    variant = common.build_variant(settings.attention, seq_len=seq_len).to(device)
    resolved = resolve_transport(topo.transport, device, key="topology.transport")
    do_bwd = "bwd" in settings.passes
    metrics: dict[str, Any] = {
        "transport": resolved.name,
        "bwd_status": "ok" if do_bwd else "not requested",
    }
    log.info("%s attention: rank %d of %d, transport %s", kind, rank, world_size, resolved.name)

    fn = ring_attention if kind == "ring" else allgather_attention
    cp_kwargs = dict(
        transport=resolved.name,
        layout=topo.layout,
        block_size=tuple(settings.block_size),
        kernel_options=settings.kernel_options or None,
        timeout_s=topo.timeout_s,
    )
    q, k, v, grad_out = common.make_inputs(settings, device, dtype)

    def mine(t: torch.Tensor) -> torch.Tensor:
        return shard(t, rank, world_size, topo.layout)

    q_s, k_s, v_s, g_s = (mine(t) for t in (q, k, v, grad_out))
    for t in (q_s, k_s, v_s):
        t.requires_grad_(do_bwd)

    def fwd(stats=None) -> torch.Tensor:
        return fn(q_s, k_s, v_s, variant, stats=stats, **cp_kwargs)

    def gather(t: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(t) for _ in range(world_size)]
        dist.all_gather(parts, t.detach().contiguous())
        return unshard(parts, topo.layout)

    # 2. The first call, timed apart.
    start = time.perf_counter()
    out = fwd()
    if do_bwd:
        torch.autograd.grad(out, (q_s, k_s, v_s), g_s)
    _sync(device)
    metrics["compile_s"] = time.perf_counter() - start
    del out

    # 3. Validation on sampled rows.
    if settings.validate:
        metrics.update(
            _validate(
                settings, variant, q, k, v, grad_out, (q_s, k_s, v_s), fwd, gather, mine, do_bwd
            )
        )
    else:
        metrics["validated_rows"] = 0

    # 4. Timings: every rank makes the same calls.
    block_mask = kernels.make_block_mask(
        variant, seq_len, seq_len, block_size=settings.block_size, device=device
    )
    sparsity = bench.block_sparsity(block_mask) if block_mask is not None else 0.0
    metrics["sparsity"] = float(sparsity)
    b = settings.benchmark

    def timed(call, setup=None) -> Any:
        return bench.time_fn(call, warmup=b.warmup, repeats=b.repeats, device=device, setup=setup)

    timings: dict[str, Any] = {}
    with torch.no_grad():
        timings["fwd"] = timed(fwd)
    if do_bwd:
        # A fresh forward graph per timed backward, built outside the timed region.
        timings["bwd"] = timed(lambda out: torch.autograd.grad(out, (q_s, k_s, v_s), g_s), fwd)
        timings["fwd_bwd"] = timed(lambda: torch.autograd.grad(fwd(), (q_s, k_s, v_s), g_s))
    for p, passes in (("fwd", ("fwd",)), ("bwd", ("bwd",)), ("fwd_bwd", ("fwd", "bwd"))):
        t = timings.get(p)
        flops = bench.attention_flops(
            shape.batch,
            shape.heads,
            seq_len,
            seq_len,
            shape.head_dim,
            sparsity=sparsity,
            passes=passes,
        )
        metrics[f"{p}_ms"] = t.median_ms if t else None
        metrics[f"{p}_tflops"] = bench.tflops(flops, t.median_ms) if t else None
    metrics["fwd_ms_min"] = timings["fwd"].min_ms
    metrics["fwd_ms_max"] = timings["fwd"].max_ms

    # One instrumented forward: per-step compute, pairs, bytes.
    stats = CPStats()
    with torch.no_grad():
        fwd(stats)
    metrics["step_compute_ms"] = statistics.median(stats.step_compute_ms)
    metrics["pairs_computed"] = stats.pairs_computed
    metrics["pairs_skipped"] = stats.pairs_skipped
    metrics["bytes_moved"] = stats.bytes_sent
    metrics["step_transfer_ms"] = _transfer_ms(kind, resolved, k_s, topo.timeout_s, b.repeats)

    # The same whole problem on one device with the same kernel (rank 0; the others wait).
    if rank == 0:
        whole = lambda: kernels.attend_chunk(  # noqa: E731
            q,
            k,
            v,
            variant,
            backend="auto",
            block_size=tuple(settings.block_size),
            block_mask=block_mask if device.type == "cuda" else None,
            kernel_options=settings.kernel_options or None,
            compile=settings.compile,
        )
        with torch.no_grad():
            whole()
            single = timed(whole)
        metrics["single_fwd_ms"] = single.median_ms
        metrics["efficiency"] = (single.median_ms / world_size) / timings["fwd"].median_ms
        log.info(
            "%s fwd %.2f ms vs one device %.2f ms over %d ranks: efficiency %.2f",
            kind,
            timings["fwd"].median_ms,
            single.median_ms,
            world_size,
            metrics["efficiency"],
        )
    dist.barrier()
    return metrics


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _validate(
    settings, variant, q, k, v, grad_out, shards, fwd, gather, mine, do_bwd
) -> dict[str, Any]:
    """Errors of the unsharded output, lse and gradients against the float64 reference rows.

    Args:
        q: (B, H, S, D); k, v: (B, G, S, D); grad_out: (B, H, S, D) whole-sequence inputs.
        shards: this rank's (q, k, v) shards that `fwd` attends with.
        fwd: `fwd(stats) -> out shard`; gather: shard -> whole tensor; mine: whole -> shard.
    """
    from attngym.distributed.ring import CPStats

    seq_len = q.shape[2]
    rows = common.sample_rows(seq_len, settings.validate_rows, settings.seed, q.device)  # (R,)
    metrics: dict[str, Any] = {"validated_rows": int(rows.numel())}
    q64 = q[:, :, rows].double().requires_grad_(do_bwd)  # (B, H, R, D)
    k64 = k.double().requires_grad_(do_bwd)
    v64 = v.double().requires_grad_(do_bwd)
    ref_out, ref_lse = reference.attention(
        q64, k64, v64, variant.score_mod, variant.mask_mod, q_positions=rows, dtype=torch.float64
    )
    stats = CPStats()
    out_s = fwd(stats)
    out, lse = gather(out_s), gather(stats.lse)
    metrics.update(
        common.output_errors(out[:, :, rows], lse[:, :, rows], ref_out.detach(), ref_lse)
    )
    if do_bwd:
        g_rows = grad_out[:, :, rows]  # (B, H, R, D): the gradient lives on the sampled rows only
        g_masked = torch.zeros_like(grad_out)
        g_masked[:, :, rows] = g_rows
        grads = torch.autograd.grad(out_s, shards, mine(g_masked))
        dq, dk, dv = (gather(g) for g in grads)
        ref = torch.autograd.grad(ref_out, (q64, k64, v64), g_rows.double())
        metrics.update(common.grad_errors((dq[:, :, rows], dk, dv), ref))
    else:
        metrics.update({"err_dq_rel": None, "err_dk_rel": None, "err_dv_rel": None})
    log.info(
        "validated %d rows: out max abs err %.3g, rel %.3g; lse max abs err %.3g",
        metrics["validated_rows"],
        metrics["err_out_max_abs"],
        metrics["err_out_rel"],
        metrics["err_lse_max_abs"],
    )
    return metrics


def _transfer_ms(kind: str, transport, k_s: torch.Tensor, timeout_s: float, repeats: int) -> float:
    """Median time of one step's K/V transfer alone (ring: one push; all-gather: one gather)."""
    import torch.distributed as dist

    world_size = dist.get_world_size()
    if world_size == 1:
        return 0.0
    kv = torch.stack([k_s.detach(), k_s.detach()])
    times = []
    if kind == "ring":
        chan = transport.channel(
            tuple(k_s.shape), 2, dtype=k_s.dtype, device=k_s.device, timeout_s=timeout_s
        )
        for _ in range(repeats):
            for i in range(world_size - 1):
                _sync(k_s.device)
                start = time.perf_counter()
                chan.send(kv if i == 0 else chan.recv(i), i)
                chan.recv(i + 1)
                _sync(k_s.device)
                times.append((time.perf_counter() - start) * 1e3)
                if i > 0:
                    chan.release(i)
            chan.release(world_size - 1)
            chan.join()
    else:
        ag = transport.allgather(
            tuple(k_s.shape), 2, 2, dtype=k_s.dtype, device=k_s.device, timeout_s=timeout_s
        )
        for _ in range(repeats):
            _sync(k_s.device)
            start = time.perf_counter()
            ag.start(kv)
            ag.wait(kv)
            _sync(k_s.device)
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)
