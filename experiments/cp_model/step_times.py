"""Each simulated rank's per-step compute (fwd, bwd ms) of one scheme, beside the one-device time
of one rank's share: where a rank's time goes when its efficiency is low.

    python experiments/cp_model/step_times.py --kind ring --layout contiguous --world-size 8 \
        --variant sliding_window --seq-len 131072
"""

from __future__ import annotations

import torch
from host_time import parser, problem  # beside this script

from attngym import bench
from attngym.distributed.cp import CPOptions, attend_chunk
from attngym.distributed.simulate import bench_timer, simulate
from attngym.distributed.topologies import TOPOLOGIES


def main() -> None:
    a = parser("ring").parse_args()
    S, dev = a.seq_len, torch.device("cuda")
    variant, q, k, v, g = problem(a)
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
    qa, ka, va = (t.detach().requires_grad_() for t in (q, k, v))

    def whole(backward: bool):
        out, _ = attend_chunk(qa, ka, va, variant, q_offset=0, kv_offset=0)
        if backward:
            out.backward(g)

    fwd, both = (bench.time_fn(lambda b=b: whole(b), warmup=2, repeats=5, device=dev).median_ms
                 for b in (False, True))  # fmt: skip
    P = a.world_size
    print(
        f"one device, whole problem: fwd {fwd:.3f} fwd+bwd {both:.3f} ms; "
        f"a rank's share (/{P}): fwd {fwd / P:.3f} bwd {(both - fwd) / P:.3f} ms"
    )


if __name__ == "__main__":
    main()
