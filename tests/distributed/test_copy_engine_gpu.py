"""Copy-engine transports on real GPUs: values, layout, gradients, graphs, profiler, timeouts.

Each test spawns two ranks. With two or more GPUs, rank r uses cuda:r over NCCL. With one GPU the
two ranks share it over gloo; PyTorch's symmetric memory allows that only when
TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 is set, and the tests skip otherwise. NVLink multicast
stays off in every rank (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1): nothing here needs it.

Payloads are float32 random tensors regenerated from (seed, rank, step) on the checking rank, so
every received value is compared exactly (copies move bits; the only arithmetic is the sum of two
gradients, exact in either order).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(90)]

WORLD = 2
NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def _payload(shape, seed: int, rank: int, step: int, device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step * 101 + rank)
    return torch.randn(shape, generator=gen).to(device)


def _worker(rank: int, init_file: str, scenario: str, arg) -> None:
    two_gpus = torch.cuda.device_count() >= WORLD
    device = torch.device("cuda", rank if two_gpus else 0)
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if two_gpus else "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=WORLD,
    )
    try:
        globals()[f"_scenario_{scenario}"](rank, device, arg)
    finally:
        dist.barrier()
        dist.destroy_process_group()
    # Every check passed: end as attngym's own ranks do (launch._exit_finished), without the
    # interpreter's teardown, where a library's native thread still joinable aborts the process
    # ("terminate called without an active exception", SIGABRT) on one GPU shared by two ranks.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _spawn(monkeypatch, scenario: str, arg=None) -> None:
    if (
        torch.cuda.device_count() < WORLD
        and os.environ.get("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES") != "1"
    ):
        pytest.skip("one GPU: set TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 to share it")
    for key, value in NO_MULTICAST.items():
        monkeypatch.setenv(key, value)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(os.path.join(tmp, "init"), scenario, arg), nprocs=WORLD)


# ----------------------------------------------------------------------------- channel


def _scenario_channel_stream(rank, device, steps):
    """Fresh data every step for `steps` steps, three sequences: slots alternate, values exact."""
    from attngym.distributed.transport.copy_engine import CopyEngineChannel

    shape = (3, 64, 40)
    ch = CopyEngineChannel(shape, 2, dtype=torch.float32, device=device, timeout_s=60)
    src = ch.src
    slots = set()
    for seq in range(3):
        for i in range(steps):
            ch.send(_payload((2, *shape), seq, rank, i, device), i)
            if i >= 1:
                got = ch.recv(i)
                slots.add(got.data_ptr())
                if i % 7 == 0:  # shift the timing: a busy compute stream before the read
                    a = torch.randn(1024, 1024, device=device)
                    (a @ a).sum().item()
                assert torch.equal(got, _payload((2, *shape), seq, src, i - 1, device)), (seq, i)
                ch.release(i)
        got = ch.recv(steps)
        slots.add(got.data_ptr())
        assert torch.equal(got, _payload((2, *shape), seq, src, steps - 1, device))
        ch.release(steps)
    ch.join()
    assert len(slots) == 2  # two receive slots, used alternately
    ch.synchronize()


def _scenario_channel_relay(rank, device, steps):
    """Each received slot is pushed onward before release: data hops around the ring."""
    from attngym.distributed.transport.copy_engine import CopyEngineChannel

    shape = (2, 8, 128, 16)
    ch = CopyEngineChannel(shape, 2, dtype=torch.float32, device=device, timeout_s=60)
    own = [_payload((2, *shape), 5, r, 0, device) for r in range(WORLD)]
    ch.send(own[rank], 0)
    for i in range(1, steps + 1):
        got = ch.recv(i)
        expected = own[(rank - i) % WORLD]
        assert torch.equal(got, expected), i
        if i < steps:
            ch.send(got, i)  # onward push straight from the received slot
        ch.release(i)
    ch.join()
    ch.synchronize()


@pytest.mark.parametrize("steps", [2, 64])
def test_channel_streams_fresh_data_exactly(monkeypatch, steps):
    _spawn(monkeypatch, "channel_stream", steps)


def test_channel_relays_from_received_slots(monkeypatch):
    _spawn(monkeypatch, "channel_relay", 40)


# ----------------------------------------------------------------------------- all-gather


def _scenario_allgather(rank, device, dim):
    """Many gathers with fresh data: rank r's shard at r * part_shape[dim] along dim, exactly."""
    from attngym.distributed.transport.copy_engine import CopyEngineAllGather

    part_shape = (2, 3, 16, 8)
    gather = CopyEngineAllGather(part_shape, 2, dim, dtype=torch.float32, device=device)
    for it in range(30):
        parts = [_payload(part_shape, it, rank, k, device) for k in range(2)]
        gather.start(parts)
        out = gather.wait(parts)
        d = dim % len(part_shape)
        for k in range(2):
            shards = [_payload(part_shape, it, r, k, device) for r in range(WORLD)]
            assert torch.equal(out[k], torch.cat(shards, dim=d)), (it, k)
            n = part_shape[d]
            assert torch.equal(out[k].narrow(d, rank * n, n), parts[k])
    gather.synchronize()


