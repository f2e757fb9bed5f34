"""Tasks: what one run does, per topology. Each registers itself as a "task" in attngym.registry.

Every task has the signature `run(settings: Settings, run_dir: pathlib.Path) -> dict[str, Any]`
and returns flat metrics; the caller (attngym.cli) writes metrics.json, draws the pictures and
hands everything to the trackers, so a task never deals with files other than its profiler's.

Metric names (stable; W&B and the sweep summary use the same ones, from attngym.metrics). Values
are None where a quantity does not apply (e.g. gradient errors on CPU):

    status, error                    ok | failed, and the error message of a failed run
    variant, topology, world_size, transport, device, dtype
    batch, heads, kv_heads, seq_len, head_dim, block_q, block_kv
    sparsity                         fraction of (q block, kv block) pairs the block mask skips
    fwd_ms, fwd_ms_min, fwd_ms_max   forward time: median, min, max over benchmark.repeats
    bwd_ms, fwd_bwd_ms               backward only, forward + backward (median)
    fwd_tflops, bwd_tflops, fwd_bwd_tflops   achieved TFLOP/s (useful FLOPs: masked blocks excluded)
    compile_s                        the first call (compilation on CUDA), timed apart
    peak_mem_bytes                   peak memory the timed flex calls add (CUDA: beyond the inputs
                                     and what was live before; CPU: the process's peak RSS)
    err_out_max_abs, err_out_rel     output vs the float64 reference on the validated rows
    err_lse_max_abs                  log-sum-exp vs the reference
    err_dq_rel, err_dk_rel, err_dv_rel   gradients vs the reference (CUDA)
    validated_rows                   how many query rows were checked
    bwd_status                       ok | not available: <reason> | not requested
    <baseline>_<pass>_ms, <baseline>_<pass>_tflops   e.g. sdpa_fwd_ms (pass: fwd, bwd, fwd_bwd)
    flex_over_<baseline>_<pass>      baseline time / flex time (> 1: flex is faster)
    <baseline>_status                ok | skipped: <reason>

Context-parallel runs (attngym.tasks.context_parallel) add:

    layout, load_imbalance           the sequence layout; max over mean of non-empty blocks per rank
    peak_mem_bytes                   (CP: the largest over the ranks, per rank)
    single_fwd_ms, efficiency, single_fwd_bwd_ms, efficiency_fwd_bwd   against one device
    step_compute_ms, step_transfer_ms, pairs_computed, pairs_skipped, bytes_moved
    torch_cp_fwd_ms, torch_cp_fwd_bwd_ms, torch_cp_peak_mem_bytes   PyTorch's own flex CP
    attngym_over_torch_cp_<pass>     torch_cp time / attngym time (> 1: attngym is faster)
    torch_cp_status, torch_cp_bwd_status   ok | skipped: <reason> | not available: <reason>
    torch_cp_err_out_rel, torch_cp_err_out_max_abs, torch_cp_validation   torch_cp vs attngym
"""

from attngym.tasks import (
    context_parallel,  # noqa: F401  (registers "ring", "allgather")
    single,  # noqa: F401  (registers "single")
)
