"""Where a context-parallel step spends its time: GPU kernels, GPU idle time and host syncs.

Runs one context-parallel topology (ring, allgather, ulysses or hybrid: its function from the
topology table, attngym.distributed.topologies) on every GPU (one process each), then on rank 0:
    * one forward and one forward+backward under torch.cuda.set_sync_debug_mode("warn"), with
      each synchronising call site counted (file:line of the attngym frame that caused it);
    * three forwards and three forward+backwards under torch.profiler, per call: wall time, the
      summed duration of the GPU kernels and copies (GPU busy), the kernels by time and the CUDA
      runtime/driver calls the host made.
A GPU that is busy for much less than the wall time waits on the host (launch overhead or
syncs); a busy GPU with slow kernels points at the kernel.

"launches_per_call" sums the host's kernel-launch calls per call: the number to compare before and
after a change of the CP code (for instance --backward recompute against --backward flex).

Usage (two or more GPUs):
    python scripts/cp_profile.py --kind ring --seq-len 32768 --layout zigzag --out profile.json
    python scripts/cp_profile.py --kind ring --backward recompute --out profile_recompute.json
    python scripts/cp_profile.py --kind hybrid --a2a-size 2 --across allgather --out hybrid.json
"""

from __future__ import annotations

import argparse
import collections
import json
import time
import traceback
import warnings

import torch

from attngym import registry, variants
from attngym.distributed import CPOptions, shard
from attngym.distributed.cp import BACKWARDS
from attngym.distributed.launch import launch
from attngym.distributed.layout import LAYOUTS
from attngym.errors import ConfigError


def _sync_sites(call) -> dict[str, int]:
    """Count the attngym call sites of the synchronising operations `call` makes."""
    sites: collections.Counter[str] = collections.Counter()

    def on_warning(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack() if "/attngym/" in f.filename]
        where = (
            f"{frames[-1].filename.split('/attngym/')[-1]}:{frames[-1].lineno}" if frames else "?"
        )
        sites[f"{where}: {str(message)[:80]}"] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = on_warning
        torch.cuda.set_sync_debug_mode("warn")
        try:
            call()
            torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return dict(sites)


def _profile(call, repeats: int = 3) -> dict:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(repeats):
            call()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - start) * 1e3 / repeats
    gpu = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    by_name: collections.Counter[str] = collections.Counter()
    for e in gpu:
        by_name[e.name[:90]] += e.device_time / 1e3 / repeats
    host: collections.Counter[str] = collections.Counter()
    for e in prof.events():
        if e.device_type == DeviceType.CPU and e.name.startswith(("cuda", "cu")):
            host[e.name] += 1 / repeats
    return {
        "wall_ms": wall_ms,
        "gpu_busy_ms": sum(by_name.values()),
        "gpu_ops_per_call": len(gpu) / repeats,
        # Kernel launches the host issued per call (runtime and driver API), the host-cost figure
        # to compare before and after a change (e.g. --backward recompute against flex).
        "launches_per_call": sum(n for name, n in host.items() if "LaunchKernel" in name),
        "top_gpu_ms": dict(by_name.most_common(12)),
        "host_cuda_calls_per_call": dict(host.most_common(12)),
    }


VARIANTS = {
    "causal": lambda seq_len: variants.get("causal"),
    "sliding_window": lambda seq_len: variants.get("sliding_window", window_size=1024),
    "document": lambda seq_len: variants.get(
        "document", doc_lengths=[seq_len // 2, seq_len // 4, seq_len // 8, seq_len // 8]
    ),
}


def _worker(
    rank: int,
    world: int,
    kind: str,
    seq_len: int,
    layout: str,
    heads: int,
    variant_name: str = "causal",
    backward: str = "auto",
    options: dict | None = None,
) -> dict:
    spec = registry.get("topology", kind)
    device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator().manual_seed(0)
    variant = VARIANTS[variant_name](seq_len).to(device)
    q, k, v, g = (
        shard(
            torch.randn(1, heads, seq_len, 128, generator=gen), rank, world, layout, variant=variant
        )
        .to(device, torch.bfloat16)
        .requires_grad_()
        for _ in range(4)
    )
    cp_options = CPOptions(backward=backward)

    def call():
        return spec.attention(
            q, k, v, variant, layout=layout, options=cp_options, **(options or {})
        )

    def fwd():
        with torch.no_grad():
            return call()

    def fwd_bwd():
        out = call()
        return torch.autograd.grad(out, (q, k, v), g)

    for _ in range(2):  # compile and warm up
        fwd_bwd()
    torch.cuda.synchronize()
    result = {
        "sync_sites_fwd": _sync_sites(fwd),
        "sync_sites_fwd_bwd": _sync_sites(fwd_bwd),
        "fwd": _profile(fwd),
        "fwd_bwd": _profile(fwd_bwd),
    }
    return result if rank == 0 else {}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=registry.names("topology"), default="ring")
    parser.add_argument("--seq-len", type=int, default=32768)
    parser.add_argument("--layout", choices=list(LAYOUTS), default="zigzag")
    parser.add_argument("--variant", choices=list(VARIANTS), default="causal")
    parser.add_argument("--backward", choices=list(BACKWARDS), default="auto")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--a2a-size", type=int, default=None, help="hybrid: ranks per group")
    parser.add_argument("--across", default="ring", help="hybrid: ring | allgather")
    parser.add_argument("--out", default="cp_profile.json")
    args = parser.parse_args(argv)
    world = torch.cuda.device_count()
    spec = registry.get("topology", args.kind)
    options = {key: getattr(args, key) for key in spec.options}
    try:
        spec.check(
            heads=args.heads,
            kv_heads=args.heads,
            seq_len=args.seq_len,
            world_size=world,
            layout=args.layout,
            options=options,
        )
    except ConfigError as err:
        parser.error(str(err))
    result = launch(
        _worker,
        world,
        args=(
            args.kind,
            args.seq_len,
            args.layout,
            args.heads,
            args.variant,
            args.backward,
            options,
        ),
        device="cuda",
        timeout_s=300,
    )
    result.update(vars(args), world_size=world, torch=torch.__version__)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
