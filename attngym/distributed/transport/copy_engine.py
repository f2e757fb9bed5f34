"""Copy-engine transports on PyTorch symmetric memory, for groups inside one NVLink domain.

Payload moves by device-to-device copies (`Tensor.copy_` between contiguous views of peer buffers,
i.e. cudaMemcpyAsync, run by the GPU's copy engines), and ranks signal each other with stream memory
operations on the symmetric-memory signal pads (`cuStreamWriteValue32` to set a flag in a peer's
pad, `cuStreamWaitValue32` to wait on a flag in this rank's pad, both from `cuda.bindings.driver`).
Neither launches an SM kernel, so transfers overlap attention kernels; they still share HBM and
NVLink bandwidth with them.

Contract (every class):
    streams      The *current* stream (the caller's compute stream) carries the consumer-side
                 signals: "my buffer/slot is free" is queued behind everything already on it, and
                 "wait until the data has landed" is queued in front of what the caller does next.
                 One *side* stream per object carries the payload copies, the producer-side waits
                 ("may I write into the peer's buffer?") and the "data landed" flags. The side
                 stream first waits for the current stream, so the parts handed in are complete.
    flags        Every flag is set to 1 by exactly one writer and reset to 0 by the rank that waited
                 on it, right after the wait, on the same stream. Each call issues the same
                 signals, so a CUDA-graph-captured call replays correctly whether or not it also ran
                 eagerly, and the pads return to their initial state after a balanced sequence.
    in flight    CopyEngineAllGather: one gather (start ... wait). CopyEngineChannel: two slots;
                 the push for step i+1 may be in flight while step i is being computed.
                 CopyEngineAllToAll, CopyEngineExchange: one exchange, finished on the current
                 stream when it returns.
    ownership    A part handed to a push is read on the side stream, possibly after the caller
                 dropped it: eagerly the allocator is told (record_stream); inside a CUDA graph
                 capture, which cannot record stream uses, the object holds the part until the
                 current stream waits for the side stream again (wait, join).
                 The symmetric buffers belong to the object and live as long as it. A gathered
                 buffer returned by `wait` is valid until the next `start` overwrites it; the free
                 signal of that `start` is queued behind all work already on the current stream
                 (a backward that reads the gather included). A received slot is valid until
                 `release(i)`, which hands it back to the sender only after the work already
                 queued on the current stream and on the side stream (an onward push) is done.
                 The output of an all-to-all or an exchange is a fresh tensor the caller owns.
    timeouts     A stream wait cannot time out by itself. Every eager wait is followed by an event
                 that a per-process watchdog thread polls; if it has not completed `timeout_s`
                 after it was issued (a dead or stuck peer), the watchdog marks the object failed,
                 logs it, and writes the awaited flag itself so the stream (and anyone
                 synchronising on it) is released instead of hanging. The data behind that flag is
                 garbage; every later call on the object raises RuntimeError, and `synchronize()`
                 blocks the host with a bounded wait and raises RuntimeError on timeout. Waits
                 recorded inside a CUDA graph capture are not watched at replay; the watchdog
                 polls in relaxed capture mode, so it never invalidates a capture running in
                 another thread.

Layout of a signal pad (int32 words, this rank's pad, written by peers):
    CopyEngineAllGather  [0, P): FREE from peer p ("your shard may go into my buffer");
                         [P, 2P): DONE from peer p ("my shard is in your buffer").
    CopyEngineChannel    [0, 2): READY for slot s (from src); [2, 4): FREE for dst's slot s.
    CopyEngineAllToAll,  [0, P): READY from peer p ("your block is in my staging buffer");
    CopyEngineExchange   [P, 2P): FREE from peer p ("I have read my block out of yours").

Heavy imports (symmetric memory, cuda.bindings) happen inside the functions that use them, so this
module imports on a machine without CUDA.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from attngym.distributed.transport.parts import (
    AllToAllCalls,
    AllToAllPlan,
    ChannelSteps,
    ExchangeCalls,
    Parts,
    Region,
    as_parts,
    check_args,
    check_dim,
    check_part_shape,
    check_peer,
    check_sizes,
    narrow,
)

log = logging.getLogger(__name__)

_POLL_S = 0.002


# ----------------------------------------------------------------------------- argument checks


def _check_common(
    part_shape: Sequence[int], num_parts: int, dtype: Any, device: Any, timeout_s: float
) -> tuple[tuple[int, ...], torch.device]:
    """The shared transport checks (attngym.distributed.transport.parts), then a CUDA device and a
    group."""
    shape, dev = check_args(part_shape, num_parts, dtype, device, timeout_s)
    if dev.type != "cuda":
        raise ValueError(
            f"device: copy-engine transfers need a CUDA device, got {device!r} "
            "(use P2PChannel / P2PAllGather for other devices)"
        )
    if not dist.is_initialized():
        raise RuntimeError("copy-engine transports need an initialised torch.distributed group")
    return shape, dev


def _require_cuda(device: torch.device) -> torch.device:
    """`device` with its index filled in; RuntimeError when CUDA is missing."""
    if not torch.cuda.is_available():
        raise RuntimeError("copy-engine transports need CUDA, which is not available here")
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


# ----------------------------------------------------------------------------- device plumbing


class _StreamMemOps:
    """cuStreamWriteValue32 / cuStreamWaitValue32 on 32-bit words: no SM kernel, capturable."""

    def __init__(self) -> None:
        try:
            from cuda.bindings import driver
        except ImportError as exc:
            raise RuntimeError(
                "copy-engine transports need cuda-bindings (pip install cuda-bindings) for "
                "stream memory operations"
            ) from exc
        self._drv = driver
        self._eq = driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ
        self._fenced = driver.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT

    def _check(self, result: tuple, what: str) -> None:
        err = result[0]
        if err != self._drv.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"{what} failed: {err!r}")

    def write(self, stream: torch.cuda.Stream, addr: int, value: int) -> None:
        """Queue `*addr = value` on `stream`, after a fence that orders earlier writes (payload)."""
        self._check(
            self._drv.cuStreamWriteValue32(stream.cuda_stream, addr, value, self._fenced),
            "cuStreamWriteValue32",
        )

    def wait(self, stream: torch.cuda.Stream, addr: int, value: int) -> None:
        """Queue "block `stream` until `*addr == value`"."""
        self._check(
            self._drv.cuStreamWaitValue32(stream.cuda_stream, addr, value, self._eq),
            "cuStreamWaitValue32",
        )


@dataclass
class _Watch:
    owner: Any
    event: torch.cuda.Event
    deadline: float
    word: int
    what: str


class _Watchdog:
    """One daemon thread per process that bounds every eager stream wait (see the contract)."""

    def __init__(self) -> None:
        self._items: list[_Watch] = []
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def watch(self, item: _Watch) -> None:
        with self._cond:
            self._items.append(item)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="attngym-copy-engine-watchdog", daemon=True
                )
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        _poll_during_captures()
        while True:
            with self._cond:
                while not self._items:
                    self._cond.wait()
                items = list(self._items)
            now = time.monotonic()
            finished = []
            for item in items:
                if item.event.query():
                    finished.append(item)
                elif now > item.deadline:
                    item.owner._expire(item)
                    finished.append(item)
            if finished:
                gone = {id(it) for it in finished}
                with self._cond:
                    self._items = [it for it in self._items if id(it) not in gone]
            time.sleep(_POLL_S)


def _poll_during_captures() -> None:
    """Let the calling thread poll events while another thread captures a CUDA graph. Under the
    default (global) capture mode CUDA refuses cudaEventQuery from every thread during a capture
    and invalidates the capture ("operation not permitted when stream is capturing"), so the
    watchdog would break a user's torch.cuda.graph or make_graphed_callables at random. The
    events it polls were recorded by eager calls before any capture: relaxed mode is safe here.
    Without cuda-bindings no copy-engine wait exists (_StreamMemOps needs them): nothing to do.
    """
    try:
        from cuda.bindings import driver
    except ImportError:
        return

    relaxed = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
    err, _ = driver.cuThreadExchangeStreamCaptureMode(relaxed)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuThreadExchangeStreamCaptureMode failed: {err!r}")


_WATCHDOG = _Watchdog()


class _SymmetricBuffer:
    """A symmetric-memory tensor of `shape` on every rank of `group`, its peers and signal pads."""

    def __init__(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        group: dist.ProcessGroup,
        pad_words: int,
    ) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        group_name = group.group_name
        enabled = getattr(symm_mem, "is_symm_mem_enabled_for_group", None)
        if enabled is not None and not enabled(group_name):
            with warnings.catch_warnings():  # deprecated (a no-op need) in newer torch
                warnings.simplefilter("ignore", FutureWarning)
                symm_mem.enable_symm_mem_for_group(group_name)
        self.local = symm_mem.empty(shape, dtype=dtype, device=device)
        self.handle = symm_mem.rendezvous(self.local, group_name)
        self.rank = self.handle.rank
        self.world_size = self.handle.world_size
        pad_bytes = getattr(type(self.handle), "signal_pad_size", None)
        if isinstance(pad_bytes, int) and pad_words * 4 > pad_bytes:
            raise RuntimeError(
                f"the symmetric-memory signal pad holds {pad_bytes // 4} words, "
                f"{pad_words} are needed; raise it with symm_mem.set_signal_pad_size"
            )
        self.peers = [self.handle.get_buffer(p, shape, dtype) for p in range(self.world_size)]
        self.pad_ptrs = list(self.handle.signal_pad_ptrs)
        self.pad = self.handle.get_signal_pad(self.rank, (pad_words,), torch.int32)

    def word(self, rank: int, index: int) -> int:
        """Device address of int32 word `index` in `rank`'s signal pad."""
        return self.pad_ptrs[rank] + 4 * index