@pytest.mark.parametrize("dim", [0, 2, -1])
def test_allgather_writes_the_consumer_layout(monkeypatch, dim):
    _spawn(monkeypatch, "allgather", dim)


def _scenario_allgather_grad(rank, device, _):
    from attngym.distributed.transport.copy_engine import CopyEngineAllGather

    part_shape = (2, 4, 32, 8)
    gather = CopyEngineAllGather(part_shape, 2, 2, dtype=torch.float32, device=device)
    # reduce_scatter: rank-dependent gradients, summed over ranks, this rank's slice returned.
    grads = [_payload(gather.out_shape, 9, r, 0, device) for r in range(WORLD)]
    got = gather.reduce_scatter(grads[rank])
    n = part_shape[2]
    expected = sum(g.narrow(3, rank * n, n) for g in grads)
    assert got.shape == (2, *part_shape)
    assert torch.equal(got, expected)
    # differentiable wait: loss = sum(w_r * out) on rank r, so d loss / d shard = sum_r w_r[slice].
    for it in range(5):
        k = _payload(part_shape, it, rank, 0, device).requires_grad_()
        v = _payload(part_shape, it, rank, 1, device).requires_grad_()
        gather.start([k, v])
        out = gather.wait([k, v])
        assert out.requires_grad
        weights = [_payload(gather.out_shape, 100 + it, r, 2, device) for r in range(WORLD)]
        (out * weights[rank]).sum().backward()
        expected = sum(w.narrow(3, rank * n, n) for w in weights)
        assert torch.equal(k.grad, expected[0]) and torch.equal(v.grad, expected[1])
    gather.synchronize()


def test_allgather_wait_is_differentiable(monkeypatch):
    _spawn(monkeypatch, "allgather_grad")


# ----------------------------------------------------------------------------- CUDA graphs


def _scenario_graphs(rank, device, eager_first):
    """Captured send/recv and start/wait replay with right values, eager run first or not."""
    from attngym.distributed.transport.copy_engine import CopyEngineAllGather, CopyEngineChannel

    shape = (4, 64, 32)
    ch = CopyEngineChannel(shape, 2, dtype=torch.float32, device=device)
    gather = CopyEngineAllGather(shape, 2, 1, dtype=torch.float32, device=device)
    x = torch.empty(2, *shape, device=device)
    received = torch.empty_like(x)
    gathered = torch.empty(gather.out_shape, device=device)

    def step():
        ch.send(x, 0)
        received.copy_(ch.recv(1))
        ch.release(1)
        ch.join()
        gather.start(x)
        gathered.copy_(gather.wait(x))

    if eager_first:
        x.copy_(_payload(x.shape, 77, rank, 0, device))
        step()
        torch.cuda.synchronize()
        assert torch.equal(received, _payload(x.shape, 77, ch.src, 0, device))
    graph = torch.cuda.CUDAGraph()
    dist.barrier()
    with torch.cuda.graph(graph):
        step()
    for rep in range(6):
        x.copy_(_payload(x.shape, rep, rank, 0, device))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(received, _payload(x.shape, rep, ch.src, 0, device)), rep
        shards = [_payload(x.shape, rep, r, 0, device) for r in range(WORLD)]
        assert torch.equal(gathered, torch.cat(shards, dim=2)), rep
        dist.barrier()  # x is refilled only once the peer's replay has read it
    ch.synchronize()


@pytest.mark.parametrize("eager_first", [False, True])
def test_graph_capture_and_replay(monkeypatch, eager_first):
    _spawn(monkeypatch, "graphs", eager_first)


# ----------------------------------------------------------------------------- profiler


