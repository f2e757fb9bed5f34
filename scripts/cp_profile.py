"""Where a context-parallel call spends its time: GPU kernels, GPU idle time, host syncs, ops.

Runs one context-parallel topology (ring, allgather, ulysses or hybrid: its function from the
topology table, attngym.distributed.schemes.topologies) on every rank (one process each), then on
rank 0.

On CUDA (one rank per GPU):
    * one forward and one forward+backward under torch.cuda.set_sync_debug_mode("warn"), with
      each synchronising call site counted (file:line of the attngym frame that caused it);
    * three forwards and three forward+backwards under torch.profiler, per call: wall time, the
      summed duration of the GPU kernels and copies (GPU busy), the kernels by time, the CUDA
      runtime/driver calls the host made and the aten ops it dispatched (top level);
    * with --cuda-graph, forward+backward as CUDA graphs (torch.cuda.make_graphed_callables)
      against eager (`graphed`): GPU ms of each and the replay's error against the eager call.
A GPU that is busy for much less than the wall time waits on the host (launch overhead or
syncs); a busy GPU with slow kernels points at the kernel.

"launches_per_call" sums the host's kernel-launch calls per call: the number to compare before and
after a change of the CP code (for instance --backward recompute against --backward flex).

On CPU (`--device cpu --world-size P`, gloo ranks, the reference chunk kernel): one forward and
one forward+backward after two warm-up calls, each under CallCost: the attention kernel calls
(`kernel_calls`), every other aten op that computes, by name (`ops`, views left out;
`ops_per_call` their sum), and the bytes those ops and the kernels' outputs allocate
(`alloc_bytes`) and hold at most at once (`peak_bytes`). The kernels' own work (the dense
reference's intermediates) is not counted: on a GPU it is one flex kernel. The same counts at
world size 1 say what the CP machinery costs beyond the one-device call.

Usage (two or more GPUs):
    python scripts/cp_profile.py --kind ring --seq-len 32768 --layout zigzag --out profile.json
    python scripts/cp_profile.py --kind ring --backward recompute --out profile_recompute.json
    python scripts/cp_profile.py --kind hybrid --a2a-size 2 --across allgather --out hybrid.json
    python scripts/cp_profile.py --kind ring --cuda-graph --out ring_graphed.json
On CPU:
    python scripts/cp_profile.py --device cpu --world-size 1 --kind ring --variant sliding_window \
        --seq-len 2048 --window 128 --heads 2 --head-dim 16 --layout contiguous --out ops.json
"""

from __future__ import annotations

import argparse
import collections
import json
import time
import traceback
import warnings
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from attngym import registry, variants
from attngym.distributed import CPOptions, shard
from attngym.distributed.call.cp import BACKWARDS
from attngym.distributed.placement.layout import LAYOUTS
from attngym.distributed.ranks.launch import launch
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
    aten_ops = 0
    for e in prof.events():
        if e.device_type != DeviceType.CPU:
            continue
        if e.name.startswith(("cuda", "cu")):
            host[e.name] += 1 / repeats
        elif e.name.startswith("aten::") and not _has_aten_parent(e):
            aten_ops += 1
    return {
        "wall_ms": wall_ms,
        "gpu_busy_ms": sum(by_name.values()),
        "gpu_ops_per_call": len(gpu) / repeats,
        # Kernel launches the host issued per call (runtime and driver API), the host-cost figure
        # to compare before and after a change (e.g. --backward recompute against flex).
        "launches_per_call": sum(n for name, n in host.items() if "LaunchKernel" in name),
        # Top-level aten ops the host dispatched per call (views included; the CPU mode's
        # CallCost counts the computing ones by name).
        "aten_ops_per_call": aten_ops / repeats,
        "top_gpu_ms": dict(by_name.most_common(12)),
        "host_cuda_calls_per_call": dict(host.most_common(12)),
    }


