"""What a context-parallel call holds while it adds up: the lse merge of its partials, its sums.

Beside merge.py, whose functions they run: merge.py is the one merge of partials, this module
holds a rank's pieces as the kernels returned them until enough have come to merge (or add) in
one pass, which is what keeps a ring step's own cost after its kernel small:

    Accumulator  the lse merge of a rank's output: partials held as the kernels gave them and
                 merged in one pass (compiled on CUDA); a q chunk that meets one pair keeps the
                 kernel's partial as is (nothing filled or merged)
    GradSum      the sum of a gradient's pieces, held and added in one pass: a single piece is
                 handed back as is, float32 only where two pieces meet
"""

from __future__ import annotations

import copy
import dataclasses
from typing import TYPE_CHECKING

import torch

from attngym.distributed.call.merge import compiled_sums, merged_weights, weighted_sum

if TYPE_CHECKING:
    from attngym.distributed.call.cp import CPCall


# Pieces of one sum held before they are added. A step's partial (or gradient piece) is kept as
# the kernel returned it, and up to HELD of them are added in one pass that reads each once and
# writes the sum once (Accumulator, GradSum). Added as each came, every piece cost a read and a
# write of the float32 sum, the largest cost of a ring step's own after its kernel. With 8, a
# ring of 8 ranks sums its steps in one pass. Memory: at most 8 pieces of a sum are held (the
# first may be the float32 sum of earlier ones).
HELD = 8


