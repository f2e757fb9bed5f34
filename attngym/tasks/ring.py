"""Context-parallel runs (ring and all-gather): spawn the ranks, check, time, report.

The settings arrive checked (ranks against GPUs, the variant, seq_len against the layout: see
attngym.config); the parent process checks the transport against the device and raises
ConfigError before any rank starts; then attngym.distributed.launch runs `_rank_run` on every
rank. Every rank:

1. resolves the transport (collective on CUDA: the NVLink-domain check) and draws the same seeded
   whole-sequence inputs on the CPU (attngym.inputs.make_inputs, identical on every rank),
   takes its shard in the layout and moves only the shard to its device: no device holds the
   whole sequence, so context parallelism reaches lengths one device cannot;
2. runs one forward (+ backward when passes include bwd; on CPU the reference chunk kernel gives
   one) timed apart (compilation on CUDA);
3. validates with attngym.validation.validate_rows, judged per dtype like a single run (a
   verdict over tolerance fails the run the same way): every rank attends with an output gradient
   kept on the sampled rows, the shards of out, lse and the gradients are gathered to rank 0's CPU,
   and rank 0 compares them with the float64 dense reference, computed on its CPU (sampled q rows
   against the whole K/V: O(R·S) host memory, no device memory beyond the shards);
4. times fwd, bwd, fwd+bwd together with its peers (bench.time_fn; every rank makes the same
   calls), then one instrumented forward (per-step compute, pairs, bytes), a transfer-only pass
   (per-step transfer time) and, on rank 0, the whole problem on one device with the same kernel
   (single_fwd_ms, efficiency; with a backward also single_fwd_bwd_ms, efficiency_fwd_bwd).

Rank 0 alone does the float64 reference and the one-device comparison (which needs the whole
problem on its device, briefly). The other ranks wait for it at barriers of a separate gloo group
whose timeout is topology.timeout_s + LONG_WAIT_S, not topology.timeout_s: the one-device run of a
long sequence takes about P times a CP forward per call, and the peers must neither time out nor
wait forever if rank 0 dies. Measuring the one-device run on every rank at once was rejected: it
would put the whole problem on every device, which is what context parallelism avoids. On CPU the
dense one-device reference materialises B·H·S² scores, so it is skipped (logged; single_fwd_ms
and efficiency None) when they exceed SINGLE_CPU_MAX_BYTES.

Rank 0's metrics come back to the caller (layout from base_metrics, the transport as resolved);
the other ranks log to rank<N>.log in the run folder.
Shape legend: B batch, H query heads, G kv heads, S sequence, D head dim, R validated rows.
"""

from __future__ import annotations

import datetime
import logging
import statistics
import time
import weakref
from pathlib import Path
from typing import Any

import torch

from attngym import kernels, registry
from attngym.config import Settings
from attngym.device import sync
from attngym.inputs import make_inputs, torch_dtype
from attngym.metrics import pass_metrics
from attngym.validation import sample_rows, validate_rows

log = logging.getLogger(__name__)

# How much longer than topology.timeout_s the other ranks wait for rank 0's float64 reference and
# one-device comparison (see the module docstring).
LONG_WAIT_S = 3600.0
# On CPU the one-device comparison is skipped above this many bytes of float64 B·H·S² scores.
SINGLE_CPU_MAX_BYTES = 2 * 2**30


def check_hardware(settings: Settings) -> None:
    """ConfigError for a transport that cannot run here, before any tensor work (no collective
    needed).

    transport=copy_engine on CPU (and any transport that cannot move this device's tensors) fails
    on `topology.transport`. Ranks against GPUs and seq_len against the layout were checked with
    the settings (attngym.config); ranks outside one NVLink domain with copy_engine are caught on
    the ranks (resolve_transport).
    """
    from attngym.distributed.transport import check_transport

    check_transport(settings.topology.transport, settings.device, key="topology.transport")


def run_context_parallel(settings: Settings, run_dir: Path, kind: str) -> dict[str, Any]:
    """Check, launch the ranks, and return rank 0's metrics (kind: "ring" or "allgather")."""
    from attngym.distributed.launch import launch

    check_hardware(settings)
    metrics = settings.describe()
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
    from attngym.distributed.transport import clear_cache, resolve_transport

    topo = settings.topology
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if settings.device == "cuda"
        else torch.device("cpu")
    )
    resolved = resolve_transport(topo.transport, device, key="topology.transport")
    log.info("%s attention: rank %d of %d, transport %s", kind, rank, world_size, resolved.name)
    wait_group = _gloo_group(topo.timeout_s + LONG_WAIT_S)
    try:
        return _rank_body(rank, world_size, settings, kind, device, resolved, wait_group)
    finally:
        # Free this job's channels and symmetric memory: the next job of a torchrun sweep may use
        # other shapes, and every rank is past the job's last transfer and barrier here.
        sync(device)
        clear_cache()


