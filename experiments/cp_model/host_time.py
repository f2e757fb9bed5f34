"""Where a simulated rank's time goes: the GPU's time to run each item of work against the
host's time to issue it (the simulation's stream timing, bench.stream_time), beside time_fn's
timing of the item alone.

A call whose host issues its kernels more slowly than the GPU runs them is bound by the host: in
a stream of such calls the GPU waits. Per distinct item this prints time_fn's median (the call
timed alone: for a call whose host time nears its GPU time, neither), the GPU's time per call
queued back to back and the host's issue time; then the scheme priced from the stream timing
(each rank the longer of its GPU timeline and its host) and from time_fn, beside the one-device
call. `--profile` adds the host's cProfile per item.

    python experiments/cp_model/host_time.py --kind allgather --layout contiguous \
        --world-size 8 --variant sliding_window --seq-len 131072 [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats

import torch

from attngym import bench
from attngym.distributed.call.cp import CPOptions, attend_chunk
from attngym.distributed.model.simulate import ItemTime, bench_timer, simulate
from attngym.distributed.model.transfer_model import fabric
from attngym.distributed.placement.grid import plans_for
from attngym.distributed.schemes.topologies import TOPOLOGIES
from attngym.variants.causal import causal
from attngym.variants.document import document
from attngym.variants.sliding_window import sliding_window


def documents(seq_len: int) -> list[int]:
    """The default config's documents: 40, 10, 30 and 20 % of the sequence, the last taking
    what rounding leaves."""
    lengths = [int(seq_len * f) for f in (0.4, 0.1, 0.3)]
    return [*lengths, seq_len - sum(lengths)]


def parser(kind: str) -> argparse.ArgumentParser:
    """The arguments this script and step_times.py share: the scheme and the problem."""
    p = argparse.ArgumentParser()
    p.add_argument("--kind", default=kind)
    p.add_argument("--layout", default="contiguous")
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--variant", default="sliding_window")
    p.add_argument("--seq-len", type=int, default=131072)
    return p


def make_variant(name: str, seq_len: int):
    """The scaling rows' variant by name: a 1024-token window, causal, or the default documents."""
    return {
        "sliding_window": lambda: sliding_window(1024),
        "causal": causal,
        "document": lambda: document(documents(seq_len)),
    }[name]()


def problem(a: argparse.Namespace):
    """(variant, q, k, v, grad_out) of the parsed problem on the GPU: B=1, H=8, D=128, bf16."""
    S, dev = a.seq_len, torch.device("cuda")
    variant = make_variant(a.variant, S).to(dev)
    return variant, *(torch.randn(1, 8, S, 128, device=dev, dtype=torch.bfloat16) for _ in range(4))


def placed(a: argparse.Namespace, variant):
    """The parsed scheme's placement as a run plans it (balanced priced for its kernels)."""
    spec = TOPOLOGIES[a.kind]
    return spec.placement(a.layout, a.world_size, a.seq_len, variant, batch_heads=8,
                          device=torch.device("cuda"))  # fmt: skip


def time_fn_ms(fn, dev) -> float:
    """The item as time_fn times it alone (what the simulation priced before stream timing)."""
    return bench.time_fn(fn, warmup=1, repeats=5, device=dev).median_ms


def profile(fn, label: str, calls: int = 10) -> None:
    """cProfile of the host issuing `calls` calls, the device held busy by a spin."""
    torch.cuda.synchronize()
    torch.cuda._sleep(int(4e8))
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    for order in ("tottime", "cumulative"):
        pstats.Stats(prof, stream=out).sort_stats(order).print_stats(25)
    print(f"--- host profile of {label} ({calls} calls) ---\n{out.getvalue()}")


def main() -> None:
    p = parser("allgather")
    p.add_argument("--fabric", default="h200_nvlink")
    p.add_argument("--transport", default="nccl")
    p.add_argument("--profile", action="store_true", help="cProfile the host of each item")
    a = p.parse_args()
    S, dev = a.seq_len, torch.device("cuda")
    variant, q, k, v, g = problem(a)

    stream = bench_timer(dev, 1, 5)
    seen: dict[tuple, tuple[ItemTime, float]] = {}  # (which, key) -> (stream, time_fn)

    def recording(item, which):
        timed = stream(item, which)
        fn = item.fwd if which == "fwd" else item.bwd
        seen[(which, item.key)] = timed, time_fn_ms(fn, dev)
        print(
            f"item {which:3s} time_fn {seen[(which, item.key)][1]:7.3f} gpu {timed.ms:7.3f} "
            f"host {timed.host_ms:7.3f}  {str(item.key)[:70]}"
        )
        if a.profile:
            profile(fn, f"{which} {str(item.key)[:80]}")
        return timed

    spec = TOPOLOGIES[a.kind]
    args = dict(world_size=a.world_size, layout=placed(a, variant), options=CPOptions())
    sim = simulate(spec, q, k, v, g, variant, timer=recording, **args)
    fab = fabric(a.fabric, a.transport)
    grid = plans_for(variant, S, (128, 128), dev).whole  # the one-device call's block mask
    qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))

    def one_fwd():
        with torch.no_grad():
            attend_chunk(q, k, v, variant, block_mask=grid)

    def one_both():
        out, _ = attend_chunk(qs, ks, vs, variant, block_mask=grid)
        out.backward(g)

    single = {name: bench.stream_time(fn, device=dev) for name, fn in
              (("fwd", one_fwd), ("fwd+bwd", one_both))}  # fmt: skip
    for name, t in single.items():
        print(f"one device {name:8s} gpu {t.gpu_ms:.3f} host {t.host_ms:.3f}")
    one = single["fwd+bwd"].gpu_ms
    for name, pick in (("stream timing", lambda t: t[0]), ("time_fn", lambda t: ItemTime(t[1]))):

        def timer(item, which, pick=pick):
            return pick(seen[(which, item.key)])

        pred = spec.price(simulate(spec, q, k, v, g, variant, timer=timer, **args), fab, True)
        comp, host = pred.rank_compute_ms, pred.rank_host_ms
        print(
            f"priced by {name:13s}: {pred.fwd_bwd_ms:7.3f} ms fwd+bwd, efficiency "
            f"{one / (a.world_size * pred.fwd_bwd_ms):.3f}, rank compute {min(comp):.3f}-"
            f"{max(comp):.3f}, host {max(host):.3f}, {pred.bottleneck}"
        )
    print(f"items {sim.items}, distinct {sim.timed}")


if __name__ == "__main__":
    main()
