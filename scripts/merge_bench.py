"""What folding one chunk pair into the CP accumulator costs: out of place against in place.

    functional  merge([acc rows, out_i], [lse rows, lse_i]) then a copy back into the rows (the
                accumulator's path before merge_into)
    in place    merge_into(acc rows, lse rows, out_i, lse_i)

Timed with attngym.bench.time_fn (median of `--repeats` calls, fresh inputs made outside the
timed region for each call) on this machine's default device; both paths give the same numbers
(the maximum difference is printed).

Usage:
    python scripts/merge_bench.py --rows 8192 --heads 8 --head-dim 128
"""

from __future__ import annotations

import argparse

import torch

from attngym.bench import time_fn
from attngym.distributed.merge import merge, merge_into


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8192, help="query rows of the chunk pair")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    shape = (1, args.heads, args.rows, args.head_dim)
    rows = slice(0, args.rows)  # the accumulator holds two chunks' rows, as a zigzag rank does

    def inputs():
        acc = torch.randn(1, args.heads, 2 * args.rows, args.head_dim, generator=gen)
        lse = torch.randn(1, args.heads, 2 * args.rows, generator=gen)
        out_i = torch.randn(shape, generator=gen).bfloat16()
        lse_i = torch.randn(shape[:3], generator=gen)
        return tuple(t.to(args.device) for t in (acc, lse, out_i, lse_i))

    def functional(acc, lse, out_i, lse_i):
        out, new = merge([acc[:, :, rows], out_i], [lse[:, :, rows], lse_i], out_dtype=acc.dtype)
        acc[:, :, rows] = out
        lse[:, :, rows] = new

    def in_place(acc, lse, out_i, lse_i):
        merge_into(acc[:, :, rows], lse[:, :, rows], out_i, lse_i)

    same = inputs()
    a, b = [t.clone() for t in same], [t.clone() for t in same]
    functional(*a)
    in_place(*b)
    print(f"max |functional - in place|: {(a[0] - b[0]).abs().max().item():.2e}")
    for name, fn in (("functional", functional), ("in place", in_place)):
        timing = time_fn(
            lambda tensors, fn=fn: fn(*tensors),
            warmup=1,
            repeats=args.repeats,
            device=args.device,
            setup=inputs,
        )
        print(f"{name:10} median {timing.median_ms:8.3f} ms  ({args.device}, {shape})")


if __name__ == "__main__":
    main()