# Default group -> {timeout: a gloo group of every rank, for the long waits}.
_WAIT_GROUPS: weakref.WeakKeyDictionary[Any, dict[float, Any]] = weakref.WeakKeyDictionary()


def _gloo_group(timeout_s: float):
    """The gloo group for the long waits, built once per default group and kept: re-creating it
    for every job of a torchrun sweep raced with peers still finishing the previous job."""
    import torch.distributed as dist

    groups = _WAIT_GROUPS.setdefault(dist.group.WORLD, {})
    if timeout_s not in groups:
        groups[timeout_s] = dist.new_group(
            backend="gloo", timeout=datetime.timedelta(seconds=timeout_s)
        )
    return groups[timeout_s]


def _rank_body(rank, world_size, settings, kind, device, resolved, wait_group) -> dict[str, Any]:
    import torch.distributed as dist

    from attngym import bench
    from attngym.distributed import (
        allgather_attention,
        load_imbalance,
        ring_attention,
        shard,
        unshard,
    )
    from attngym.distributed.ring import CPStats

    topo = settings.topology
    dtype = torch_dtype(settings.dtype)
    shape = settings.shape
    seq_len = shape.seq_len
    variant_cpu = settings.variant
    variant = variant_cpu.to(device)
    do_bwd = "bwd" in settings.passes
    metrics: dict[str, Any] = {
        "transport": resolved.name,
        "bwd_status": "ok" if do_bwd else "not requested",
    }

    fn = ring_attention if kind == "ring" else allgather_attention
    cp_kwargs = dict(
        transport=resolved.name,
        layout=topo.layout,
        block_size=tuple(settings.block_size),
        kernel_options=settings.kernel_options or None,
        timeout_s=topo.timeout_s,
        compile=settings.compile,
        compile_mode=settings.compile_mode,
    )

    def mine(t: torch.Tensor) -> torch.Tensor:
        return shard(t, rank, world_size, topo.layout, variant=variant_cpu)

    # 1. Whole-sequence inputs on the CPU (the same draw on every rank), only the shard on device.
    whole = make_inputs(settings.shape, settings.seed, "cpu", torch.float32)  # q, k, v, grad_out
    q_s, k_s, v_s, g_s = (mine(t).to(device=device, dtype=dtype) for t in whole)
    # Rank 0 keeps the whole inputs on its CPU, rounded to the run dtype like the shards.
    whole = tuple(t.to(dtype) for t in whole) if rank == 0 else None
    for t in (q_s, k_s, v_s):
        t.requires_grad_(do_bwd)

    def fwd(stats=None) -> torch.Tensor:
        return fn(q_s, k_s, v_s, variant, stats=stats, **cp_kwargs)

    def gather(t: torch.Tensor) -> torch.Tensor | None:
        """Every rank's shard of t, unsharded on rank 0's CPU (None elsewhere)."""
        t = t.detach().cpu().contiguous()
        parts = [torch.empty_like(t) for _ in range(world_size)] if rank == 0 else None
        dist.gather(t, parts, dst=0, group=wait_group)
        return unshard(parts, topo.layout, variant=variant_cpu) if rank == 0 else None

    # 2. The first call, timed apart.
    start = time.perf_counter()
    out = fwd()
    if do_bwd:
        torch.autograd.grad(out, (q_s, k_s, v_s), g_s)
    sync(device)
    metrics["compile_s"] = time.perf_counter() - start
    del out

    # 3. Validation on sampled rows (rank 0 judges; the others attend and send their shards).
    if settings.validate:
        rows = sample_rows(seq_len, settings.validate_rows, settings.seed, "cpu")
        keep = torch.zeros(1, 1, seq_len, 1, dtype=torch.bool)
        keep[:, :, rows] = True
        g_masked_s = torch.where(mine(keep).to(device), g_s, torch.zeros_like(g_s))

        def attend(g_masked: torch.Tensor | None = None):
            """The CP call with the row-masked output gradient; (out, lse, grads) on rank 0."""
            dist.barrier(group=wait_group)  # the peers wait here while rank 0 runs the reference
            stats = CPStats()
            out_s = fwd(stats)
            grads = None
            if do_bwd:
                grads = torch.autograd.grad(out_s, (q_s, k_s, v_s), g_masked_s)
                grads = tuple(gather(g) for g in grads)
            return gather(out_s), gather(stats.lse), grads

        if rank == 0:
            q, k, v, grad_out = whole
            metrics.update(
                validate_rows(
                    variant_cpu,
                    q,
                    k,
                    v,
                    grad_out,
                    attend,
                    do_bwd=do_bwd,
                    max_rows=settings.validate_rows,
                    seed=settings.seed,
                )
            )
        else:
            attend()
        dist.barrier(group=wait_group)  # ... and here while it finishes the reference backward
    else:
        metrics["validated_rows"] = 0
        metrics["validation"] = "not run (validate=false)"

    # 4. Timings: every rank makes the same calls.
    block_mask = None
    if rank == 0:
        block_mask = kernels.make_block_mask(
            variant, seq_len, seq_len, block_size=settings.block_size, device=device
        )
    sparsity = float(bench.block_sparsity(block_mask))
    metrics["sparsity"] = sparsity
    metrics["load_imbalance"] = load_imbalance(
        topo.layout, variant, world_size, seq_len, settings.block_size, device
    )
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
    metrics.update(pass_metrics(timings, shape, seq_len, sparsity))

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
    for key in ("single_fwd_ms", "efficiency", "single_fwd_bwd_ms", "efficiency_fwd_bwd"):
        metrics[key] = None
    if rank == 0:
        dense_bytes = shape.batch * shape.heads * seq_len**2 * 8
        if device.type == "cpu" and dense_bytes > SINGLE_CPU_MAX_BYTES:
            log.info(
                "one-device comparison skipped: the dense CPU reference would hold %.1f GiB of "
                "scores (B·H·S²·8 bytes, limit %.1f GiB); efficiency not measured",
                dense_bytes / 2**30,
                SINGLE_CPU_MAX_BYTES / 2**30,
            )
        else:
            metrics.update(
                _single_device(settings, variant, whole, block_mask, device, timed, timings, kind)
            )
    del whole
    dist.barrier(group=wait_group)
    return metrics


