"""Do copy-engine copies take SMs from an SM-bound kernel, or only memory bandwidth?

Times an SM-bound kernel (a bf16 8192^3 matmul and/or the compiled FlexAttention forward, causal,
bf16 (4, 16, 8192, 128)) alone and while K/V-sized buffers are copied beside it on another stream:
    ce   copies as device-to-device memcpys (`Tensor.copy_` of contiguous tensors: copy engines),
         which is how CopyEngineChannel / CopyEngineAllGather move payload;
    sm   the same bytes moved by an elementwise kernel (`torch.mul(src, 1, out=dst)`), which
         occupies SMs, as a contrast.
Each timing is the mean over `--iters` kernels between CUDA events, after a separate warm-up (and
compile) run. Prints a markdown table and writes JSON to --out. FlexAttention FLOPs come from
attngym.bench.attention_flops (the project's one formula), with the causal block mask's sparsity.

Why raw CUDA events rather than attngym.bench.time_fn: the measurement is two streams running at
once (kernels on the current stream, copies on a side stream), each bracketed by its own events.
time_fn times one callable per call on the current stream, synchronising and flushing L2 around
each call, which would serialise the side-stream copies against the kernel and hide the overlap
being measured.

    python scripts/copy_engine_overlap.py --kernel both --out results.json
"""

from __future__ import annotations

import argparse
import json
import math

import torch


def _time_stream(fn, iters: int, stream: torch.cuda.Stream) -> tuple[torch.cuda.Event, ...]:
    """Queue `iters` calls of fn on `stream` between two events (see the module docstring)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record()
        for _ in range(iters):
            fn()
        end.record()
    return start, end


def make_kernel(name: str, device: torch.device):
    """(callable, FLOPs per call) for an SM-bound kernel."""
    if name == "matmul":
        a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        out = torch.empty_like(a)
        return (lambda: torch.matmul(a, b, out=out)), 2 * 8192**3
    if name == "flex":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        from attngym.bench import attention_flops, block_sparsity

        B, H, S, D = 4, 16, 8192, 128
        q, k, v = (torch.randn(B, H, S, D, device=device, dtype=torch.bfloat16) for _ in range(3))
        mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, S, S, device=device)
        flex = torch.compile(flex_attention, dynamic=False)
        # causal: the forward FLOPs of the blocks the mask computes
        flops = attention_flops(B, H, S, S, D, sparsity=block_sparsity(mask))
        return (lambda: flex(q, k, v, block_mask=mask)), flops
    raise ValueError(f"kernel: expected matmul or flex, got {name!r}")


def measure(kernel: str, copy_bytes: int, iters: int, device: torch.device) -> list[dict]:
    fn, flops = make_kernel(kernel, device)
    numel = copy_bytes // 2
    src = torch.randn(numel, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copies = {"ce": lambda: dst.copy_(src), "sm": lambda: torch.mul(src, 1, out=dst)}
    main, side = torch.cuda.current_stream(device), torch.cuda.Stream(device)

    for f in (fn, *copies.values()):  # warm-up (compile) apart from the timings
        for _ in range(3):
            f()
    torch.cuda.synchronize()

    def run(kernel_iters: int, copy_name: str | None, copy_iters: int):
        side.wait_stream(main)
        copy_ev = None
        if copy_name is not None:
            copy_ev = _time_stream(copies[copy_name], copy_iters, side)
        kern_ev = _time_stream(fn, kernel_iters, main) if kernel_iters else None
        torch.cuda.synchronize()
        kern_ms = kern_ev[0].elapsed_time(kern_ev[1]) / kernel_iters if kern_ev else None
        copy_ms = copy_ev[0].elapsed_time(copy_ev[1]) / copy_iters if copy_ev else None
        return kern_ms, copy_ms

    kern_alone, _ = run(iters, None, 0)
    rows = [dict(kernel=kernel, copies="none", kernel_ms=kern_alone)]
    for name in copies:
        _, copy_alone = run(0, name, 20)
        # enough copies to cover the kernel window
        n_copy = max(1, math.ceil(iters * kern_alone / copy_alone))
        kern_ms, copy_ms = run(iters, name, n_copy)
        rows.append(
            dict(
                kernel=kernel,
                copies=name,
                kernel_ms=kern_ms,
                copy_alone_gbs=2 * copy_bytes / copy_alone / 1e6,
                copy_concurrent_gbs=2 * copy_bytes / copy_ms / 1e6,
            )
        )
    for row in rows:
        row["tflops"] = flops / row["kernel_ms"] / 1e9
        row["slowdown"] = row["kernel_ms"] / kern_alone
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kernel", choices=["matmul", "flex", "both"], default="both")
    parser.add_argument(
        "--copy-mib",
        type=int,
        default=512,
        help="bytes per copy (K+V of a (4,16,4096,128) bf16 shard)",
    )
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    kernels = ["matmul", "flex"] if args.kernel == "both" else [args.kernel]
    rows = [r for k in kernels for r in measure(k, args.copy_mib << 20, args.iters, device)]
    meta = dict(
        device=torch.cuda.get_device_name(device),
        torch=torch.__version__,
        copy_mib=args.copy_mib,
        iters=args.iters,
    )
    print(meta)
    head = ["kernel", "copies beside it", "kernel ms", "TFLOP/s", "slowdown"]
    head += ["copy GB/s alone", "copy GB/s concurrent"]
    print("| " + " | ".join(head) + " |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['kernel']} | {r['copies']} | {r['kernel_ms']:.3f} | {r['tflops']:.0f} | "
            f"{r['slowdown']:.3f} | {r.get('copy_alone_gbs', float('nan')):.0f} | "
            f"{r.get('copy_concurrent_gbs', float('nan')):.0f} |"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=2)


if __name__ == "__main__":
    main()
