"""The copy-engine transport interface over torch.distributed point-to-point and collectives.

Same constructors and methods as `CopyEngineChannel` / `CopyEngineAllGather` /
`CopyEngineAllToAll` / `CopyEngineExchange`, but the bytes move
through the process group's backend: NCCL for CUDA tensors, gloo for CPU tensors. The group must
have a backend for the tensors' device (launch.py creates "cpu:gloo,cuda:nccl" on CUDA hosts).

P2PChannel contract (ring of ranks; src sends to this rank, this rank sends to dst):
    * Each rank owns two receive slots (2, num_parts, *part_shape); step i lands in slot i % 2.
    * `send(parts, i)` issues, in one `batch_isend_irecv`, the push of `parts` to dst (dst reads it
      at step i + 1) and this rank's matching receive from src for step i + 1. Pairing the two in
      one batch is what keeps NCCL's matched send/recv free of deadlock around the ring, so every
      rank calls `send(·, i)` for the same steps (ring attention does).
    * In flight at any time: at most one receive per slot and the push of the last step. The
      channel keeps a reference to every pushed tensor until its push is waited (the next `send`
      or `join()` waits it), so the caller may drop what it pushed; it may overwrite it in place
      only after `join()`. A push out of a receive slot is finished before that slot is reused.
    * Who frees a slot: the receiver, with `release(i)`, once its compute and any onward push from
      that slot are queued. A send that would receive into a slot still held raises RuntimeError.
    * On CUDA `recv` makes the current stream wait for NCCL's stream (no host block); on CPU it
      blocks the host, at most `timeout_s`, then raises RankFailure naming the peer.

P2PAllGather contract: one gather in flight (`start` → `wait`); the gather fills a persistent
(P, num_parts, *part_shape) buffer on the backend's stream; `wait` reorders it into a fresh
(num_parts, *gathered_shape) tensor in the consumer's layout (rank r's shard at offset
r·part_shape[dim]) that the caller owns. `reduce_scatter` sums an output-shaped gradient over ranks
and returns this rank's shard.

P2PAllToAll contract: one `all_to_all_single` per exchange, through persistent rank-major send and
receive buffers; the output is a fresh tensor the caller owns, placed as the AllToAllPlan says.

P2PExchange contract: one `all_to_all_single` with uneven split sizes per exchange, from the
caller's flat send buffer into a fresh flat output.

Collectives per backend (the one for the tensors' device): NCCL runs the tensor collectives
`all_gather_into_tensor` and `reduce_scatter_tensor`. Any other backend (gloo) runs the list forms
every backend documents: `all_gather` into per-rank views of the buffer, and `all_reduce` of the
gradient keeping this rank's share (P times the bytes of a reduce-scatter; gloo is the CPU path).

Arguments and parts are checked by attngym.distributed.transport.parts, as in the copy-engine
transport: wrong arguments or parts are ValueError, protocol misuse is RuntimeError.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Sequence

import torch

from attngym.distributed.transport.parts import (
    AllToAllCalls,
    AllToAllPlan,
    ChannelSteps,
    ExchangeCalls,
    Parts,
    as_parts,
    check_args,
    check_dim,
    check_part_shape,
    check_peer,
    check_sizes,
    narrow,
)
from attngym.errors import RankFailure


def _dist():
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("the P2P transport needs an initialised torch.distributed process group")
    return dist


def _global(dist, group, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def _device(device: torch.device) -> torch.device:
    """`device` with its CUDA index filled in (parts carry one; bare "cuda" would not match)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _uses_nccl(dist, group, device: torch.device) -> bool:
    """True when the group's backend for `device` tensors is NCCL."""
    backend = str(dist.get_backend(group)).lower()
    if ":" in backend:  # "cpu:gloo,cuda:nccl"
        backend = dict(part.split(":") for part in backend.split(",")).get(device.type, "")
    return backend == "nccl"


