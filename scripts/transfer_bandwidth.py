"""Copy-engine transports against NCCL moving the same bytes, 1 MiB to 1 GiB per rank.

    all-gather  CopyEngineAllGather(start + wait)  vs  dist.all_gather_into_tensor
    channel     CopyEngineChannel (push to the next rank, receive from the previous, release)
                vs  dist.batch_isend_irecv of the same send/recv pair
    alltoall    CopyEngineAllToAll.exchange of a (P, n) tensor (row p to rank p)
                vs  dist.all_to_all_single of the same tensor
    ulysses     the Ulysses exchange of q (1, 32, S/P, 128) in zigzag layout to (1, 32/P, S, 128)
                in global order: CopyEngineAllToAll vs P2PAllToAll over NCCL (pack,
                all_to_all_single, unpack: what NCCL needs to land in the same layout)

One process per GPU (attngym.distributed.launch; NCCL for the collectives). Each op is timed as
`iters` back-to-back calls between two CUDA events on the caller's stream, after a barrier; the
median of `repeats` such windows, the slowest rank's, is the op time. Bandwidth is NCCL-tests' bus
bandwidth: the bytes one rank receives per op ((P - 1) x shard for the all-gather, one shard for
the channel) per second. At 64 MiB each transport also runs under torch.profiler, and the CUDA
activity it records is split into SM kernels and copies (the copy-engine rows should list no
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

from attngym.distributed.launch import launch
from attngym.profiling import cuda_kernel_profiler

MIB = 2**20
PROFILE_BYTES = 64 * MIB


def _ce_allgather(x: torch.Tensor) -> Callable[[], None]:
    from attngym.distributed import CopyEngineAllGather

    gather = CopyEngineAllGather(tuple(x.shape), 1, 0, dtype=x.dtype, device=x.device)

    def op() -> None:
        gather.start([x])
        gather.wait([x])

    return op


def _nccl_allgather(x: torch.Tensor) -> Callable[[], None]:
    out = torch.empty(dist.get_world_size() * x.numel(), dtype=x.dtype, device=x.device)
    return lambda: dist.all_gather_into_tensor(out, x)


def _ce_channel(x: torch.Tensor) -> Callable[[], None]:
    """One step of a sequence that never ends: push step i, receive step i + 1, release it."""
    from attngym.distributed import CopyEngineChannel

    chan = CopyEngineChannel(tuple(x.shape), 1, dtype=x.dtype, device=x.device)
    step = [0]

    def op() -> None:
        i = step[0]
        chan.send([x], i)
        chan.recv(i + 1)
        chan.release(i + 1)
        chan.join()
        step[0] = i + 1

    return op


def _nccl_channel(x: torch.Tensor) -> Callable[[], None]:
    rank, world = dist.get_rank(), dist.get_world_size()
    y = torch.empty_like(x)

    def op() -> None:
        ops = [
            dist.P2POp(dist.isend, x, (rank + 1) % world),
            dist.P2POp(dist.irecv, y, (rank - 1) % world),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    return op


def _ce_alltoall(x: torch.Tensor) -> Callable[[], None]:
    from attngym.distributed import CopyEngineAllToAll

    flat = x.view(dist.get_world_size(), -1)
    a2a = CopyEngineAllToAll(tuple(flat.shape), 1, 0, 1, dtype=x.dtype, device=x.device)
    return lambda: a2a.exchange([flat])


def _nccl_alltoall(x: torch.Tensor) -> Callable[[], None]:
    out = torch.empty_like(x)
    return lambda: dist.all_to_all_single(out, x)


HEADS, HEAD_DIM = 32, 128


def _ulysses(cls: type, x: torch.Tensor) -> Callable[[], None]:
    """The q exchange of ulysses_attention (heads split, zigzag shards into global order)."""
    from attngym.distributed.ulysses import exchange_order

    world = dist.get_world_size()
    shard = x.view(1, HEADS, -1, HEAD_DIM)
    order = exchange_order("zigzag", world, shard.shape[2] * world)
    a2a = cls(tuple(shard.shape), 1, 1, 2, dtype=x.dtype, device=x.device, concat_order=order)
    return lambda: a2a.exchange([shard])


def _ce_ulysses(x: torch.Tensor) -> Callable[[], None]:
    from attngym.distributed import CopyEngineAllToAll

    return _ulysses(CopyEngineAllToAll, x)


def _nccl_ulysses(x: torch.Tensor) -> Callable[[], None]:
    from attngym.distributed import P2PAllToAll

    return _ulysses(P2PAllToAll, x)


OPS = {
    ("allgather", "copy_engine"): _ce_allgather,
    ("allgather", "nccl"): _nccl_allgather,
    ("channel", "copy_engine"): _ce_channel,
    ("channel", "nccl"): _nccl_channel,
    ("alltoall", "copy_engine"): _ce_alltoall,
    ("alltoall", "nccl"): _nccl_alltoall,
    ("ulysses", "copy_engine"): _ce_ulysses,
    ("ulysses", "nccl"): _nccl_ulysses,
}


def _received(pattern: str, nbytes: int, world: int) -> float:
    """Bytes one rank receives from its peers in one op of `pattern`."""
    if pattern == "allgather":
        return (world - 1) * nbytes
    if pattern == "channel":
        return nbytes
    return nbytes * (world - 1) / world  # all-to-alls keep their own 1/P


def _time_ms(op: Callable[[], None], iters: int, repeats: int) -> float:
    """Median ms per op over `repeats` windows of `iters` calls, the slowest rank's."""
    for _ in range(3):
        op()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            op()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / iters)
    worst = torch.tensor([statistics.median(times)], device="cuda")
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