def _scenario_profiler(rank, device, _):
    """Payload and signals show up as memcpys only: no SM kernel during start/send/recv."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from attngym.distributed.transport.copy_engine import CopyEngineAllGather, CopyEngineChannel

    shape = (4, 256, 64)
    ch = CopyEngineChannel(shape, 2, dtype=torch.bfloat16, device=device)
    gather = CopyEngineAllGather(shape, 2, 1, dtype=torch.bfloat16, device=device)
    x = _payload((2, *shape), 1, rank, 0, device).bfloat16()
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(4):
            ch.send(x, i)
            if i:
                ch.recv(i)
                ch.release(i)
        ch.recv(4)
        ch.release(4)
        ch.join()
        gather.start(x)
        gather.wait(x)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]
    kernels = [n for n in names if not n.lower().startswith(("memcpy", "memset"))]
    copies = [n for n in names if n.lower().startswith("memcpy")]
    assert kernels == [], kernels
    assert len(copies) >= 4 * 2 + WORLD * 2 * 4, copies
    print(f"rank {rank}: {len(copies)} copies, e.g. {copies[0]!r}; no kernels")


def test_profiler_shows_no_sm_kernels(monkeypatch):
    _spawn(monkeypatch, "profiler")


# ----------------------------------------------------------------------------- all-to-all


def _ulysses_a2a(layout, shape, device, num_parts=2):
    """The Ulysses exchange of (B, H, S, D) `shape` in `layout`: heads split, sequence in order."""
    from attngym.distributed.placement import layout as layouts
    from attngym.distributed.transport.copy_engine import CopyEngineAllToAll

    b, h, s, d = shape
    order = [
        [
            off // (s // layouts.pieces(layout, WORLD))
            for off, _ in layouts.chunks(r, WORLD, s, layout)
        ]
        for r in range(WORLD)
    ]
    return CopyEngineAllToAll(
        (b, h, s // WORLD, d),
        num_parts,
        1,
        2,
        dtype=torch.float32,
        device=device,
        concat_order=order,
    )


def _scenario_alltoall(rank, device, layout):
    """Fresh data every exchange: head slice `rank` of the whole sequence in order, and back."""
    from attngym.distributed.placement.layout import shard

    shape = (2, 4, 64, 16)
    a2a = _ulysses_a2a(layout, shape, device)
    heads = slice(rank * 2, rank * 2 + 2)
    previous = None
    for it in range(20):
        whole = [_payload(shape, it, 0, k, device) for k in range(2)]  # the same on every rank
        mine = [shard(x, rank, WORLD, layout) for x in whole]
        out = a2a(mine)
        assert out.shape == a2a.out_shape
        for k in range(2):
            assert torch.equal(out[k], whole[k][:, heads]), (it, k)
        back = a2a.inverse()(out)
        assert torch.equal(back, torch.stack(mine)), it
        if previous is not None:  # an output is the caller's: later exchanges leave it alone
            assert torch.equal(previous[0], previous[1]), it
        previous = (out, torch.stack([x[:, heads] for x in whole]))
    a2a.synchronize()
    a2a.inverse().synchronize()


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_alltoall_places_heads_and_sequence(monkeypatch, layout):
    _spawn(monkeypatch, "alltoall", layout)


def _scenario_alltoall_grad(rank, device, layout):
    """d loss / d shard is the inverse exchange of the upstream gradient, exactly."""
    from attngym.distributed.placement.layout import shard

    shape = (1, 4, 32, 8)
    a2a = _ulysses_a2a(layout, shape, device)
    heads = [slice(p * 2, p * 2 + 2) for p in range(WORLD)]
    for it in range(4):
        x = [shard(_payload(shape, it, 0, k, device), rank, WORLD, layout) for k in range(2)]
        x = [t.requires_grad_() for t in x]
        out = a2a(x)
        assert out.requires_grad
        weights = [_payload(a2a.out_shape, 100 + it, p, 0, device) for p in range(WORLD)]
        (out * weights[rank]).sum().backward()
        for k in range(2):
            whole = torch.empty(shape, device=device)
            for p in range(WORLD):
                whole[:, heads[p]] = weights[p][k]
            assert torch.equal(x[k].grad, shard(whole, rank, WORLD, layout)), (it, k)
    a2a.synchronize()


def test_alltoall_is_differentiable(monkeypatch):
    _spawn(monkeypatch, "alltoall_grad", "zigzag")


def _scenario_alltoall_graph(rank, device, eager_first):
    from attngym.distributed.placement.layout import shard

    shape = (1, 4, 64, 32)
    a2a = _ulysses_a2a("zigzag", shape, device)
    x = torch.empty(2, *a2a.part_shape, device=device)
    out = torch.empty(a2a.out_shape, device=device)

    def step():
        out.copy_(a2a.exchange(x))

    def fill(rep):
        whole = [_payload(shape, rep, 0, k, device) for k in range(2)]
        x.copy_(torch.stack([shard(t, rank, WORLD, "zigzag") for t in whole]))
        return whole

    if eager_first:
        whole = fill(1000)
        step()
        torch.cuda.synchronize()
        assert torch.equal(out[0], whole[0][:, rank * 2 : rank * 2 + 2])
    graph = torch.cuda.CUDAGraph()
    dist.barrier()
    with torch.cuda.graph(graph):
        step()
    for rep in range(6):
        whole = fill(rep)
        graph.replay()
        torch.cuda.synchronize()
        for k in range(2):
            assert torch.equal(out[k], whole[k][:, rank * 2 : rank * 2 + 2]), rep
        dist.barrier()  # x is refilled only once the peer's replay has read it
    a2a.synchronize()


@pytest.mark.parametrize("eager_first", [False, True])
def test_alltoall_graph_capture_and_replay(monkeypatch, eager_first):
    _spawn(monkeypatch, "alltoall_graph", eager_first)


def _scenario_alltoall_profiler(rank, device, _):
    """The exchange and its inverse run as memcpys and stream memory operations: no SM kernel."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    a2a = _ulysses_a2a("zigzag", (1, 8, 256, 64), device, num_parts=3)
    x = _payload((3, *a2a.part_shape), 1, rank, 0, device)
    back = a2a.inverse()
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            back.exchange(a2a.exchange(x))
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]
    kernels = [n for n in names if not n.lower().startswith(("memcpy", "memset"))]
    assert kernels == [], kernels
    assert any(n.lower().startswith("memcpy") for n in names), names
    print(f"rank {rank}: {len(names)} copies; no kernels")


