"""Each simulated rank's per-step compute (fwd, bwd ms) of one scheme, beside the one-device time
of one rank's share: where a rank's time goes when its efficiency is low. `--kernels` also
prints each item's device kernels (torch.profiler, the item run eagerly), grouped by name: what
a step call's fixed cost is made of.

    python experiments/cp_model/step_times.py --kind ring --layout contiguous --world-size 8 \
        --variant sliding_window --seq-len 131072 [--kernels]
"""

from __future__ import annotations

import collections

import torch
from host_time import parser, placed, problem  # beside this script

from attngym import bench
from attngym.distributed.call.cp import CPOptions, attend_chunk
from attngym.distributed.model.simulate import bench_timer, simulate
from attngym.distributed.schemes.topologies import TOPOLOGIES


def kernels(fn, calls: int = 3) -> list[tuple[str, float, int]]:
    """(kernel name, device µs per call, launches per call) of `fn`, longest first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    us, count = collections.Counter(), collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            us[e.name] += e.time_range.elapsed_us() / calls
            count[e.name] += 1
    return [(name, t, count[name] // calls) for name, t in us.most_common()]


def main() -> None:
    p = parser("ring")
    p.add_argument("--kernels", action="store_true", help="print each item's device kernels")
    a = p.parse_args()
    S, dev = a.seq_len, torch.device("cuda")
    variant, q, k, v, g = problem(a)
    stream, n_items = bench_timer(dev, 1, 5), [0]

    def timer(item, which):
        timed = stream(item, which)
        if a.kernels:
            listed = kernels(item.fwd if which == "fwd" else item.bwd)
            total = sum(t for _, t, _ in listed)
            print(f"item {n_items[0]} {which}: {timed.ms * 1e3:.0f} µs timed, kernels {total:.0f}")
            for name, t, n in listed:
                print(f"    {t:8.1f} µs x{n}  {name[:110]}")
            n_items[0] += which == "bwd" or item.bwd is None
        return timed

    sim = simulate(
        TOPOLOGIES[a.kind], q, k, v, g, variant, world_size=a.world_size,
        layout=placed(a, variant), options=CPOptions(), timer=timer,
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