def _worker(rank: int, world: int, sizes_mib: list[int], iters: int, repeats: int) -> dict:
    logging.getLogger().setLevel(logging.WARNING)
    rows, profiles = [], {}
    for mib in sizes_mib:
        x = torch.randn(mib * MIB // 2, dtype=torch.bfloat16, device="cuda")
        for (pattern, transport), make in OPS.items():
            op = make(x)
            n = max(2, min(iters, (256 * MIB) // (mib * MIB)))  # ~256 MiB moved per window
            ms = _time_ms(op, n, repeats)
            received = _received(pattern, x.nbytes, world)
            rows.append(
                {
                    "pattern": pattern,
                    "transport": transport,
                    "bytes_per_rank": x.nbytes,
                    "ms": ms,
                    "busbw_GBps": received / ms / 1e6,
                }
            )
            if mib * MIB == PROFILE_BYTES:
                profiles[f"{pattern}/{transport}"] = _profile(op)
            del op
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
    parser.add_argument("--iters", type=int, default=20, help="calls per timed window (at most)")
    parser.add_argument("--repeats", type=int, default=5, help="timed windows per op")
    parser.add_argument("--world-size", type=int, default=0, help="0: every GPU")
    parser.add_argument("--out", default="transfer_bandwidth.json")
    args = parser.parse_args(argv)
    world = args.world_size or torch.cuda.device_count()
    if world < 2:
        raise SystemExit(f"needs at least 2 GPUs, found {torch.cuda.device_count()}")
    result = launch(
        _worker,
        world,
        args=(args.sizes_mib, args.iters, args.repeats),
        device="cuda",
        timeout_s=300,
    )
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{'pattern':10} {'MiB':>6} {'copy_engine GB/s':>17} {'nccl GB/s':>10} {'ratio':>6}")
    by_key = {(r["pattern"], r["bytes_per_rank"], r["transport"]): r for r in result["rows"]}
    for pattern in dict.fromkeys(p for p, _ in OPS):
        for mib in args.sizes_mib:
            ce = by_key[(pattern, mib * MIB, "copy_engine")]["busbw_GBps"]
            nc = by_key[(pattern, mib * MIB, "nccl")]["busbw_GBps"]
            print(f"{pattern:10} {mib:6d} {ce:17.1f} {nc:10.1f} {ce / nc:6.2f}")
    for name, prof in result["profile_64MiB"].items():
        print(f"{name}: kernels {prof['kernels'] or 'none'}; copies {prof['copies']}")


if __name__ == "__main__":
    main()
