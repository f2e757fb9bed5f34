"""Argument checks and step bookkeeping shared by every transport (copy engine and P2P).

The all-to-all geometry (which piece of whose input lands where) is AllToAllPlan, and its autograd
node AllToAllFunction, both shared by CopyEngineAllToAll and P2PAllToAll. The uneven exchange
(CopyEngineExchange and P2PExchange: rank r sends rank p sizes[r][p] elements) shares its size
checks and its inverse here too.

Both transports take the same constructor arguments and the same `parts`, and follow the same
channel step protocol, so they judge them in one place and fail the same way:

    * a wrong argument or wrong parts (count, shape, dtype, device) is a ValueError that names the
      parameter (`part_shape`, `parts[1]`, `i`, ...), the value received and what is expected;
    * misuse of the protocol (a step out of order, a slot received twice or still held) is a
      RuntimeError that says which call to make first.

This module imports only torch, so the P2P transport does not pull in CUDA-only modules.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

Parts = torch.Tensor | Sequence[torch.Tensor]


def check_part_shape(part_shape: Sequence[int]) -> tuple[int, ...]:
    """`part_shape` as a tuple of positive ints, or ValueError naming `part_shape`."""
    try:
        shape = tuple(int(s) for s in part_shape)
    except TypeError as exc:
        raise ValueError(f"part_shape: expected a sequence of ints, got {part_shape!r}") from exc
    if not shape or any(s <= 0 for s in shape):
        raise ValueError(f"part_shape: expected one or more positive sizes, got {part_shape!r}")
    return shape


def check_dim(dim: Any, shape: tuple[int, ...]) -> int:
    """`dim` as an index into `shape` (negative allowed), or ValueError naming `dim`."""
    if isinstance(dim, bool) or not isinstance(dim, int) or not -len(shape) <= dim < len(shape):
        raise ValueError(f"dim: expected an int in [-{len(shape)}, {len(shape)}), got {dim!r}")
    return dim % len(shape)


def check_args(
    part_shape: Sequence[int], num_parts: Any, dtype: Any, device: Any, timeout_s: Any
) -> tuple[tuple[int, ...], torch.device]:
    """Validate the constructor arguments every transport shares; return (shape, device).

    Raises:
        ValueError: naming `part_shape`, `num_parts`, `dtype`, `device` or `timeout_s`.
    """
    shape = check_part_shape(part_shape)
    if isinstance(num_parts, bool) or not isinstance(num_parts, int) or num_parts < 1:
        raise ValueError(f"num_parts: expected a positive int, got {num_parts!r}")
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype: expected a torch.dtype, got {dtype!r}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
        raise ValueError(f"timeout_s: expected a positive number of seconds, got {timeout_s!r}")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device: expected a torch device, got {device!r}") from exc
    return shape, dev


def check_peer(name: str, value: Any, world_size: int) -> None:
    """ValueError naming `name` (src or dst) unless `value` is None or a rank of the group."""
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < world_size
    ):
        raise ValueError(f"{name}: expected a group rank in [0, {world_size}), got {value!r}")


def as_parts(
    parts: Parts,
    num_parts: int,
    part_shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    """`parts` as a list of num_parts contiguous tensors of part_shape, dtype and device.

    Args:
        parts: a sequence of num_parts tensors of part_shape, or one (num_parts, *part_shape)
            tensor (a received slot, say).

    Raises:
        ValueError: naming `parts` (or `parts[k]`) when a count, shape, dtype or device is off.
    """
    if isinstance(parts, torch.Tensor):
        if tuple(parts.shape) != (num_parts, *part_shape):
            raise ValueError(
                f"parts: expected a tensor of shape {(num_parts, *part_shape)} or a sequence of "
                f"{num_parts} tensors of shape {part_shape}, got a tensor of shape "
                f"{tuple(parts.shape)}"
            )
        items = list(parts.unbind(0))
    else:
        items = list(parts)
        if len(items) != num_parts:
            raise ValueError(f"parts: expected {num_parts} tensors, got {len(items)}")
    out = []
    for k, t in enumerate(items):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"parts[{k}]: expected a tensor, got {type(t).__name__}")
        if tuple(t.shape) != part_shape:
            raise ValueError(f"parts[{k}]: expected shape {part_shape}, got {tuple(t.shape)}")
        if t.dtype != dtype:
            raise ValueError(f"parts[{k}]: expected dtype {dtype}, got {t.dtype}")
        if t.device != device:
            raise ValueError(f"parts[{k}]: expected device {device}, got {t.device}")
        # A strided source would make copy_ launch an SM kernel; contiguous ones stay memcpys.
        out.append(t if t.is_contiguous() else t.contiguous())
    return out


@dataclass
class ChannelSteps:
    """The step bookkeeping of a channel; raises RuntimeError on out-of-order use.

    A sequence is send(0), recv(1), send(1), release(1), recv(2), ...: sends go 0, 1, 2, ...;
    receives go 1, 2, 3, ... (recv(1) starts a new sequence once nothing is held); each step is
    received once and released once; with two slots, recv(i) needs step i - 2 released.
    Each check raises before it records anything, so a refused call leaves the state unchanged.
    """

    last_send: int | None = None
    last_recv: int | None = None
    held: set[int] = field(default_factory=set)

    @staticmethod
    def _check_step(i: Any, lowest: int, what: str) -> int:
        if isinstance(i, bool) or not isinstance(i, int):
            raise ValueError(f"i: expected an int step, got {i!r}")
        if i < lowest:
            raise ValueError(f"i: {what} takes steps >= {lowest}, got {i}")
        return i

    def on_send(self, i: Any) -> None:
        i = self._check_step(i, 0, "send")
        if i != 0 and i - 1 != self.last_send:
            raise RuntimeError(
                f"send({i}) out of order: the last send was step {self.last_send}; "
                "steps go 0, 1, 2, ... in every sequence"
            )
        self.last_send = i

    def on_recv(self, i: Any) -> None:
        i = self._check_step(i, 1, "recv (step 0 uses the rank's own data)")
        if i in self.held:
            raise RuntimeError(
                f"recv({i}) twice: step {i} is already received and held; each step is received "
                f"once (keep the tensor recv({i}) returned), then release({i})"
            )
        if i == 1:
            if self.held:
                raise RuntimeError(
                    f"recv(1) starts a new sequence while steps {sorted(self.held)} are still "
                    "held; release them first"
                )
        elif i - 1 != self.last_recv:
            raise RuntimeError(f"recv({i}) out of order: the last recv was step {self.last_recv}")
        if i - 2 in self.held:
            raise RuntimeError(
                f"recv({i}) needs the slot of step {i - 2}, which is still held; "
                f"call release({i - 2}) first"
            )
        self.last_recv = i
        self.held.add(i)

    def on_release(self, i: Any) -> None:
        i = self._check_step(i, 1, "release")
        if i not in self.held:
            raise RuntimeError(
                f"release({i}) without a matching recv({i}); held steps: {sorted(self.held)}"
            )
        self.held.remove(i)


# ----------------------------------------------------------------------------- all-to-all


Region = tuple[tuple[int, int, int], ...]  # ((dim, start, length), ...): narrows of a tensor


def _check_order(name: str, order: Any, world_size: int) -> tuple[tuple[int, ...], ...]:
    """`order` as P tuples of equally many piece indices covering range(P·c) once, or ValueError."""
    if order is None:
        return tuple((p,) for p in range(world_size))
    try:
        rows = tuple(tuple(int(i) for i in row) for row in order)
    except TypeError as exc:
        raise ValueError(f"{name}: expected {world_size} sequences of ints, got {order!r}") from exc
    c = len(rows[0]) if rows else 0
    if len(rows) != world_size or c == 0 or any(len(row) != c for row in rows):
        raise ValueError(
            f"{name}: expected {world_size} sequences (one per rank) of equally many piece "
            f"indices, got {order!r}"
        )
    if sorted(i for row in rows for i in row) != list(range(world_size * c)):
        raise ValueError(
            f"{name}: the piece indices must cover 0 .. {world_size * c - 1} once each, "
            f"got {order!r}"
        )
    return rows


@dataclass(frozen=True)
class AllToAllPlan:
    """Where every piece goes in an all-to-all: the geometry both all-to-all transports share.

    Rank r's input part (part_shape) is cut along `split_dim` into P·cs equal pieces; the pieces
    `split_order[p]` (in that order) are the block rank r sends to rank p. Rank p's output part
    (out_shape: split_dim divided by P, concat_dim multiplied by P) is cut along `concat_dim` into
    P·cc equal pieces; the block from rank r, cut along concat_dim into cc pieces, lands at pieces
    `concat_order[r]`. The defaults (one piece per rank, in rank order) are the plain all-to-all:
    out[p].narrow(concat_dim, r·n, n) == in[r].narrow(split_dim, p·m, m). Orders other than the
    default let a sequence in a sharded layout (zigzag) come out in global order, and back.

    The inverse exchange (the backward) swaps the dims and the orders: `inverse()`.
    """

    part_shape: tuple[int, ...]
    world_size: int
    split_dim: int
    concat_dim: int
    split_order: tuple[tuple[int, ...], ...]
    concat_order: tuple[tuple[int, ...], ...]

    @classmethod
    def build(
        cls,
        part_shape: Sequence[int],
        world_size: int,
        split_dim: Any,
        concat_dim: Any,
        split_order: Any = None,
        concat_order: Any = None,
    ) -> AllToAllPlan:
        """Check the arguments (ValueError naming them) and return the plan."""
        shape = check_part_shape(part_shape)
        split_dim = check_dim(split_dim, shape)
        concat_dim = check_dim(concat_dim, shape)
        if split_dim == concat_dim:
            raise ValueError(
                f"split_dim and concat_dim must differ, both are {split_dim} (part_shape {shape})"
            )
        s_order = _check_order("split_order", split_order, world_size)
        c_order = _check_order("concat_order", concat_order, world_size)
        pieces = world_size * len(s_order[0])
        if shape[split_dim] % pieces:
            raise ValueError(
                f"part_shape[{split_dim}] = {shape[split_dim]} (the split dim) must be divisible "
                f"by {pieces} ({world_size} ranks x {len(s_order[0])} pieces each)"
            )
        if shape[concat_dim] % len(c_order[0]):
            raise ValueError(
                f"part_shape[{concat_dim}] = {shape[concat_dim]} (the concat dim) must be "
                f"divisible by {len(c_order[0])} (pieces per rank in concat_order)"
            )
        return cls(shape, world_size, split_dim, concat_dim, s_order, c_order)

    @property
    def out_shape(self) -> tuple[int, ...]:
        out = list(self.part_shape)
        out[self.split_dim] //= self.world_size
        out[self.concat_dim] *= self.world_size
        return tuple(out)

    @property
    def block_shape(self) -> tuple[int, ...]:
        """The shape of what one rank sends another (part_shape with split_dim divided by P)."""
        out = list(self.part_shape)
        out[self.split_dim] //= self.world_size
        return tuple(out)

    def inverse(self) -> AllToAllPlan:
        """The exchange that undoes this one (and carries its gradient back)."""
        return AllToAllPlan(
            self.out_shape,
            self.world_size,
            self.concat_dim,
            self.split_dim,
            self.concat_order,
            self.split_order,
        )

    def moves(self, src: int, dst: int) -> list[tuple[Region, Region, Region]]:
        """The pieces rank `src` sends rank `dst`: (input region, block region, output region).

        The input region narrows src's input part, the block region the (block_shape) block in
        transit, the output region dst's output part; all three have the same shape.
        """
        cs, cc = len(self.split_order[0]), len(self.concat_order[0])
        m = self.part_shape[self.split_dim] // (self.world_size * cs)
        u = self.part_shape[self.concat_dim] // cc
        out = []
        for js, piece_s in enumerate(self.split_order[dst]):
            for jc, piece_c in enumerate(self.concat_order[src]):
                in_region = ((self.split_dim, piece_s * m, m), (self.concat_dim, jc * u, u))
                block_region = ((self.split_dim, js * m, m), (self.concat_dim, jc * u, u))
                out_region = ((self.split_dim, js * m, m), (self.concat_dim, piece_c * u, u))
                out.append((in_region, block_region, out_region))
        return out


def narrow(t: torch.Tensor, region: Region) -> torch.Tensor:
    """The view of one part `t` that `region` names."""
    for d, start, length in region:
        t = t.narrow(d, start, length)
    return t


class AllToAllCalls:
    """What every all-to-all class shares on top of its own `start` (the transfer issued: work
    the current stream queues after it runs beside it) and `wait` (its output, the current
    stream ordered after it): `exchange`, the differentiable call and the inverse object. One
    exchange of an object in flight at a time. Needs plan, num_parts, dtype, device, group and
    timeout_s."""

    _inverse: Any = None

    def exchange(self, parts: Parts) -> torch.Tensor:
        """The all-to-all of `parts`: a fresh (num_parts, *out_part) tensor (not differentiable),
        ordered before the current stream's next work (`wait(start(parts))`)."""
        return self.wait(self.start(parts))

    def __call__(self, parts: Parts) -> torch.Tensor:
        """`exchange(parts)`, differentiable when grad is enabled and a part requires it."""
        items = list(parts.unbind(0)) if isinstance(parts, torch.Tensor) else list(parts)
        if torch.is_grad_enabled() and any(t.requires_grad for t in items):
            return AllToAllFunction.apply(self, *items)
        return self.exchange(items)

    def inverse(self) -> Any:
        """The all-to-all that undoes this one, built once (collective on the first call)."""
        if self._inverse is None:
            inv = self.plan.inverse()
            self._inverse = type(self)(
                inv.part_shape,
                self.num_parts,
                inv.split_dim,
                inv.concat_dim,
                dtype=self.dtype,
                device=self.device,
                group=self.group,
                split_order=inv.split_order,
                concat_order=inv.concat_order,
                timeout_s=self.timeout_s,
            )
            self._inverse._inverse = self
        return self._inverse


