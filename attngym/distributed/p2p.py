"""The copy-engine transport interface over torch.distributed point-to-point and collectives.

Same constructors and methods as `CopyEngineChannel` / `CopyEngineAllGather`, but the bytes move
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

P2PAllGather contract: one gather in flight (`start` → `wait`); `all_gather_into_tensor` fills a
persistent (P, num_parts, *part_shape) buffer on the backend's stream; `wait` reorders it into a
fresh (num_parts, *gathered_shape) tensor in the consumer's layout (rank r's shard at offset
r·part_shape[dim]) that the caller owns. `reduce_scatter` is the collective of the same name.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import torch

from attngym.errors import RankFailure

Parts = torch.Tensor | Sequence[torch.Tensor]


def _dist():
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("the P2P transport needs an initialised torch.distributed process group")
    return dist


def _global(dist, group, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def _check_parts(
    what: str, parts: Parts, num_parts: int, part_shape: tuple[int, ...], dtype, device
) -> list[torch.Tensor]:
    """The parts as a list of tensors of part_shape, or RuntimeError saying what is wrong."""
    if isinstance(parts, torch.Tensor):
        if tuple(parts.shape) != (num_parts, *part_shape):
            raise RuntimeError(
                f"{what}: expected a ({num_parts}, {', '.join(map(str, part_shape))}) tensor, "
                f"got shape {tuple(parts.shape)}"
            )
        parts = list(parts.unbind(0))
    parts = list(parts)
    if len(parts) != num_parts:
        raise RuntimeError(f"{what}: expected {num_parts} parts, got {len(parts)}")
    for j, p in enumerate(parts):
        if tuple(p.shape) != part_shape:
            raise RuntimeError(
                f"{what}: part {j} has shape {tuple(p.shape)}, expected {tuple(part_shape)}"
            )
        if p.dtype != dtype:
            raise RuntimeError(f"{what}: part {j} has dtype {p.dtype}, expected {dtype}")
        if p.device != device:
            raise RuntimeError(f"{what}: part {j} is on {p.device}, expected {device}")
    return parts


def _wait(works, *, timeout_s: float, device: torch.device, what: str) -> None:
    """Wait for works; on CPU bounded by timeout_s (a CUDA wait only orders streams)."""
    try:
        for w in works:
            if device.type == "cuda":
                w.wait()
            else:
                w.wait(datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise RankFailure(f"{what} failed or timed out after {timeout_s:g} s: {e}") from e


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
        dist = _dist()
        self.part_shape = tuple(int(s) for s in part_shape)
        self.num_parts = int(num_parts)
        self.dtype = dtype
        self.device = torch.device(device)
        self.group = group
        self.timeout_s = float(timeout_s)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.src = (self.rank - 1) % self.world_size if src is None else int(src)
        self.dst = (self.rank + 1) % self.world_size if dst is None else int(dst)
        for name, peer in (("src", self.src), ("dst", self.dst)):
            if not 0 <= peer < self.world_size:
                raise ValueError(f"{name} must be a rank in [0, {self.world_size}), got {peer}")
        self._slots = torch.empty(
            (2, self.num_parts, *self.part_shape), dtype=dtype, device=self.device
        )
        # Per slot: None (free) or [step, receive works or None once received].
        self._state: list[list | None] = [None, None]
        self._sends: list[tuple[list, list[torch.Tensor]]] = []  # (works, tensors kept alive)

    def send(self, parts: Parts, i: int) -> None:
        """Push `parts` to dst for its step i + 1 and post this rank's receive of step i + 1."""
        parts = _check_parts(
            f"send(parts, {i})", parts, self.num_parts, self.part_shape, self.dtype, self.device
        )
        slot = (i + 1) % 2
        held = self._state[slot]
        if held is not None:
            raise RuntimeError(
                f"send(parts, {i}) receives step {i + 1} into slot {slot}, which still holds step "
                f"{held[0]}: call release({held[0]}) first"
            )
        parts = [p.contiguous() for p in parts]
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
        if i < 1:
            raise RuntimeError(f"recv({i}): steps start at 1 (step 0 is this rank's own data)")
        held = self._state[i % 2]
        if held is None or held[0] != i:
            raise RuntimeError(
                f"recv({i}): step {i} was never sent to this rank "
                f"(send(parts, {i - 1}) posts it; slot {i % 2} holds "
                f"{'nothing' if held is None else f'step {held[0]}'})"
            )
        if held[1] is not None:
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
    """

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
        dist = _dist()
        self.part_shape = tuple(int(s) for s in part_shape)
        if not -len(self.part_shape) <= dim < len(self.part_shape):
            raise ValueError(f"dim must index part_shape {self.part_shape}, got {dim}")
        self.dim = dim % len(self.part_shape)
        self.num_parts = int(num_parts)
        self.dtype = dtype
        self.device = torch.device(device)
        self.group = group
        self.timeout_s = float(timeout_s)
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
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
        parts = _check_parts(
            "start(parts)", parts, self.num_parts, self.part_shape, self.dtype, self.device
        )
        self._input = torch.stack([p.detach() for p in parts])
        dist = _dist()
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._work = all_gather(
            self._raw.view(-1), self._input.view(-1), group=self.group, async_op=True
        )

    def wait(self, parts: Parts) -> torch.Tensor:
        """The gathered (num_parts, *gathered_shape) tensor; differentiable if a part needs grad."""
        if self._input is None:
            raise RuntimeError("wait(): no gather outstanding; call start(parts) first")
        parts = _check_parts(
            "wait(parts)", parts, self.num_parts, self.part_shape, self.dtype, self.device
        )
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
            raise RuntimeError(
                f"reduce_scatter: grad has shape {tuple(grad.shape)}, expected {self.out_shape}"
            )
        dist = _dist()
        split = list(self.out_shape)
        split[1 + self.dim : 2 + self.dim] = [self.world_size, self.part_shape[self.dim]]
        grad_PN = grad.reshape(split).movedim(1 + self.dim, 0).contiguous()
        out = torch.empty((self.num_parts, *self.part_shape), dtype=grad.dtype, device=grad.device)
        reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        reduce_scatter(out.view(-1), grad_PN.view(-1), group=self.group)
        return out