class _CopyEngineBase:
    """Shared plumbing: group, buffers, streams, flags, the failure state."""

    def __init__(
        self,
        buffer_shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        group: dist.ProcessGroup | None,
        timeout_s: float,
        pad_words: int,
        pad_init: Sequence[int],
    ) -> None:
        self.group = group if group is not None else dist.group.WORLD
        device = _require_cuda(device)
        self.device = device
        self.dtype = dtype
        self.timeout_s = float(timeout_s)
        self._error: str | None = None
        self._held: list[torch.Tensor] = []  # parts the side stream reads, in a capture
        self._ops = _StreamMemOps()
        with torch.cuda.device(device):
            self._mem = _SymmetricBuffer(buffer_shape, dtype, device, self.group, pad_words)
            self.rank = self._mem.rank
            self.world_size = self._mem.world_size
            self._side = torch.cuda.Stream(device)
            self._rescue = torch.cuda.Stream(device)  # the watchdog's, see _expire
            self._mem.pad.copy_(torch.tensor(list(pad_init), dtype=torch.int32, device=device))
            torch.cuda.synchronize(device)
        dist.barrier(group=self.group)  # every pad is initialised before anyone signals

    # -- failure handling ---------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"{type(self).__name__} is unusable: {self._error}")

    def _expire(self, item: _Watch) -> None:
        """Watchdog callback: release the blocked stream, then record the failure.

        The flag is written first (a stream memory operation on a stream made at construction, no
        kernel, no allocation), so a caller that sees the error and synchronises does not hang.
        """
        with torch.cuda.device(self.device):
            self._ops.write(self._rescue, self._mem.word(self.rank, item.word), 1)
        if self._error is None:
            self._error = (
                f"rank {self.rank} waited more than {self.timeout_s:g} s for {item.what} "
                "(a peer died or stopped calling); the data it guarded is invalid"
            )
            log.error("%s: %s", type(self).__name__, self._error)

    def _wait_flag(self, stream: torch.cuda.Stream, word: int, what: str) -> None:
        """Block `stream` until this rank's pad word is 1, then reset it to 0 (same stream)."""
        addr = self._mem.word(self.rank, word)
        self._ops.wait(stream, addr, 1)
        self._ops.write(stream, addr, 0)
        if not torch.cuda.is_current_stream_capturing():
            event = torch.cuda.Event()
            event.record(stream)
            deadline = time.monotonic() + self.timeout_s
            _WATCHDOG.watch(_Watch(self, event, deadline, word, what))

    def _keep_until_joined(self, items: Sequence[torch.Tensor]) -> None:
        """The side stream reads `items` after the caller may have dropped them. Outside a CUDA
        graph capture the allocator is told (record_stream) and keeps their memory until those
        reads are done. A capture cannot record stream uses, and its pool would hand a dropped
        part's memory to the next allocation on the capture stream, whose kernel then overwrites
        it before the copy engine reads it at replay (a ring's dK/dV push under load): the object
        holds them instead, until the current stream waits for the side stream again."""
        if torch.cuda.is_current_stream_capturing():
            self._held.extend(items)
        else:
            for part in items:
                part.record_stream(self._side)

    def _set_flag(self, stream: torch.cuda.Stream, rank: int, word: int) -> None:
        self._ops.write(stream, self._mem.word(rank, word), 1)

    def synchronize(self, timeout_s: float | None = None) -> None:
        """Block the host until all queued work of this object is done, at most `timeout_s`.

        Raises:
            RuntimeError: the work did not finish in time, or a watched wait timed out.
        """
        self._check_alive()
        limit = self.timeout_s if timeout_s is None else float(timeout_s)
        done = torch.cuda.Event()
        with torch.cuda.device(self.device):
            cur = torch.cuda.current_stream(self.device)
            cur.wait_stream(self._side)
            done.record(cur)
        deadline = time.monotonic() + limit
        while not done.query():
            if self._error is not None or time.monotonic() > deadline:
                self._error = self._error or f"synchronize() timed out after {limit:g} s"
                self._check_alive()
            time.sleep(_POLL_S)
        self._check_alive()