class AllToAllFunction(torch.autograd.Function):
    """An all-to-all as an autograd node: forward `a2a.exchange`, backward the inverse exchange."""

    @staticmethod
    def forward(ctx, a2a: Any, *parts: torch.Tensor) -> torch.Tensor:
        ctx.a2a = a2a
        return a2a.exchange(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (None, *ctx.a2a.inverse().exchange(grad.contiguous()).unbind(0))


# ----------------------------------------------------------------------------- row exchange


def check_sizes(sizes: Any, world_size: int) -> tuple[tuple[int, ...], ...]:
    """`sizes` as a P×P tuple of non-negative element counts (sizes[src][dst], nothing to self),
    or ValueError naming `sizes`."""
    try:
        rows = tuple(tuple(int(n) for n in row) for row in sizes)
    except TypeError as exc:
        raise ValueError(f"sizes: expected {world_size} rows of {world_size} ints") from exc
    square = len(rows) == world_size and all(len(row) == world_size for row in rows)
    if not square or any(n < 0 for row in rows for n in row):
        raise ValueError(
            f"sizes: expected {world_size} rows of {world_size} non-negative ints, got {sizes!r}"
        )
    if any(rows[p][p] for p in range(world_size)):
        raise ValueError("sizes: a rank sends nothing to itself (sizes[p][p] must be 0)")
    return rows


class ExchangeCalls:
    """What both uneven exchanges share: the inverse object (the gradients' way home) and
    `exchange`, a `start` (the transfer issued; work the current stream queues after it runs
    beside it) and its `wait` (the current stream ordered after the transfer; on a CPU, blocking
    up to timeout_s). One exchange of an object in flight at a time. Needs sizes, dtype,
    device, group, timeout_s, start and wait."""

    _inverse: Any = None

    def inverse(self) -> Any:
        """The exchange with every direction reversed, built once (collective on first call)."""
        if self._inverse is None:
            back = tuple(zip(*self.sizes, strict=True))
            self._inverse = type(self)(
                back, dtype=self.dtype, device=self.device, group=self.group,
                timeout_s=self.timeout_s,
            )  # fmt: skip
            self._inverse._inverse = self
        return self._inverse

    def exchange(self, send):
        """The exchange of `send` (flat, `sent(rank)` elements): a fresh flat tensor, ordered
        before the current stream's next work (`wait(start(send))`)."""
        return self.wait(self.start(send))

    def sent(self, rank: int) -> int:
        """Elements rank `rank` sends in one exchange (its send buffer, destinations in order)."""
        return sum(self.sizes[rank])

    def received(self, rank: int) -> int:
        """Elements rank `rank` receives (its output, sources in rank order)."""
        return sum(row[rank] for row in self.sizes)
