"""Where a simulated rank's time goes: the host's time to issue each item of work against the
GPU's time to run it, beside the project's timing (bench.time_fn).

A call whose host issues its kernels more slowly than the GPU runs them is bound by the host: in
a stream of such calls the GPU waits. For every distinct item a scheme's simulation times, this
measures three numbers (ms per call):

    timed   bench.time_fn's median, as the simulation prices it (L2 flushed, host runs ahead)
    host    the host's time to issue one call, the GPU held busy by a spin kernel meanwhile
    gpu     the GPU's time per call when the calls are already queued (back to back)

and then prices the scheme with each (timed, gpu, max(host, gpu)), beside the one-device call of
the whole sequence measured the same three ways.

    python experiments/cp_model/host_time.py --kind allgather --layout contiguous \
        --world-size 8 --variant sliding_window --seq-len 131072 [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from attngym import bench
from attngym.distributed.cp import CPOptions, attend_chunk
from attngym.distributed.simulate import simulate
from attngym.distributed.topologies import TOPOLOGIES
from attngym.distributed.transfer_model import fabric
from attngym.variants.causal import causal
from attngym.variants.document import document
from attngym.variants.sliding_window import sliding_window

SPIN_CYCLES = int(4e8)  # ~0.2 s on an H200: longer than the host takes to issue CALLS calls
CALLS = 10


def measure(fn, dev, profile: str | None = None) -> tuple[float, float, float]:
    """(timed, host, gpu) ms per call of fn (see the module docstring)."""
    fn()
    fn()
    torch.cuda.synchronize(dev)
    timed = bench.time_fn(fn, warmup=1, repeats=5, device=dev).median_ms
    torch.cuda.synchronize(dev)
    torch.cuda._sleep(SPIN_CYCLES)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    prof = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    for _ in range(CALLS):
        fn()
    if prof:
        prof.disable()
    host = (time.perf_counter() - t0) * 1e3 / CALLS
    end.record()
    torch.cuda.synchronize(dev)
    gpu = start.elapsed_time(end) / CALLS
    if prof:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
        print(f"--- host profile of {profile} ({CALLS} calls) ---\n{s.getvalue()}")
    return timed, host, gpu


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--kind", default="allgather")
    p.add_argument("--layout", default="contiguous")
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--variant", default="sliding_window")
    p.add_argument("--seq-len", type=int, default=131072)
    p.add_argument("--fabric", default="h200_nvlink")
    p.add_argument("--transport", default="nccl")
    p.add_argument("--profile", action="store_true", help="cProfile the host of each item")
    a = p.parse_args()
    S, dev = a.seq_len, torch.device("cuda")
    variant = {
        "sliding_window": lambda: sliding_window(1024),
        "causal": causal,
        "document": lambda: document([int(S * f) for f in (0.4, 0.1, 0.3, 0.2)]),
    }[a.variant]().to(dev)
    q, k, v, g = (torch.randn(1, 8, S, 128, device=dev, dtype=torch.bfloat16) for _ in range(4))

    seen: dict[tuple, tuple[float, float, float]] = {}

    def recording(item, which):
        key = (which, item.key)
        if key not in seen:
            fn = item.fwd if which == "fwd" else item.bwd
            label = f"{which} {str(item.key)[:90]}" if a.profile else None
            seen[key] = measure(fn, dev, label)
            t, h, gp = seen[key]
            print(
                f"item {which:3s} timed {t:7.3f} host {h:7.3f} gpu {gp:7.3f}  {str(item.key)[:80]}"
            )
        return seen[key][0], 0

    spec = TOPOLOGIES[a.kind]
    args = dict(world_size=a.world_size, layout=a.layout, options=CPOptions())
    sim = simulate(spec, q, k, v, g, variant, timer=recording, **args)
    fab = fabric(a.fabric, a.transport)

    # The one-device call, measured the same three ways.
    qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))

    def one_fwd():
        with torch.no_grad():
            attend_chunk(q, k, v, variant)

    def one_both():
        out, _ = attend_chunk(qs, ks, vs, variant)
        out.backward(g)

    single_f, single_b = measure(one_fwd, dev), measure(one_both, dev)
    print(
        f"one device fwd      timed {single_f[0]:.3f} host {single_f[1]:.3f} gpu {single_f[2]:.3f}"
    )
    print(
        f"one device fwd+bwd  timed {single_b[0]:.3f} host {single_b[1]:.3f} gpu {single_b[2]:.3f}"
    )
    for name, pick in (("timed", lambda m: m[0]), ("gpu", lambda m: m[2]),
                       ("max(host,gpu)", lambda m: max(m[1], m[2]))):  # fmt: skip
        sim_n = simulate(
            spec, q, k, v, g, variant,
            timer=lambda item, which, pick=pick: (pick(seen[(which, item.key)]), 0), **args,
        )  # fmt: skip
        pred = spec.price(sim_n, fab, True)
        one = pick(single_b)
        eff = one / (a.world_size * pred.fwd_bwd_ms)
        comp = pred.rank_compute_ms
        print(
            f"priced by {name:14s}: {pred.fwd_bwd_ms:7.3f} ms fwd+bwd, efficiency {eff:.3f} "
            f"(one device {one:.3f}), rank compute {min(comp):.3f}-{max(comp):.3f}, "
            f"{pred.bottleneck}"
        )
    print(f"items {sim.items}, distinct {sim.timed}")


if __name__ == "__main__":
    main()
