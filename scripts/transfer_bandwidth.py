"""Copy-engine transports against NCCL moving the same bytes, 1 MiB to 1 GiB of K + V per rank.

Each op is one topology's step transfer alone, timed by its spec (TopologySpec.transfer_ms, the
timing behind the CP task's step_transfer_ms), so the script follows the algorithms' own step
protocols instead of restating them:

    ring       one ring step's K/V push to the next rank (ring.ring_transfer_ms)
    allgather  one all-gather of every rank's K/V (allgather.allgather_transfer_ms)
    ulysses    the all-to-all of K and V from sequence shards to head slices
               (ulysses.alltoall_transfer_ms)

each over the copy_engine transport (symmetric memory) and the nccl one (P2P over NCCL). K and V
are (1, 32, n, 128) bfloat16 shards, n sized to the step. Each step is timed on the host with the
device synchronised around it (iters x repeats rounds after two untimed ones); the median step,
the slowest rank's, is the op time. Bandwidth is NCCL-tests' bus bandwidth: the bytes one rank
receives per op (one K/V shard for the ring, (P - 1) of them for the all-gather, (P - 1)/P of
them for the all-to-all) per second. At 64 MiB each op also runs under torch.profiler, and the
CUDA activity it records is split into SM kernels and copies (the copy-engine rows should list no
kernel at all).

Usage (on a machine with two or more GPUs of one NVLink domain):
    python scripts/transfer_bandwidth.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
from collections.abc import Callable

import torch
import torch.distributed as dist

from attngym import registry
from attngym.distributed.ranks.launch import launch
from attngym.profiling import cuda_kernel_profiler

MIB = 2**20
PROFILE_BYTES = 64 * MIB
HEADS, HEAD_DIM = 32, 128  # K/V heads: a multiple of the ranks, so Ulysses repeats none
TRANSPORTS = ("copy_engine", "nccl")
TIMEOUT_S = 60.0


def _timed_topologies() -> list[str]:
    """The topologies with one step to time alone (hybrid has two levels)."""
    return [n for n in registry.names("topology") if registry.get("topology", n).timer]


def _received(topology: str, nbytes: int, world: int) -> float:
    """Bytes one rank receives from its peers in one step of `topology` (nbytes: its K + V)."""
    if topology == "allgather":
        return (world - 1) * nbytes
    if topology == "ulysses":
        return nbytes * (world - 1) / world  # the all-to-all keeps its own 1/P
    return nbytes


def _step_ms(op: Callable[[int], list[float]], rounds: int) -> float:
    """The median step over `rounds` rounds after two untimed ones, the slowest rank's."""
    op(2)
    dist.barrier()
    worst = torch.tensor([statistics.median(op(rounds))], device="cuda")
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.item()


def _profile(op: Callable[[], None]) -> dict[str, list[str]]:
    torch.cuda.synchronize()
    dist.barrier()
    with cuda_kernel_profiler() as result:
        for _ in range(4):
            op()
        torch.cuda.synchronize()
    names = result["kernel_names"]
    copies = [n for n in names if n.lower().startswith(("memcpy", "memset"))]
    return {"kernels": [n for n in names if n not in copies], "copies": copies}


def _worker(rank: int, world: int, sizes_mib: list[int], rounds: int) -> dict:
    logging.getLogger().setLevel(logging.WARNING)
    rows, profiles = [], {}
    for mib in sizes_mib:
        n = max(1, mib * MIB // (2 * HEADS * HEAD_DIM * 2))  # K and V, 2 bytes each
        k_s = torch.randn(1, HEADS, n, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        nbytes = 2 * k_s.nbytes
        for topology in _timed_topologies():
            spec = registry.get("topology", topology)
            for name in TRANSPORTS:
                transport = registry.build("transport", name)

                def op(repeats: int, spec=spec, transport=transport, k_s=k_s) -> list[float]:
                    return spec.transfer_ms(transport, k_s, TIMEOUT_S, repeats)

                ms = _step_ms(op, rounds)
                rows.append(
                    {
                        "pattern": topology,
                        "transport": name,
                        "bytes_per_rank": nbytes,
                        "ms": ms,
                        "busbw_GBps": _received(topology, nbytes, world) / ms / 1e6,
                    }
                )
                if mib * MIB == PROFILE_BYTES:
                    profiles[f"{topology}/{name}"] = _profile(lambda op=op: op(1))
        del k_s
        torch.cuda.empty_cache()
    return {
        "world_size": world,
        "gpu": torch.cuda.get_device_name(),
        "rows": rows,
        "profile_64MiB": profiles,
        "torch": torch.__version__,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[2**i for i in range(11)])
    parser.add_argument("--iters", type=int, default=20, help="timed rounds per repeat")
    parser.add_argument("--repeats", type=int, default=5, help="repeats of --iters rounds per op")
    parser.add_argument("--world-size", type=int, default=0, help="0: every GPU")
    parser.add_argument("--out", default="transfer_bandwidth.json")
    args = parser.parse_args(argv)
    world = args.world_size or torch.cuda.device_count()
    if world < 2:
        raise SystemExit(f"needs at least 2 GPUs, found {torch.cuda.device_count()}")
    result = launch(
        _worker,
        world,
        args=(args.sizes_mib, args.iters * args.repeats),
        device="cuda",
        timeout_s=300,
    )
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{'pattern':10} {'MiB':>6} {'copy_engine GB/s':>17} {'nccl GB/s':>10} {'ratio':>6}")
    by_key = {(r["pattern"], r["bytes_per_rank"], r["transport"]): r for r in result["rows"]}
    for pattern, nbytes in dict.fromkeys(
        (r["pattern"], r["bytes_per_rank"]) for r in result["rows"]
    ):
        ce = by_key[(pattern, nbytes, "copy_engine")]["busbw_GBps"]
        nc = by_key[(pattern, nbytes, "nccl")]["busbw_GBps"]
        print(f"{pattern:10} {nbytes / MIB:6.0f} {ce:17.1f} {nc:10.1f} {ce / nc:6.2f}")
    for name, prof in result["profile_64MiB"].items():
        print(f"{name}: kernels {prof['kernels'] or 'none'}; copies {prof['copies']}")


if __name__ == "__main__":
    main()