class CopyEngineAllGather(_CopyEngineBase):
    """All-gather into a persistent symmetric buffer, written directly in the consumer's layout.

    Each rank contributes num_parts tensors of part_shape (for example K and V). The output has
    shape (num_parts, *part_shape) with part_shape[dim] multiplied by the world size P; rank r's
    shard of every part lands at offset r * part_shape[dim] along dim, with no gathered-then-
    reordered intermediate. Every rank pushes its shard into every peer's buffer, one contiguous
    copy per row in front of dim: P * num_parts * prod(part_shape[:dim]) copies on the side stream.

    Example (K and V shards (B, H, S/P, D) gathered along the sequence):
        gather = CopyEngineAllGather((B, H, S // P, D), 2, 2, dtype=k.dtype, device=k.device)
        gather.start([k, v])      # pushes run beside whatever the current stream does next
        kv = gather.wait([k, v])  # (2, B, H, S, D); differentiable when k or v requires grad

    Args:
        part_shape: shape of one part of this rank's shard.
        num_parts: parts per rank (2 for K and V).
        dim: the dimension of part_shape that is gathered.
        dtype: dtype of the parts.
        device: a CUDA device.
        group: the process group (default: the default group), inside one NVLink domain.
        timeout_s: the longest any signal wait may take before the object fails.

    Raises:
        ValueError: a bad argument (named).
        RuntimeError: no initialised process group or no CUDA.

    OUTPUT_REUSED: True, wait() returns this object's buffer, which the next start() overwrites
    (a caller that keeps the result, for a backward say, copies it).
    """

    OUTPUT_REUSED = True

    def __init__(
        self,
        part_shape: Sequence[int],
        num_parts: int,
        dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        group: dist.ProcessGroup | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        dim = check_dim(dim, check_part_shape(part_shape))
        shape, dev = _check_common(part_shape, num_parts, dtype, device, timeout_s)
        self.part_shape = shape
        self.num_parts = num_parts
        self.dim = dim
        world = dist.get_world_size(group)
        out_part = list(shape)
        out_part[self.dim] *= world
        self.out_shape = (num_parts, *out_part)
        super().__init__(self.out_shape, dtype, dev, group, timeout_s, 2 * world, [0] * (2 * world))
        self._rows = math.prod(shape[: self.dim])
        self._chunk = math.prod(shape[self.dim :])  # elements of one row's shard
        self._pending = False
        # dst[p][k][j]: rank r's slot for row j of part k in peer p's buffer (contiguous 1-D).
        p_world, r = self.world_size, self.rank
        self._dst = [
            [
                [
                    row[r * self._chunk : (r + 1) * self._chunk]
                    for row in peer.view(num_parts, self._rows, p_world * self._chunk)[k]
                ]
                for k in range(num_parts)
            ]
            for peer in self._mem.peers
        ]

    def start(self, parts: Parts) -> None:
        """Issue the pushes of this rank's shard into every peer's buffer (and its own).

        Args:
            parts: num_parts tensors of part_shape (or one (num_parts, *part_shape) tensor).

        Raises:
            RuntimeError: a gather is already outstanding, or the object failed.
        """
        self._check_alive()
        if self._pending:
            raise RuntimeError("start() while a gather is outstanding; call wait() first")
        items = as_parts(parts, self.num_parts, self.part_shape, self.dtype, self.device)
        p_world, r = self.world_size, self.rank
        with torch.cuda.device(self.device):
            cur = torch.cuda.current_stream(self.device)
            for p in range(p_world):  # "my buffer is free", behind everything already queued
                if p != r:
                    self._set_flag(cur, p, r)
            self._side.wait_stream(cur)
            with torch.cuda.stream(self._side), torch.no_grad():
                for step in range(p_world):
                    p = (r + step) % p_world
                    if p != r:
                        self._wait_flag(self._side, p, f"rank {p} to free its gather buffer")
                    for k, part in enumerate(items):
                        rows = part.view(self._rows, self._chunk)
                        for j, dst in enumerate(self._dst[p][k]):
                            dst.copy_(rows[j])
                    if p != r:
                        self._set_flag(self._side, p, p_world + r)
            self._keep_until_joined(items)
        self._pending = True

    def wait(self, parts: Parts) -> torch.Tensor:
        """Wait for every peer's shard; return the gathered buffer (num_parts, *out_part).

        The buffer is this object's and is overwritten by the next start(). When a part requires
        grad, the result is differentiable: its backward reduce-scatters the gradient.

        Args:
            parts: the same parts given to start().

        Raises:
            RuntimeError: no gather outstanding, or the object failed.
        """
        self._check_alive()
        if not self._pending:
            raise RuntimeError("wait() without a matching start()")
        items = as_parts(parts, self.num_parts, self.part_shape, self.dtype, self.device)
        p_world = self.world_size
        with torch.cuda.device(self.device):
            cur = torch.cuda.current_stream(self.device)
            for p in range(p_world):
                if p != self.rank:
                    self._wait_flag(cur, p_world + p, f"rank {p}'s shard")
            cur.wait_stream(self._side)
        self._held.clear()  # the current stream now follows every read of the parts
        self._pending = False
        if torch.is_grad_enabled() and any(t.requires_grad for t in items):
            return _GatherFunction.apply(self, *items)
        return self._mem.local

    def reduce_scatter(self, grad: torch.Tensor) -> torch.Tensor:
        """Sum `grad` (shaped like the output) over ranks; return this rank's shard per part.

        Args:
            grad: (num_parts, *out_part) on this rank's device.

        Returns:
            (num_parts, *part_shape): the summed gradient of this rank's shard of every part.
        """
        if tuple(grad.shape) != self.out_shape:
            raise ValueError(f"grad: expected shape {self.out_shape}, got {tuple(grad.shape)}")
        p_world = self.world_size
        # (parts, rows, P, chunk) -> (P, parts, rows, chunk): rank-major, what reduce-scatter takes.
        by_rank = (
            grad.reshape(self.num_parts, self._rows, p_world, self._chunk)
            .permute(2, 0, 1, 3)
            .contiguous()
        )
        if "nccl" in str(dist.get_backend(self.group)).lower():
            out = torch.empty_like(by_rank[0])
            dist.reduce_scatter_tensor(out, by_rank, group=self.group)
        elif torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "the all-gather's backward reduce-scatters over the process group, and gloo's "
                "all-reduce of CUDA tensors goes through the host, which a CUDA graph cannot "
                "capture; capture it with an nccl group (one GPU per rank)"
            )
        else:  # gloo has no reduce-scatter of CUDA tensors: all-reduce, keep this rank's share
            dist.all_reduce(by_rank, group=self.group)
            out = by_rank[self.rank]
        return out.reshape(self.num_parts, *self.part_shape)


