"""Argument checks and step bookkeeping shared by every transport (copy engine and P2P).

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