def _has_aten_parent(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return True
        parent = parent.cpu_parent
    return False


class CallCost(TorchDispatchMode):
    """The aten ops and memory of one call beyond its attention kernels (CPU counting).

    Kernels: attngym.kernels.attend_chunk (every topology's chunk or whole-shard call), the
    flex backward op's call (attngym.distributed.call.flex_backward._call_op) and the autograd
    backward of an attend_chunk (the graph nodes it recorded), each counted once in
    `kernel_calls`; the ops they dispatch are theirs and not counted. Every other op that
    computes (not a view) is counted by name in `ops`. Memory: the storages those ops create and
    the tensors the kernels return (for an autograd backward: the gradients of its inputs),
    `alloc_bytes` in all and `peak_bytes` the most alive at once (polled at every counted op and
    at the end), so a kernel's scratch, which a GPU kernel does not have, is left out.
    """

    # Higher-order ops (the flex backward op) pass to their implementation, whose aten ops come
    # back here (inside a kernel, so not counted).
    supports_higher_order_operators = True

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.kernel_calls = 0
        self.alloc_bytes = 0
        self.peak_bytes = 0
        self._inside = 0
        self._nodes: dict[int, Any] = {}  # id -> autograd node recorded by a kernel
        self._storages: dict[int, Any] = {}  # data_ptr -> the storage, held to read its use count
        self._patched: list = []
        self._hooks: list = []

    def __enter__(self):
        from attngym import kernels
        from attngym.distributed.call import flex_backward

        for module, name in ((kernels, "attend_chunk"), (flex_backward, "_call_op")):
            original = getattr(module, name)
            self._patched.append((module, name, original))
            setattr(module, name, self._kernel(original))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._poll()
            for module, name, original in self._patched:
                setattr(module, name, original)
            for handle in self._hooks:
                handle.remove()
            self._storages.clear()
            self._nodes.clear()

    def _kernel(self, original):
        def kernel(*args, **kwargs):
            self._inside += 1
            try:
                result = original(*args, **kwargs)
            finally:
                self._inside -= 1
            self.kernel_calls += 1
            tensors = [t for t in result if isinstance(t, torch.Tensor)]
            inputs = {id(t.grad_fn) for t in args if isinstance(t, torch.Tensor)}
            todo = [t.grad_fn for t in tensors if t.grad_fn is not None]
            while todo:  # the graph this kernel recorded, down to its inputs' nodes
                node = todo.pop()
                if node is None or id(node) in inputs or id(node) in self._nodes:
                    continue
                if type(node).__name__ == "AccumulateGrad":
                    continue
                self._nodes[id(node)] = node
                todo.extend(n for n, _ in node.next_functions)
            for t in tensors:
                self._track(t)
            self._on_backward([t for t in args if isinstance(t, torch.Tensor) and t.requires_grad])
            self._poll()
            return result

        return kernel

    def _on_backward(self, inputs: list[torch.Tensor]) -> None:
        """Count the autograd backward of a kernel once, and the gradients it gives its inputs."""
        fired = []

        def hook(grad):
            if not fired:
                fired.append(True)
                self.kernel_calls += 1
            self._track(grad)
            self._poll()

        self._hooks.extend(t.register_hook(hook) for t in inputs)

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self._storages and storage.nbytes():
            self._storages[storage.data_ptr()] = storage
            self.alloc_bytes += storage.nbytes()

    def _poll(self) -> None:
        live = sum(
            s.nbytes() for s in self._storages.values() if torch._C._storage_Use_Count(s._cdata) > 1
        )
        self.peak_bytes = max(self.peak_bytes, live)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        node = torch._C._current_autograd_node()
        if self._inside or (node is not None and id(node) in self._nodes) or func.is_view:
            return out
        self.ops[str(func.overloadpacket).removeprefix("aten.")] += 1
        writes = any(
            a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments
        )
        if not writes:
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self._track(t)
        self._poll()
        return out

    def report(self) -> dict:
        return {
            "kernel_calls": self.kernel_calls,
            "ops_per_call": sum(self.ops.values()),
            "ops": dict(sorted(self.ops.items())),
            "alloc_bytes": self.alloc_bytes,
            "peak_bytes": self.peak_bytes,
        }


def _cpu_worker(
    rank: int,
    world: int,
    kind: str,
    seq_len: int,
    layout: str,
    heads: int,
    variant_name: str,
    backward: str,
    options: dict,
    head_dim: int,
    window: int,
    dtype: str,
) -> dict:
    """CallCost of one forward and one forward+backward on this CPU rank (after two warm-ups)."""
    from attngym.distributed.call import flex_backward

    spec = registry.get("topology", kind)
    gen = torch.Generator().manual_seed(0)
    variant = VARIANTS[variant_name](seq_len, window)
    q, k, v, g = (
        shard(torch.randn(1, heads, seq_len, head_dim, generator=gen), rank, world, layout,
              variant=variant).to(getattr(torch, dtype)).requires_grad_()
        for _ in range(4)
    )  # fmt: skip
    cp_options = CPOptions(backward=backward)

    def call():
        return spec.attention(
            q, k, v, variant, layout=layout, options=cp_options, transport="gloo", **options
        )

    def fwd():
        with torch.no_grad():
            return call()

    def fwd_bwd():
        return torch.autograd.grad(call(), (q, k, v), g)

    for _ in range(2):  # plans, block masks and channels are built on the first calls
        fwd_bwd()
    result = {}
    for name, fn in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
        cost = CallCost()
        with cost:
            kept = fn()
        del kept
        if flex_backward.failed_before():  # counted ops of a fallback would mislead
            raise RuntimeError("the flex backward op failed under CallCost; see the log")
        ranks = [None] * world
        torch.distributed.all_gather_object(ranks, cost.report())
        result[name] = ranks  # one report per rank
    return result if rank == 0 else {}


VARIANTS = {
    "causal": lambda seq_len, window=1024: variants.get("causal"),
    "sliding_window": lambda seq_len, window=1024: variants.get(
        "sliding_window", window_size=window
    ),
    "document": lambda seq_len, window=1024: variants.get(
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
    cuda_graph: bool = False,
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

    def attend(q, k, v):
        return spec.attention(q, k, v, variant, layout=layout, options=cp_options,
                              **(options or {}))  # fmt: skip

    def call():
        return attend(q, k, v)

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
    if cuda_graph:
        result["graphed"] = _graphed(attend, (q, k, v), g)
    return result if rank == 0 else {}


def _graphed(attend, qkv, grad_out) -> dict:
    """The call's forward+backward eager and as CUDA graphs (torch.cuda.make_graphed_callables:
    one graph forward, one backward): the GPU ms of each (bench.time_fn, CUDA events, L2
    flushed) and the replay's relative error of out, dq, dk, dv against the eager call."""
    from attngym import bench

    sample = tuple(t.detach().clone().requires_grad_() for t in qkv)
    graphed = torch.cuda.make_graphed_callables(attend, sample)

    def fwd_bwd(fn):
        out = fn(*qkv)
        return [out.detach(), *torch.autograd.grad(out, qkv, grad_out)]

    got, want = fwd_bwd(graphed), fwd_bwd(attend)
    result = {
        "rel_err_out_dq_dk_dv": [
            ((a.float() - b.float()).norm() / b.float().norm()).item()
            for a, b in zip(got, want, strict=True)
        ]
    }
    for name, fn in (("eager", attend), ("graphed", graphed)):
        timing = bench.time_fn(lambda fn=fn: fwd_bwd(fn), warmup=2, repeats=10, device="cuda")
        result[f"{name}_fwd_bwd_ms"] = timing.median_ms
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    kinds = [k for k in registry.names("topology") if registry.get("topology", k).binder is None]
    parser.add_argument("--kind", choices=kinds, default="ring")
    parser.add_argument("--seq-len", type=int, default=32768)
    parser.add_argument("--layout", choices=list(LAYOUTS), default="zigzag")
    parser.add_argument("--variant", choices=list(VARIANTS), default="causal")
    parser.add_argument("--backward", choices=list(BACKWARDS), default="auto")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--a2a-size", type=int, default=None, help="hybrid: ranks per group")
    parser.add_argument("--across", default="ring", help="hybrid: ring | allgather")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--world-size", type=int, default=None, help="default: the GPU count")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--window", type=int, default=1024, help="sliding_window's look-back")
    parser.add_argument("--dtype", default="bfloat16", help="CPU inputs (CUDA: bfloat16)")
    parser.add_argument("--out", default="cp_profile.json")
    parser.add_argument(
        "--cuda-graph", action="store_true",
        help="CUDA: also time fwd+bwd captured as CUDA graphs against eager, and check the replay",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.cuda_graph and args.device != "cuda":
        parser.error("--cuda-graph: CUDA graphs need --device cuda")
    world = args.world_size or (torch.cuda.device_count() if args.device == "cuda" else 1)
    spec = registry.get("topology", args.kind)
    # hybrid's options from its flags; a topology takes the keys of its own options dataclass
    options = spec.option_values({"a2a_size": args.a2a_size, "across": args.across})
    try:
        spec.check(
            {"world_size": world, "layout": args.layout, "options": options},
            {"heads": args.heads, "kv_heads": args.heads, "seq_len": args.seq_len},
        )
    except ConfigError as err:
        parser.error(str(err))
    common = (args.kind, args.seq_len, args.layout, args.heads, args.variant, args.backward)
    if args.device == "cpu":
        worker, extra = _cpu_worker, (options, args.head_dim, args.window, args.dtype)
    else:
        worker, extra = _worker, (options, args.cuda_graph)
    measured = launch(worker, world, args=(*common, *extra), device=args.device, timeout_s=300)
    # The arguments first: a measured key of the same name (graphed, say) is never overwritten.
    result = {**vars(args), "world_size": world, "torch": torch.__version__, **measured}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