class _GatherFunction(torch.autograd.Function):
    """wait()'s autograd node: forward is the gathered buffer, backward a reduce-scatter."""

    @staticmethod
    def forward(ctx, gather: CopyEngineAllGather, *parts: torch.Tensor) -> torch.Tensor:
        ctx.gather = gather
        return gather._mem.local.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        shards = ctx.gather.reduce_scatter(grad.contiguous())
        return (None, *shards.unbind(0))


class CopyEngineChannel(_CopyEngineBase):
    """Double-buffered pushes to dst and receives from src (ranks within group).

    Each rank owns two receive slots of shape (num_parts, *part_shape) that src writes
    alternately, one per step: the push of step i lands in slot (i + 1) % 2 of dst, which dst
    reads at step i + 1. A receiver frees a slot only after its compute (and any onward push from
    that slot) is queued, so a slot is never overwritten while it is being read.

    Per step i: send(parts, i) pushes into the slot dst reads at i + 1; recv(i) (i >= 1) waits for
    and returns this rank's slot for i; release(i) hands it back. join() makes the current stream
    wait for every pending push (needed before the end of a CUDA graph capture).

    Example (ring of K/V blocks):
        ch = CopyEngineChannel((B, H, S_local, D), 2, dtype=k.dtype, device=k.device)
        kv = torch.stack([k, v])
        for i in range(P):
            if i + 1 < P:
                ch.send(kv, i)
            attend(kv)
            if i > 0:
                ch.release(i)
            if i + 1 < P:
                kv = ch.recv(i + 1)

    Args:
        part_shape: shape of one part.
        num_parts: parts per step (2 for K and V).
        dtype: dtype of the parts.
        device: a CUDA device.
        group: the process group (default: the default group), inside one NVLink domain.
        src: the group rank this rank receives from (default: previous rank).
        dst: the group rank this rank pushes to (default: next rank).
        timeout_s: the longest any signal wait may take before the object fails.

    Raises:
        ValueError: a bad argument (named).
        RuntimeError: no initialised process group, no CUDA; misuse of the step protocol.
    """

    SLOTS = 2

    def __init__(
        self,
        part_shape: Sequence[int],
        num_parts: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        group: dist.ProcessGroup | None = None,
        src: int | None = None,
        dst: int | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        shape, dev = _check_common(part_shape, num_parts, dtype, device, timeout_s)
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        check_peer("src", src, world)
        check_peer("dst", dst, world)
        self.part_shape = shape
        self.num_parts = num_parts
        self.src = (rank - 1) % world if src is None else src
        self.dst = (rank + 1) % world if dst is None else dst
        # READY words start at 0 (nothing received); FREE words at 1 (both of dst's slots free).
        super().__init__(
            (self.SLOTS, num_parts, *shape), dtype, dev, group, timeout_s, 4, [0, 0, 1, 1]
        )
        self._steps = ChannelSteps()
        slots_dst = self._mem.peers[self.dst]
        self._dst_views = [[slots_dst[s, k] for k in range(num_parts)] for s in range(self.SLOTS)]

    def send(self, parts: Parts, i: int) -> None:
        """Push `parts` into the slot dst reads at step i + 1 (side stream, copy engine).

        Args:
            parts: num_parts tensors of part_shape, or a (num_parts, *part_shape) tensor.
            i: the step, 0, 1, 2, ... in every sequence.
        """
        self._check_alive()
        items = as_parts(parts, self.num_parts, self.part_shape, self.dtype, self.device)
        self._steps.on_send(i)
        slot = (i + 1) % self.SLOTS
        with torch.cuda.device(self.device):
            cur = torch.cuda.current_stream(self.device)
            self._side.wait_stream(cur)
            with torch.cuda.stream(self._side), torch.no_grad():
                self._wait_flag(self._side, 2 + slot, f"rank {self.dst} to free slot {slot}")
                for dst, part in zip(self._dst_views[slot], items, strict=True):
                    dst.copy_(part)
                self._set_flag(self._side, self.dst, slot)
            self._keep_until_joined(items)

    def recv(self, i: int) -> torch.Tensor:
        """Queue the wait for step i's data; return this rank's slot (num_parts, *part_shape).

        The slot is valid until release(i).
        """
        self._check_alive()
        self._steps.on_recv(i)
        slot = i % self.SLOTS
        with torch.cuda.device(self.device):
            cur = torch.cuda.current_stream(self.device)
            self._wait_flag(cur, slot, f"step {i} from rank {self.src}")
        return self._mem.local[slot]

    def release(self, i: int) -> None:
        """Hand step i's slot back to src once the work queued so far (compute, pushes) is done."""
        self._check_alive()
        self._steps.on_release(i)
        slot = i % self.SLOTS
        with torch.cuda.device(self.device):
            self._side.wait_stream(torch.cuda.current_stream(self.device))
            self._set_flag(self._side, self.src, 2 + slot)

    def join(self) -> None:
        """Make the current stream wait for every push and signal queued on the side stream."""
        self._check_alive()
        with torch.cuda.device(self.device):
            torch.cuda.current_stream(self.device).wait_stream(self._side)
        self._held.clear()  # the current stream now follows every read of the parts


# ----------------------------------------------------------------------------- all-to-all


def _contiguous_from(t: torch.Tensor) -> int:
    """The first dim i such that t's dims i.. are laid out row-major without gaps."""
    expected = 1
    for i in range(t.dim() - 1, -1, -1):
        if t.shape[i] == 1:
            continue
        if t.stride(i) != expected:
            return i + 1
        expected *= t.shape[i]
    return 0


def _row_copies(
    src_shape: tuple[int, ...], src_region: Region, dst_shape: tuple[int, ...], dst_region: Region
) -> list[tuple[int, int, int]]:
    """(src offset, dst offset, length) in elements: the contiguous copies that move one region of
    a contiguous tensor of src_shape into one region of a contiguous tensor of dst_shape.

    A copy between strided views would launch an SM kernel; contiguous 1-D ones stay memcpys.
    Rows that continue each other on both sides are merged into one copy.
    """
    a = narrow(torch.empty(src_shape, device="meta"), src_region)
    b = narrow(torch.empty(dst_shape, device="meta"), dst_region)
    assert a.shape == b.shape, (a.shape, b.shape)
    split = max(_contiguous_from(a), _contiguous_from(b))
    length = math.prod(a.shape[split:])
    rows: list[tuple[int, int, int]] = []
    for idx in itertools.product(*(range(n) for n in a.shape[:split])):
        src = a.storage_offset() + sum(i * s for i, s in zip(idx, a.stride(), strict=False))
        dst = b.storage_offset() + sum(i * s for i, s in zip(idx, b.stride(), strict=False))
        if rows and rows[-1][0] + rows[-1][2] == src and rows[-1][1] + rows[-1][2] == dst:
            rows[-1] = (rows[-1][0], rows[-1][1], rows[-1][2] + length)
        else:
            rows.append((src, dst, length))
    return rows


class CopyEngineAllToAll(AllToAllCalls, _CopyEngineBase):
    """All-to-all by copy-engine pulls from symmetric staging buffers, into the consumer's layout.

    The geometry is attngym.distributed.transport.parts.AllToAllPlan's (shared with P2PAllToAll):
    rank r sends rank p the pieces of its input the plan gives p (by default slice p along
    split_dim), and every received block lands at its place along concat_dim of a fresh output
    tensor that the caller owns, so no reorder follows (a zigzag sequence comes out in global
    order).

    Why pull: the output must outlive the next exchange (autograd saves it; a caller keeps it), so
    it cannot be a persistent symmetric buffer that peers write into. Instead every rank stages
    the blocks it sends in its own symmetric buffer (P, num_parts, *block_shape), one local
    device copy, and each receiver copies its block out of every peer's staging buffer straight
    into its output.

    Per exchange, on the side stream (after waiting for the current stream), rank r:
        1. waits FREE from every peer (it finished reading r's staging buffer last time);
        2. copies the block for each peer p into staging slot p, then sets READY in p's pad;
        3. copies its own block from the input into the output;
        4. for each peer p: waits READY from p, copies p's slot r into the output, sets FREE in
           p's pad.
    The current stream then waits for the side stream: what the caller queues next sees the
    output. Everything is a memcpy or a stream memory operation (no SM kernel). FREE words start
    at 1, READY at 0; each is set once and reset once per exchange (capture-safe as the contract
    above says). One exchange is in flight per object; the staging buffer is the object's.

    Signal pad: [0, P) READY from peer p; [P, 2P) FREE from peer p.

    Example (Ulysses: sequence-sharded q, k, v to head-sharded, whole sequence):
        a2a = CopyEngineAllToAll((B, H, S // P, D), 3, 1, 2, dtype=q.dtype, device=q.device)
        qkv = a2a([q, k, v])      # (3, B, H // P, S, D); differentiable when an input needs grad
        back = a2a.inverse()       # (B, H // P, S, D) parts -> (B, H, S // P, D)

    Args:
        part_shape: shape of one input part on this rank.
        num_parts: parts exchanged together.
        split_dim: the dim of part_shape cut into one block per destination rank.
        concat_dim: the dim of the output along which received blocks are placed.
        dtype: dtype of the parts.
        device: a CUDA device.
        group: the process group (default: the default group), inside one NVLink domain.
        split_order, concat_order: which pieces go where (AllToAllPlan); None is rank order.
        timeout_s: the longest any signal wait may take before the object fails.

    Raises:
        ValueError: a bad argument (named).
        RuntimeError: no initialised process group or no CUDA.
    """

    def __init__(
        self,
        part_shape: Sequence[int],
        num_parts: int,
        split_dim: int,
        concat_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        group: dist.ProcessGroup | None = None,
        split_order: Sequence[Sequence[int]] | None = None,
        concat_order: Sequence[Sequence[int]] | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        shape, dev = _check_common(part_shape, num_parts, dtype, device, timeout_s)
        world = dist.get_world_size(group)
        self.plan = AllToAllPlan.build(
            shape, world, split_dim, concat_dim, split_order, concat_order
        )
        self.part_shape = shape
        self.num_parts = num_parts
        self.out_shape = (num_parts, *self.plan.out_shape)
        block = self.plan.block_shape
        pad_init = [0] * world + [1] * world
        super().__init__(
            (world, num_parts, *block), dtype, dev, group, timeout_s, 2 * world, pad_init
        )
        r, out_part = self.rank, self.plan.out_shape
        self._block_numel = math.prod(block)
        # Offsets (elements) within one part, per peer: input -> staging block, staging block of
        # the peer -> output, and this rank's own input -> output.
        self._stage_rows = {
            p: [
                row
                for src, blk, _ in self.plan.moves(r, p)
                for row in _row_copies(shape, src, block, blk)
            ]
            for p in range(world)
            if p != r
        }
        self._pull_rows = {
            p: [
                row
                for _, blk, dst in self.plan.moves(p, r)
                for row in _row_copies(block, blk, out_part, dst)
            ]
            for p in range(world)
            if p != r
        }
        self._own_rows = [
            row
            for src, _, dst in self.plan.moves(r, r)
            for row in _row_copies(shape, src, out_part, dst)
        ]

    def _slot(self, buffer: torch.Tensor, p: int, k: int) -> torch.Tensor:
        """Part k of staging slot p of `buffer` (this rank's or a peer's), flat."""
        start = (p * self.num_parts + k) * self._block_numel
        return buffer.view(-1)[start : start + self._block_numel]

    def start(self, parts: Parts) -> torch.Tensor:
        """Issue the all-to-all of `parts` on the side stream (after the current stream's work so
        far); `wait` gives its output. What the current stream queues meanwhile runs beside it.

        Raises:
            RuntimeError: the object failed (a peer timed out earlier).
        """
        self._check_alive()
        items = as_parts(parts, self.num_parts, self.part_shape, self.dtype, self.device)
        p_world, r = self.world_size, self.rank
        peers = [(r + step) % p_world for step in range(1, p_world)]
        with torch.cuda.device(self.device):
            cur = torch.cuda.current_stream(self.device)
            out = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
            outs = [o.view(-1) for o in out.unbind(0)]
            flat = [t.view(-1) for t in items]
            self._side.wait_stream(cur)
            self._keep_until_joined([*items, out])  # the caller may drop them before `wait`
            with torch.cuda.stream(self._side), torch.no_grad():
                for p in peers:
                    self._wait_flag(self._side, p_world + p, f"rank {p} to free its staging slot")
                for p in peers:
                    for k in range(self.num_parts):
                        slot = self._slot(self._mem.local, p, k)
                        for src, dst, n in self._stage_rows[p]:
                            slot[dst : dst + n].copy_(flat[k][src : src + n])
                    self._set_flag(self._side, p, r)
                for k in range(self.num_parts):
                    for src, dst, n in self._own_rows:
                        outs[k][dst : dst + n].copy_(flat[k][src : src + n])
                for p in peers:
                    self._wait_flag(self._side, p, f"rank {p}'s block")
                    for k in range(self.num_parts):
                        slot = self._slot(self._mem.peers[p], r, k)
                        for src, dst, n in self._pull_rows[p]:
                            outs[k][dst : dst + n].copy_(slot[src : src + n])
                    self._set_flag(self._side, p, p_world + r)
        return out

    def wait(self, started: torch.Tensor) -> torch.Tensor:
        """The output of a `start`ed all-to-all, the current stream ordered after it: a fresh
        (num_parts, *out_part) tensor the caller owns."""
        torch.cuda.current_stream(self.device).wait_stream(self._side)
        self._held.clear()  # the current stream now follows every read of the parts
        return started


# ----------------------------------------------------------------------------- uneven exchange


class CopyEngineExchange(ExchangeCalls, _CopyEngineBase):
    """An uneven exchange by copy-engine pulls from symmetric staging buffers: rank r sends rank p
    `sizes[r][p]` elements of its flat send buffer (destinations in rank order) and receives
    `sizes[p][r]` from each rank p into a fresh flat tensor (sources in rank order) that the
    caller owns. The all-gather's exact K/V exchange; `inverse()` sends everything back.

    Per exchange, on the side stream (after waiting for the current stream), rank r:
        1. waits FREE from every peer (it finished reading r's staging buffer last time);
        2. copies its send buffer into its staging buffer (one copy), then sets READY in every
           peer's pad;
        3. for each peer p: waits READY from p, copies its elements out of p's staging buffer,
           sets FREE in p's pad.
    Every peer is signalled, also those that exchange nothing, so the pads stay balanced. The
    staging buffer holds the most any rank sends (a symmetric allocation has one size).

    Signal pad: [0, P) READY from peer p; [P, 2P) FREE from peer p (as CopyEngineAllToAll).

    Args:
        sizes: sizes[src][dst], elements src sends dst (the same matrix on every rank).
        dtype: of the buffers.
        device: a CUDA device.
        group: the process group (default: the default group), inside one NVLink domain.
        timeout_s: the longest any signal wait may take before the object fails.
    """

    def __init__(
        self,
        sizes: Sequence[Sequence[int]],
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        group: dist.ProcessGroup | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        _, dev = _check_common((1,), 1, dtype, device, timeout_s)
        world = dist.get_world_size(group)
        self.sizes = check_sizes(sizes, world)
        staging = max(1, max(sum(row) for row in self.sizes))
        super().__init__(
            (staging,), dtype, dev, group, timeout_s, 2 * world, [0] * world + [1] * world
        )
        # Where src's elements for dst start in src's staging buffer, and in dst's output.
        self._staged = [list(itertools.accumulate(row, initial=0)) for row in self.sizes]
        self._landing = list(
            itertools.accumulate((row[self.rank] for row in self.sizes), initial=0)
        )

    def start(self, send: torch.Tensor):
        """Issue the exchange of `send` (flat, `sent(rank)` elements) on the side stream after
        the current stream's work so far; `wait` gives its output.

        Raises:
            RuntimeError: the object failed (a peer timed out earlier).
        """
        self._check_alive()
        p_world, r = self.world_size, self.rank
        if send.numel() != self.sent(r):
            raise ValueError(f"send: expected {self.sent(r)} elements, got {send.numel()}")
        peers = [(r + step) % p_world for step in range(1, p_world)]
        with torch.cuda.device(self.device):
            cur = torch.cuda.current_stream(self.device)
            out = torch.empty(self.received(r), dtype=self.dtype, device=self.device)
            flat = send.contiguous().view(-1)
            self._side.wait_stream(cur)
            with torch.cuda.stream(self._side), torch.no_grad():
                for p in peers:
                    self._wait_flag(self._side, p_world + p, f"rank {p} to free its staging buffer")
                if flat.numel():
                    self._mem.local[: flat.numel()].copy_(flat)
                for p in peers:
                    self._set_flag(self._side, p, r)
                for p in peers:
                    self._wait_flag(self._side, p, f"rank {p}'s rows")
                    n, start = self.sizes[p][r], self._staged[p][r]
                    if n:
                        out[self._landing[p] : self._landing[p] + n].copy_(
                            self._mem.peers[p][start : start + n]
                        )
                    self._set_flag(self._side, p, p_world + r)
        return out, flat  # the send buffer lives until the wait

    def wait(self, started) -> torch.Tensor:
        """The output of a `start`ed exchange (a fresh flat tensor the caller owns), the current
        stream ordered after it."""
        out, _ = started
        torch.cuda.current_stream(self.device).wait_stream(self._side)
        return out