def _wait(works, *, timeout_s: float, device: torch.device, what: str) -> None:
    """Wait for works; on CPU bounded by timeout_s (a CUDA wait only orders streams)."""
    start = time.monotonic()
    try:
        for w in works:
            if device.type == "cuda":
                w.wait()
            else:
                w.wait(datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:
        waited = time.monotonic() - start
        how = (
            f"timed out after {timeout_s:g} s"
            if waited >= 0.9 * timeout_s
            else f"failed after {waited:.1f} s (a peer rank ended)"
        )
        raise RankFailure(f"{what} {how}: {str(e).splitlines()[0]}") from e


def _init_common(obj, part_shape, num_parts, dtype, device, group, timeout_s) -> None:
    """Check the shared constructor arguments and set what both P2P classes hold."""
    shape, dev = check_args(part_shape, num_parts, dtype, device, timeout_s)
    dist = _dist()
    obj.part_shape = shape
    obj.num_parts = num_parts
    obj.dtype = dtype
    obj.device = _device(dev)
    obj.group = group
    obj.timeout_s = float(timeout_s)
    obj.rank = dist.get_rank(group)
    obj.world_size = dist.get_world_size(group)


class P2PChannel:
    """Double-buffered pushes to `dst` and receives from `src` over torch.distributed P2P.

    Args:
        part_shape: shape of one part, e.g. (B, G, S/P, D) for a K or V shard.
        num_parts: parts per push (2 for K and V).
        dtype, device: of every part and of the receive slots.
        group: process group (default: the world).
        src, dst: group ranks this rank receives from / sends to (default previous / next).
        timeout_s: how long a CPU receive waits before raising RankFailure.
    """

    def __init__(
        self,
        part_shape: Sequence[int],
        num_parts: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        group=None,
        src: int | None = None,
        dst: int | None = None,
        timeout_s: float = 60.0,
    ):
        _init_common(self, part_shape, num_parts, dtype, device, group, timeout_s)
        check_peer("src", src, self.world_size)
        check_peer("dst", dst, self.world_size)
        self.src = (self.rank - 1) % self.world_size if src is None else src
        self.dst = (self.rank + 1) % self.world_size if dst is None else dst
        self._steps = ChannelSteps()  # the step order, shared with CopyEngineChannel
        self._slots = torch.empty(
            (2, self.num_parts, *self.part_shape), dtype=dtype, device=self.device
        )
        # Per slot: None (free) or [step, receive works or None once received].
        self._state: list[list | None] = [None, None]
        self._sends: list[tuple[list, list[torch.Tensor]]] = []  # (works, tensors kept alive)

    def send(self, parts: Parts, i: int) -> None:
        """Push `parts` to dst for its step i + 1 and post this rank's receive of step i + 1."""
        parts = as_parts(parts, self.num_parts, self.part_shape, self.dtype, self.device)
        slot = (i + 1) % 2
        held = self._state[slot]
        if held is not None:
            raise RuntimeError(
                f"send(parts, {i}) receives step {i + 1} into slot {slot}, which still holds step "
                f"{held[0]}: call release({held[0]}) first"
            )
        self._steps.on_send(i)
        # The previous push may read the slot this send receives into (an onward push of a
        # received slot): it must be finished before the receive is posted.
        self.join()
        if self.src == self.dst == self.rank:  # a ring of one: the push is a local copy
            self._slots[slot].copy_(torch.stack(parts))
            self._state[slot] = [i + 1, []]
            return
        dist = _dist()
        ops = []
        for j, p in enumerate(parts):
            dst = _global(dist, self.group, self.dst)
            src = _global(dist, self.group, self.src)
            ops.append(dist.P2POp(dist.isend, p, dst, self.group, tag=j))
            ops.append(dist.P2POp(dist.irecv, self._slots[slot, j], src, self.group, tag=j))
        works = dist.batch_isend_irecv(ops)
        if len(works) == len(ops):  # one work per op (gloo): wait sends and receives apart
            send_works, recv_works = works[0::2], works[1::2]
        else:  # coalesced (NCCL): one work covers the batch
            send_works = recv_works = works
        self._state[slot] = [i + 1, recv_works]
        self._sends.append((send_works, parts))

    def recv(self, i: int) -> torch.Tensor:
        """Wait for step i (i >= 1) and return this rank's slot, (num_parts, *part_shape)."""
        if isinstance(i, bool) or not isinstance(i, int):
            raise ValueError(f"i: expected an int step, got {i!r}")
        if i < 1:
            raise RuntimeError(f"recv({i}): steps start at 1 (step 0 is this rank's own data)")
        held = self._state[i % 2]
        if held is None or held[0] != i:
            raise RuntimeError(
                f"recv({i}): step {i} was never sent to this rank "
                f"(send(parts, {i - 1}) posts it; slot {i % 2} holds "
                f"{'nothing' if held is None else f'step {held[0]}'})"
            )
        self._steps.on_recv(i)  # RuntimeError on a second recv(i), as on the copy engine
        _wait(
            held[1],
            timeout_s=self.timeout_s,
            device=self.device,
            what=f"receive of step {i} from rank {self.src}",
        )
        held[1] = None
        return self._slots[i % 2]

    def release(self, i: int) -> None:
        """Hand the slot of step i back, after everything reading it has been queued."""
        held = self._state[i % 2]
        if held is None or held[0] != i or held[1] is not None:
            raise RuntimeError(f"release({i}): step {i} is not a received, unreleased step")
        self._steps.on_release(i)
        self._state[i % 2] = None

    def join(self) -> None:
        """Wait until every push issued so far has finished (the tensors may then be reused)."""
        while self._sends:
            works, _ = self._sends.pop(0)
            _wait(
                works, timeout_s=self.timeout_s, device=self.device, what=f"push to rank {self.dst}"
            )


class _GatherWait(torch.autograd.Function):
    """Reorder the gathered buffer; backward reduce-scatters the gradient to each part."""

    @staticmethod
    def forward(ctx, ag: P2PAllGather, raw, *parts):
        ctx.ag = ag
        return ag._reorder(raw)

    @staticmethod
    def backward(ctx, grad):
        shards = ctx.ag.reduce_scatter(grad)
        return (None, None, *shards.unbind(0))


class P2PAllGather:
    """All-gather of num_parts tensors along `dim` with `all_gather_into_tensor`.

    Args:
        part_shape: shape of one part on this rank, e.g. (B, G, S/P, D).
        num_parts: parts gathered together (2 for K and V).
        dim: the dimension of part_shape that is concatenated over ranks.
        dtype, device: of every part.
        group: process group (default: the world).
        timeout_s: how long a CPU wait blocks before raising RankFailure.

    OUTPUT_REUSED: False, wait() returns a new tensor each time (CopyEngineAllGather's is True).
    """

    OUTPUT_REUSED = False

    def __init__(
        self,
        part_shape: Sequence[int],
        num_parts: int,
        dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        group=None,
        timeout_s: float = 60.0,
    ):
        self.dim = check_dim(dim, check_part_shape(part_shape))
        _init_common(self, part_shape, num_parts, dtype, device, group, timeout_s)
        shape = list(self.part_shape)
        shape[self.dim] *= self.world_size
        self.out_shape = (self.num_parts, *shape)
        self._raw = torch.empty(
            (self.world_size, self.num_parts, *self.part_shape), dtype=dtype, device=self.device
        )
        self._work = None
        self._input: torch.Tensor | None = None

    def start(self, parts: Parts) -> None:
        """Issue the gather of this rank's parts (one gather may be outstanding)."""
        if self._input is not None:
            raise RuntimeError("start(): a gather is already outstanding; wait() for it first")
        parts = as_parts(parts, self.num_parts, self.part_shape, self.dtype, self.device)
        self._input = torch.stack([p.detach() for p in parts])
        dist = _dist()
        if _uses_nccl(dist, self.group, self.device):
            self._work = dist.all_gather_into_tensor(
                self._raw.view(-1), self._input.view(-1), group=self.group, async_op=True
            )
        else:  # gloo: the list form, written straight into the buffer's per-rank rows
            self._work = dist.all_gather(
                list(self._raw.unbind(0)), self._input, group=self.group, async_op=True
            )

    def wait(self, parts: Parts) -> torch.Tensor:
        """The gathered (num_parts, *gathered_shape) tensor; differentiable if a part needs grad."""
        if self._input is None:
            raise RuntimeError("wait(): no gather outstanding; call start(parts) first")
        parts = as_parts(parts, self.num_parts, self.part_shape, self.dtype, self.device)
        _wait([self._work], timeout_s=self.timeout_s, device=self.device, what="all-gather")
        self._work, self._input = None, None
        if torch.is_grad_enabled() and any(p.requires_grad for p in parts):
            return _GatherWait.apply(self, self._raw, *parts)
        return self._reorder(self._raw)

    def _reorder(self, raw_PN: torch.Tensor) -> torch.Tensor:
        # (P, n, *pre, s, *post) -> (n, *pre, P, s, *post) -> (n, *pre, P·s, *post)
        return raw_PN.movedim(0, 1 + self.dim).reshape(self.out_shape).clone()

    def reduce_scatter(self, grad: torch.Tensor) -> torch.Tensor:
        """Sum `grad` (output-shaped) over ranks; this rank's shard, (num_parts, *part_shape)."""
        if tuple(grad.shape) != self.out_shape:
            raise ValueError(f"grad: expected shape {self.out_shape}, got {tuple(grad.shape)}")
        dist = _dist()
        split = list(self.out_shape)
        split[1 + self.dim : 2 + self.dim] = [self.world_size, self.part_shape[self.dim]]
        grad_PN = grad.reshape(split).movedim(1 + self.dim, 0).contiguous()
        if _uses_nccl(dist, self.group, grad.device):
            out = torch.empty(
                (self.num_parts, *self.part_shape), dtype=grad.dtype, device=grad.device
            )
            dist.reduce_scatter_tensor(out.view(-1), grad_PN.view(-1), group=self.group)
            return out
        # gloo: all-reduce, keep this rank's share (see the module docstring)
        dist.all_reduce(grad_PN, group=self.group)
        return grad_PN[self.rank].clone()


class P2PAllToAll(AllToAllCalls):
    """All-to-all of num_parts tensors with `all_to_all_single` (NCCL, and gloo on CPU).

    Rank r sends the pieces of its input that the plan gives rank p
    (attngym.distributed.transport.parts.
    AllToAllPlan: by default slice p along split_dim) and receives every rank's block into a fresh
    output at its place along concat_dim. The blocks are packed rank-major into a persistent send
    buffer (P, num_parts, *block_shape), exchanged into a persistent receive buffer, and unpacked
    into the output; both backends run the one collective (gloo implements it for CPU tensors).
    The output belongs to the caller. Calling the object is differentiable: the backward is the
    inverse all-to-all (`inverse()`, built on first use).

    Args:
        part_shape: shape of one input part on this rank, e.g. (B, H, S/P, D).
        num_parts: parts exchanged together (3 for q, k, v).
        split_dim: the dim of part_shape cut into one block per destination rank.
        concat_dim: the dim of the output along which the received blocks are placed.
        dtype, device: of every part.
        group: process group (default: the world).
        split_order, concat_order: which pieces go where (AllToAllPlan); None is rank order.
        timeout_s: how long a CPU wait blocks before raising RankFailure.
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
        group=None,
        split_order: Sequence[Sequence[int]] | None = None,
        concat_order: Sequence[Sequence[int]] | None = None,
        timeout_s: float = 60.0,
    ):
        _init_common(self, part_shape, num_parts, dtype, device, group, timeout_s)
        self.plan = AllToAllPlan.build(
            self.part_shape, self.world_size, split_dim, concat_dim, split_order, concat_order
        )
        self.out_shape = (self.num_parts, *self.plan.out_shape)
        buffer = (self.world_size, self.num_parts, *self.plan.block_shape)
        self._send = torch.empty(buffer, dtype=dtype, device=self.device)
        self._recv = torch.empty(buffer, dtype=dtype, device=self.device)
        self._moves = {
            (src, dst): self.plan.moves(src, dst)
            for src in range(self.world_size)
            for dst in range(self.world_size)
        }

    def start(self, parts: Parts):
        """Issue the all-to-all of `parts` (packed now, sent beside what the caller queues next);
        `wait` gives its output. One exchange of an object in flight at a time."""
        parts = as_parts(parts, self.num_parts, self.part_shape, self.dtype, self.device)
        r, world = self.rank, self.world_size
        with torch.no_grad():
            for p in range(world):
                for k, part in enumerate(parts):
                    for src, block, _ in self._moves[(r, p)]:
                        narrow(self._send[p, k], block).copy_(narrow(part, src))
            if world == 1:
                self._recv.copy_(self._send)
                return None
            return _dist().all_to_all_single(
                self._recv, self._send, group=self.group, async_op=True
            )

    def wait(self, started) -> torch.Tensor:
        """The output of a `start`ed all-to-all: a fresh (num_parts, *out_part) tensor."""
        r, world = self.rank, self.world_size
        if started is not None:
            _wait([started], timeout_s=self.timeout_s, device=self.device, what="all-to-all")
        with torch.no_grad():
            out = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
            for p in range(world):
                for k in range(self.num_parts):
                    for _, block, dst in self._moves[(p, r)]:
                        narrow(out[k], dst).copy_(narrow(self._recv[p, k], block))
        return out


class P2PExchange(ExchangeCalls):
    """An uneven exchange with one `all_to_all_single` (NCCL, and gloo on CPU): rank r sends rank
    p `sizes[r][p]` elements of its flat send buffer (destinations in rank order) and receives
    `sizes[p][r]` from each rank p into a fresh flat tensor (sources in rank order) that the
    caller owns. The all-gather's exact K/V exchange; `inverse()` sends everything back.

    Args:
        sizes: sizes[src][dst], elements src sends dst (the same matrix on every rank; 0 on the
            diagonal).
        dtype, device: of the buffers.
        group: process group (default: the world).
        timeout_s: how long a CPU wait blocks before raising RankFailure.
    """

    def __init__(self, sizes, *, dtype, device, group=None, timeout_s: float = 60.0):
        _init_common(self, (1,), 1, dtype, device, group, timeout_s)
        self.sizes = check_sizes(sizes, self.world_size)

    def start(self, send: torch.Tensor):
        """Issue the exchange of `send` (flat, `sent(rank)` elements); `wait` gives its output."""
        r, world = self.rank, self.world_size
        if send.numel() != self.sent(r):
            raise ValueError(f"send: expected {self.sent(r)} elements, got {send.numel()}")
        out = torch.empty(self.received(r), dtype=self.dtype, device=self.device)
        work = None
        if world > 1:
            work = _dist().all_to_all_single(
                out, send.contiguous(), [row[r] for row in self.sizes], list(self.sizes[r]),
                group=self.group, async_op=True,
            )  # fmt: skip
        return out, work

    def wait(self, started) -> torch.Tensor:
        """The output of a `start`ed exchange: a fresh flat tensor the caller owns."""
        out, work = started
        if work is not None:
            _wait([work], timeout_s=self.timeout_s, device=self.device, what="exchange")
        return out