class Accumulator:
    """The lse merge of the partials (out, lse) of this rank's q chunks, one entry per chunk.

    Partials are held as the kernels returned them and merged in one pass (merge.merged_weights
    and merge.weighted_sum, compiled when `fused`: CUDA, compiled calls): at `result` straight
    into q's dtype, or, when a chunk holds HELD and one more comes, into one float32 (float64)
    partial that takes their place. A chunk that meets a single pair (every chunk at world size
    1, a local mask's far chunks) gets its partial back unchanged: nothing allocated or merged.
    """

    def __init__(self, q: torch.Tensor, dv: int, *, fused: bool = False):
        self.dtype, self.device = q.dtype, q.device
        self.acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        self.shape = (*q.shape[:3], dv)
        self._weights, self._sum = compiled_sums() if fused else (merged_weights, weighted_sum)
        self._chunks: dict[tuple[int, int], list] = {}  # (start, stop) -> [(out, lse), ...]

    @classmethod
    def of(cls, call: CPCall, q: torch.Tensor, dv: int) -> Accumulator:
        """The accumulator of a call: fused where the call compiles its kernels on CUDA."""
        return cls(q, dv, fused=call.options.compile and q.device.type == "cuda")

    def add(self, rows: slice, out_i: torch.Tensor, lse_i: torch.Tensor) -> None:
        """Hold one pair's partial over q rows `rows` (a chunk of the shard); out_i and lse_i
        are the kernel's own new tensors."""
        held = self._chunks.setdefault((rows.start, rows.stop), [])
        if len(held) == HELD:
            held[:] = [self._merged(held, self.acc_dtype)]
        held.append((out_i, lse_i))

    def fork(self) -> Accumulator:
        """A copy holding the same partials (shared, never written): the simulation times one
        step's add from the state the steps before it leave."""
        twin = copy.copy(self)
        twin._chunks = {key: list(held) for key, held in self._chunks.items()}
        return twin

    def held(self) -> tuple[tuple[int, int, int], ...]:
        """(start, stop, partials held) of each chunk: what the next add or result costs."""
        return tuple((a, b, len(held)) for (a, b), held in sorted(self._chunks.items()))

    def _merged(self, held: list, dtype: torch.dtype):
        """(out in `dtype`, lse) of the partials `held`."""
        if len(held) == 1:
            out, lse = held[0]
            return _to(self._sum, out, dtype), lse.to(self.acc_dtype)
        lse, ws = self._weights([lse.to(self.acc_dtype) for _, lse in held])
        return self._sum([out for out, _ in held], ws, self.acc_dtype, dtype), lse

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(out in q's dtype, lse in the accumulator dtype) over the whole shard; rows no pair
        reached are out = 0, lse = -inf. Consumes the accumulator."""
        n = self.shape[2]
        chunks, self._chunks = self._chunks, {}  # consumed: each chunk let go once written
        if list(chunks) == [(0, n)]:
            return self._merged(chunks.pop((0, n)), self.dtype)
        out = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        lse = torch.empty(self.shape[:3], dtype=self.acc_dtype, device=self.device)
        covered = 0
        for start, stop in sorted(chunks):
            if start > covered:
                _no_key(out, lse, covered, start)
            out_c, lse_c = self._merged(chunks.pop((start, stop)), self.dtype)
            out[:, :, start:stop].copy_(out_c)
            lse[:, :, start:stop].copy_(lse_c)
            del out_c, lse_c
            covered = stop
        if covered < n:
            _no_key(out, lse, covered, n)
        return out, lse


def _no_key(out: torch.Tensor, lse: torch.Tensor, start: int, stop: int) -> None:
    out[:, :, start:stop].zero_()
    lse[:, :, start:stop].fill_(float("-inf"))


@dataclasses.dataclass
class _Rows:
    """One row range of a GradSum: the pieces over it, held until they are added."""

    start: int
    stop: int
    pieces: list[torch.Tensor]  # each (..., stop - start, D), ours to write; [0] may be a sum
    root: torch.Tensor | None  # pieces[0] is rows start.. of this whole kernel output

    def narrow(self, start: int, stop: int) -> _Rows:
        pieces = [p.narrow(-2, start - self.start, stop - start) for p in self.pieces]
        return _Rows(start, stop, pieces, self.root)


class GradSum:
    """The sum of gradient pieces over the rows of one (..., n, D) tensor, built as they come.

    A rank's dq, and each shard's dK/dV, get one piece per chunk pair: often a single one (every
    piece at world size 1), often over a band of the rows (a halo). A zero-filled float32
    accumulator of full size, added into and cast back, costs about as much as the kernel on a
    thin band, so instead each row range holds its pieces as the kernels returned them, and
    adds them in one pass in `sum_dtype` (float32, float64 for float64 inputs; in order, so the
    totals are those of that accumulator): at `total` straight into the result's dtype, or into
    one sum_dtype piece when HELD are held and one more comes. Ranges never overlap: a piece
    that cuts a range splits it (views, no copy). `total` writes each range once into the
    result: in place into a kernel output that covers every row when there is one, and hands a
    single whole piece back unchanged.

    Pieces marked fresh are a kernel's own new outputs, which the sum may keep and write into;
    others (a channel's receive slot, valid until released) are added at once and never kept.
    `fused` (CUDA, compiled calls): the sums run compiled (merge.compiled_sums).
    """

    def __init__(self, shape, sum_dtype: torch.dtype, device, fused: bool = False):
        self.shape = tuple(shape)
        self.sum_dtype, self.device = sum_dtype, device
        self._sum = compiled_sums()[1] if fused else weighted_sum
        self._ranges: list[_Rows] = []  # disjoint, by start

    @classmethod
    def of(cls, call: CPCall, shape, sum_dtype: torch.dtype, device) -> GradSum:
        """The sum of a call's gradient: fused where the call compiles its kernels on CUDA."""
        fused = call.options.compile and torch.device(device).type == "cuda"
        return cls(shape, sum_dtype, device, fused=fused)

    def add(
        self, start: int, piece: torch.Tensor, *, fresh: bool = True, last: bool = False
    ) -> None:
        """Add `piece` (..., m, D) into rows [start, start + m).

        last: no piece follows over these rows, and `total` will be asked for in the dtype of
            the kernel outputs kept there: those take the sum rounded to their dtype at once
            (what total would write), with no sum_dtype copy of the rows held.
        """
        stop = start + piece.shape[-2]
        assert 0 <= start <= stop <= self.shape[-2], (start, stop, self.shape)
        self._split(start)
        self._split(stop)
        kept, pos = [], start
        for r in self._ranges:
            if r.stop <= start or r.start >= stop:
                continue
            if r.start > pos:
                kept.append(self._new(pos, r.start, piece, start, fresh))
            self._plus(r, piece.narrow(-2, r.start - start, r.stop - r.start), fresh, last)
            pos = r.stop
        if pos < stop:
            kept.append(self._new(pos, stop, piece, start, fresh))
        if kept:
            self._ranges = sorted(self._ranges + kept, key=lambda r: r.start)

    def fork(self) -> GradSum:
        """A copy holding the same pieces (shared): the simulation times one step's pieces
        from the state the steps before it leave."""
        twin = copy.copy(self)
        twin._ranges = [dataclasses.replace(r, pieces=list(r.pieces)) for r in self._ranges]
        return twin

    def held(self) -> tuple[tuple[int, int, int], ...]:
        """(start, stop, pieces held) of each row range: what the next add or total costs."""
        return tuple((r.start, r.stop, len(r.pieces)) for r in self._ranges)

    def _split(self, at: int) -> None:
        for j, r in enumerate(self._ranges):
            if r.start < at < r.stop:
                self._ranges[j : j + 1] = [r.narrow(r.start, at), r.narrow(at, r.stop)]
                return

    def _new(self, a: int, b: int, piece: torch.Tensor, start: int, fresh: bool) -> _Rows:
        value = piece if b - a == piece.shape[-2] else piece.narrow(-2, a - start, b - a)
        if not fresh:  # not ours to keep: a copy, in the sum dtype
            return _Rows(a, b, [value.to(self.sum_dtype, copy=True)], None)
        whole = start == 0 and tuple(piece.shape) == self.shape
        return _Rows(a, b, [value], piece if whole else None)

    def _plus(self, r: _Rows, piece: torch.Tensor, fresh: bool, last: bool) -> None:
        if last:  # the exact sum, rounded once, into the rows kept
            first = r.pieces[0]
            self._sum([*r.pieces, piece], None, self.sum_dtype, first.dtype, first)
            r.pieces = [first]
        elif fresh:  # held, added with the others later
            if len(r.pieces) == HELD:
                r.pieces, r.root = [self._sum(r.pieces, None, self.sum_dtype, self.sum_dtype)], None
            r.pieces.append(piece)
        else:  # read now: the slot it lies in is released after this
            pieces = [*r.pieces, piece]
            r.pieces, r.root = [self._sum(pieces, None, self.sum_dtype, self.sum_dtype)], None

    def total(self, dtype: torch.dtype) -> torch.Tensor:
        """The sum over every row in `dtype` (0 on rows no piece reached). It consumes the sum:
        each range is let go once written, so its pieces do not outlive it."""
        n = self.shape[-2]
        ranges, self._ranges = self._ranges, []
        if len(ranges) == 1 and (ranges[0].start, ranges[0].stop) == (0, n):
            pieces = ranges.pop().pieces
            if len(pieces) == 1:
                return _to(self._sum, pieces[0], dtype)
            return self._sum(pieces, None, self.sum_dtype, dtype)
        roots = [r.root for r in ranges if r.root is not None and r.root.dtype == dtype]
        out = roots[0] if roots else torch.empty(self.shape, dtype=dtype, device=self.device)
        del roots
        covered = 0
        while ranges:
            r = ranges.pop(0)
            if r.start > covered:
                out.narrow(-2, covered, r.start - covered).zero_()
            if r.root is not out or len(r.pieces) > 1:  # else already in place
                # Summed apart, then copied: `out` may be a kernel output these pieces view,
                # and a compiled call given two views of one storage (the output rows and a
                # piece) raises in Inductor's CPU code.
                summed = r.pieces[0] if len(r.pieces) == 1 else self._sum(
                    r.pieces, None, self.sum_dtype, dtype
                )  # fmt: skip
                out.narrow(-2, r.start, r.stop - r.start).copy_(summed)
                del summed
            covered = r.stop
            del r
        if covered < n:
            out.narrow(-2, covered, n - covered).zero_()
        return out


def _to(sum_fn, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in `dtype` through `sum_fn` (merge.weighted_sum, eager or compiled), x itself when it
    is already."""
    return x if x.dtype == dtype else sum_fn([x], None, dtype, dtype)
