"""Each simulated rank's per-step compute (fwd, bwd ms) of one scheme, beside the one-device time
of one rank's share: where a rank's time goes when its efficiency is low.

    python experiments/cp_model/step_times.py --kind ring --layout contiguous --world-size 8 \
        --variant sliding_window --seq-len 131072
"""

from __future__ import annotations

import argparse

import torch
from host_time import documents  # beside this script

from attngym import bench
from attngym.distributed.cp import CPOptions, attend_chunk
from attngym.distributed.simulate import bench_timer, simulate
from attngym.distributed.topologies import TOPOLOGIES
from attngym.variants.causal import causal
from attngym.variants.document import document
from attngym.variants.sliding_window import sliding_window


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--kind", default="ring")
    p.add_argument("--layout", default="contiguous")
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--variant", default="sliding_window")
    p.add_argument("--seq-len", type=int, default=131072)
    a = p.parse_args()
    S, dev = a.seq_len, torch.device("cuda")
    variant = {
        "sliding_window": lambda: sliding_window(1024),
        "causal": causal,
        "document": lambda: document(documents(S)),
    }[a.variant]().to(dev)
    q, k, v, g = (torch.randn(1, 8, S, 128, device=dev, dtype=torch.bfloat16) for _ in range(4))
    sim = simulate(
        TOPOLOGIES[a.kind], q, k, v, g, variant, world_size=a.world_size, layout=a.layout,
        options=CPOptions(), timer=bench_timer(dev, 1, 5),
    )  # fmt: skip
    for r, w in enumerate(sim.ranks):
        fwd = " ".join(f"{x:.3f}" for x in w.fwd_ms)
        bwd = " ".join(f"{x:.3f}" for x in w.bwd_ms)
        print(f"rank {r}: fwd [{fwd}] bwd [{bwd}] total {w.compute_fwd_bwd_ms:.3f}")
    n = S // a.world_size  # one rank's share as one call: its rows against what they read
    qs, ks, vs = (t[:, :, S - n :].detach().requires_grad_() for t in (q, k, v))

    def share():
        out, _ = attend_chunk(qs, ks, vs, variant, q_offset=S - n, kv_offset=S - n)
        out.backward(g[:, :, :n])

    print(
        f"one call over the last {n} rows (own keys only): "
        f"{bench.time_fn(share, warmup=2, repeats=5, device=dev).median_ms:.3f} ms fwd+bwd"
    )


if __name__ == "__main__":
    main()
