"""attngym's reported forward TFLOP/s against a bare, hand-written compiled flex call.

Both are timed in one process, on inputs of the same shape, one after the other (bare, attngym,
bare), so the ratio shows what the framework adds inside its timed region. The bare loop uses the
same method as attngym.bench.time_fn (CUDA events around each call, L2 flushed before each call).
The bare call asks for no lse; attngym's chunk kernel returns it.

    python experiments/h200_flex/bare_flex.py [--seq-len 8192] [--head-dim 128] [--repeats 50]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention


def bare_tflops(batch, heads, seq_len, head_dim, repeats) -> tuple[float, float]:
    """Median forward time (ms) and TFLOP/s of a hand-written compiled causal flex call."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(batch, heads, seq_len, head_dim, device="cuda", dtype=torch.bfloat16,
                    generator=gen)
        for _ in range(3)
    )  # fmt: skip
    block_mask = create_block_mask(
        lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, seq_len, seq_len, device="cuda"
    )
    flex = torch.compile(flex_attention)
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    with torch.no_grad():
        for _ in range(3):
            flex(q, k, v, block_mask=block_mask)
        torch.cuda.synchronize()
        events = []
        for _ in range(repeats):
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            flex(q, k, v, block_mask=block_mask)
            end.record()
            events.append((start, end))
        torch.cuda.synchronize()
    ms = statistics.median(s.elapsed_time(e) for s, e in events)
    # Kept blocks by hand: causal over (S/128)^2 blocks keeps n(n+1)/2 of them.
    n = seq_len // 128
    kept = n * (n + 1) / 2 / n**2
    flops = 4 * batch * heads * seq_len * seq_len * head_dim * kept
    return ms, flops / (ms * 1e-3) / 1e12


def attngym_tflops(batch, heads, seq_len, head_dim, repeats) -> tuple[float, float]:
    """attngym's single-device task, forward only, no baselines: its fwd_ms and fwd_tflops."""
    from attngym.runner.config import Benchmark, Settings, Shape
    from attngym.runner.tasks.single import run

    settings = Settings(
        attention={"name": "causal"},
        shape=Shape(batch=batch, heads=heads, seq_len=seq_len, head_dim=head_dim),
        benchmark=Benchmark(warmup=3, repeats=repeats),
        device="cuda",
        dtype="bfloat16",
        passes=("fwd",),
        baselines=(),
        validate=False,
    )
    with tempfile.TemporaryDirectory() as tmp:
        metrics = run(settings, Path(tmp))
    return metrics["fwd_ms"], metrics["fwd_tflops"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    shape = (args.batch, args.heads, args.seq_len, args.head_dim, args.repeats)
    rows = [("bare", *bare_tflops(*shape)), ("attngym", *attngym_tflops(*shape))]
    rows.append(("bare", *bare_tflops(*shape)))
    print("| who | fwd ms | TFLOP/s |\n|---|---|---|")
    for who, ms, tf in rows:
        print(f"| {who} | {ms:.3f} | {tf:.1f} |")
    bare = (rows[0][2] + rows[2][2]) / 2
    print(f"attngym / bare (mean of the two bare runs): {rows[1][2] / bare:.4f}")


if __name__ == "__main__":
    main()