def _single_device(settings, variant, whole, block_mask, device, timed, timings, kind):
    """The whole problem on rank 0's device with the same kernel: single_<pass>_ms, efficiency.

    efficiency = (one-device time / world_size) / CP time, for fwd and (when the CP run did a
    backward) fwd+bwd: 1.0 is perfect scaling.
    """
    import torch.distributed as dist

    world_size = dist.get_world_size()
    do_bwd = "fwd_bwd" in timings
    q, k, v = (t.to(device).requires_grad_(do_bwd) for t in whole[:3])
    grad_out = whole[3].to(device)

    def call():
        return kernels.attend_chunk(
            q,
            k,
            v,
            variant,
            backend="auto",
            block_size=tuple(settings.block_size),
            block_mask=block_mask if device.type == "cuda" else None,
            kernel_options=settings.kernel_options or None,
            compile=settings.compile,
            compile_mode=settings.compile_mode,
        )[0]

    with torch.no_grad():
        call()
        single = {"fwd": timed(call)}
    if do_bwd:
        single["fwd_bwd"] = timed(lambda: torch.autograd.grad(call(), (q, k, v), grad_out))
    out: dict[str, Any] = {}
    for name, result in single.items():
        suffix = "" if name == "fwd" else f"_{name}"
        efficiency = (result.median_ms / world_size) / timings[name].median_ms
        out[f"single_{name}_ms"] = result.median_ms
        out[f"efficiency{suffix}"] = efficiency
        log.info(
            "%s %s %.2f ms vs one device %.2f ms over %d ranks: efficiency %.2f",
            kind,
            name,
            timings[name].median_ms,
            result.median_ms,
            world_size,
            efficiency,
        )
    return out


def _transfer_ms(kind: str, transport, k_s: torch.Tensor, timeout_s: float, repeats: int) -> float:
    """Median time of one step's K/V transfer alone (ring: one push; all-gather: one gather).

    The ring follows the channel's step protocol: step i pushes what it holds (its own K/V at
    i = 0, else the slot received at step i) and receives step i + 1 once; the slot of step i is
    released only after its onward push is queued.
    """
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
            cur = kv
            for i in range(world_size - 1):
                sync(k_s.device)
                start = time.perf_counter()
                chan.send(cur, i)
                nxt = chan.recv(i + 1)
                sync(k_s.device)
                times.append((time.perf_counter() - start) * 1e3)
                if i > 0:
                    chan.release(i)  # the onward push out of this slot is queued
                cur = nxt
            chan.release(world_size - 1)
            chan.join()
    else:
        ag = transport.allgather(
            tuple(k_s.shape), 2, 2, dtype=k_s.dtype, device=k_s.device, timeout_s=timeout_s
        )
        for _ in range(repeats):
            sync(k_s.device)
            start = time.perf_counter()
            ag.start(kv)
            ag.wait(kv)
            sync(k_s.device)
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)
