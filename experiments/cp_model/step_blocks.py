"""What a ring step call's time follows: its blocks, or its longest row of blocks (CPU only).

Reads a `step_times.py` log of the ring (per rank and step, fwd and bwd ms), rebuilds each step
call's tiles from the whole sequence's block grid and the layout, and fits the measured fwd+bwd
time of every (rank, step) by least squares, first on (full blocks, partial blocks, one call),
then adding each call's longest query row and longest key column of blocks (partial blocks
weighted by layout.BLOCK_COSTS): a kernel's program per query block (forward) or key block
(backward) runs its blocks one after another, so one long row can outlast the rest of the call.

    python experiments/cp_model/step_blocks.py \
        experiments/cp_model/scale/step_times_ring_balanced_documents.log \
        --variant document --layout balanced --world-size 8 --seq-len 131072
"""

from __future__ import annotations

import argparse
import re

import torch
from host_time import make_variant  # beside this script

from attngym.distributed.placement import grid, layout


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("log")
    p.add_argument("--variant", default="document")
    p.add_argument("--layout", default="balanced")
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=131072)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--slots", type=int, default=0,
                   help="the GPU's SMs: the ring's placement as a run there plans it (0: by "
                        "blocks, as runs before the ring priced its step calls)")  # fmt: skip
    a = p.parse_args()
    S, P, B = a.seq_len, a.world_size, a.block
    variant = make_variant(a.variant, S)
    kernels = layout.PairKernels(8, a.slots, layout.STEP_LAUNCH, shards=True) if a.slots else None
    lay = layout.plan(a.layout, P, S, variant, device="cpu", kernels=kernels)
    partial, full = grid.block_grid(variant, S, (B, B), "cpu")
    weight = full.float() + layout.BLOCK_COSTS[1] * partial.float()
    blocks = [
        torch.cat([torch.arange(o // B, (o + n) // B) for o, n in lay.chunks(r)]) for r in range(P)
    ]
    with open(a.log) as f:
        text = f.read()
    measured = {
        int(m[1]): [float(f) + float(b) for f, b in zip(m[2].split(), m[3].split(), strict=True)]
        for m in re.finditer(r"rank (\d+): fwd \[(.*?)\] bwd \[(.*?)\]", text)
    }  # fmt: skip
    rows, times, ranks = [], [], []
    for r in range(P):
        for i, ms in enumerate(measured[r]):
            q, kv = blocks[r], blocks[(r - i) % P]  # at step i rank r holds shard r - i
            w = weight[q][:, kv]
            rows.append([full[q][:, kv].sum(), partial[q][:, kv].sum(), 1.0,
                         w.sum(1).max(), w.sum(0).max()])  # fmt: skip
            times.append(ms)
            ranks.append(r)
    X, y = torch.tensor(rows, dtype=torch.float64), torch.tensor(times, dtype=torch.float64)
    rank = torch.tensor(ranks)
    for name, cols in (("blocks and calls", 3), ("and the longest row, column", 5)):
        coef = torch.linalg.lstsq(X[:, :cols], y[:, None]).solution[:, 0]
        fit = X[:, :cols] @ coef
        r2 = 1 - ((y - fit) ** 2).sum() / ((y - y.mean()) ** 2).sum()
        terms = ", ".join(f"{c * 1e3:.2f}" for c in coef)
        print(
            f"{name}: R^2 {r2:.3f}; us per (full, partial, call, row block, column block): {terms}"
        )
        for r in range(P):
            here = rank == r
            print(f"  rank {r}: measured {y[here].sum():.2f} ms, fitted {fit[here].sum():.2f}, "
                  f"longest rows {X[here, 3].int().tolist()}")  # fmt: skip


if __name__ == "__main__":
    main()