def test_alltoall_profiler_shows_no_sm_kernels(monkeypatch):
    _spawn(monkeypatch, "alltoall_profiler")


def _scenario_alltoall_dead_peer(rank, device, _):
    """Rank 1 builds the all-to-all, then stops calling; rank 0's exchange fails, never hangs."""
    import faulthandler

    from attngym.distributed.transport.copy_engine import CopyEngineAllToAll

    faulthandler.dump_traceback_later(60, exit=True)
    a2a = CopyEngineAllToAll((4, 256), 1, 0, 1, dtype=torch.float32, device=device, timeout_s=3.0)
    if rank == 1:
        return
    began = time.monotonic()
    a2a.exchange(torch.randn(1, 4, 256, device=device))
    with pytest.raises(RuntimeError, match="waited more than 3 s"):
        a2a.synchronize(timeout_s=60)
    torch.cuda.synchronize()
    assert time.monotonic() - began < 30
    with pytest.raises(RuntimeError, match="unusable"):
        a2a.exchange(torch.randn(1, 4, 256, device=device))


def test_alltoall_dead_peer_times_out(monkeypatch):
    _spawn(monkeypatch, "alltoall_dead_peer")


# ----------------------------------------------------------------------------- failures, domain


def _scenario_dead_peer(rank, device, _):
    """Rank 1 sets up, then stops calling; rank 0's recv times out with an error, never hangs."""
    import faulthandler

    from attngym.distributed.transport.copy_engine import CopyEngineChannel

    faulthandler.dump_traceback_later(60, exit=True)  # a hang prints stacks and fails the test
    ch = CopyEngineChannel((1024,), 1, dtype=torch.float32, device=device, timeout_s=3.0)
    if rank == 1:
        return
    began = time.monotonic()
    ch.recv(1)
    with pytest.raises(RuntimeError, match="waited more than 3 s"):
        ch.synchronize(timeout_s=60)
    torch.cuda.synchronize()  # the watchdog released the stream: this returns
    assert time.monotonic() - began < 30
    with pytest.raises(RuntimeError, match="unusable"):
        ch.release(1)


def test_dead_peer_times_out(monkeypatch):
    _spawn(monkeypatch, "dead_peer")


def _scenario_domain(rank, device, _):
    from attngym.distributed.transport.domain import in_one_nvlink_domain, nvlink_domain

    print(f"rank {rank}: nvlink_domain() = {nvlink_domain()!r}")
    assert in_one_nvlink_domain() is True


def test_ranks_of_one_host_share_an_nvlink_domain(monkeypatch):
    _spawn(monkeypatch, "domain")


# ----------------------------------------------------------------------------- uneven exchange


def _scenario_exchange(rank, device, _):
    """Uneven blocks (rank 1 sends nothing), exact, three rounds through one staging buffer;
    the inverse sends each block back."""
    from attngym.distributed.transport.copy_engine import CopyEngineExchange

    sizes = ((0, 4096 * 3 + 5), (0, 0))
    ex = CopyEngineExchange(sizes, dtype=torch.float32, device=device, timeout_s=60)
    for rnd in range(3):
        send = _payload((sum(sizes[rank]),), rnd, rank, 0, device)
        out = ex.exchange(send)
        want = [_payload((sizes[src][rank],), rnd, src, 0, device) for src in range(WORLD)]
        assert torch.equal(out, torch.cat(want)), rnd
        assert torch.equal(ex.inverse().exchange(out), send), rnd
    ex.synchronize()
    ex.inverse().synchronize()


def test_exchange_delivers_uneven_blocks_exactly(monkeypatch):
    _spawn(monkeypatch, "exchange")
