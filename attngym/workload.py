"""Workloads: streams of batches of packed documents whose lengths follow a corpus.

Teams that train on packed documents do not run one mask at one shape: every batch packs a new
draw of documents (many short ones, a long tail) into the sequence, and each batch's mask, and
so its cost and its balance over context-parallel ranks, is its own. A workload is that stream:
`batches(...)` draws document lengths from a distribution (or reads them from a file) and packs
them greedily into `seq_len` tokens per batch, the last document of a batch cut to fit (what a
packing data loader does), so that every batch's lengths sum to `seq_len`.

Distributions (`DISTRIBUTIONS`), each seeded:
    fixed       every document `length` tokens;
    uniform     integers from `min_len` to `max_len`;
    lognormal   `median` x exp(N(0, sigma)), rounded, kept within [min_len, max_len]: a corpus of
                many short documents and a long tail;
    zipf        `min_len` x Pareto(`exponent`), the continuous power law Zipf's is the discrete
                form of, within [min_len, max_len];
    file        a text file: one document length a line (drawn in order, the file read again from
                its start when it runs out), or one JSON list of lengths a line (given batches,
                each summing to seq_len, taken in order).

Standard library only; the run layer turns a workload config into these calls
(attngym.runner.tasks).
"""

from __future__ import annotations

import itertools
import json
import math
import random
import statistics
from collections.abc import Iterator, Sequence
from pathlib import Path

DISTRIBUTIONS = ("fixed", "uniform", "lognormal", "zipf", "file")
ROWS_FILE = "batches.csv"  # a workload run's rows, one a batch, in its run folder


class WorkloadError(ValueError):
    """A workload that cannot be made: `key` names the setting (`file`, `batches`, ...)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


def batches(
    distribution: str,
    *,
    count: int,
    seq_len: int,
    seed: int = 0,
    length: int = 2048,
    min_len: int = 64,
    max_len: int | None = None,
    median: int = 2048,
    sigma: float = 1.0,
    exponent: float = 1.5,
    file: str | Path | None = None,
) -> list[tuple[int, ...]]:
    """`count` batches of document lengths, each summing to `seq_len` (see the module docstring).

    Raises:
        WorkloadError: a file that cannot be read, a line that is no length or list of lengths,
            a given batch that does not sum to seq_len, fewer given batches than `count`.
    """
    top = seq_len if max_len is None else max_len
    if distribution == "file":
        if file is None:
            raise WorkloadError("file", "workload.distribution=file needs workload.file")
        given, lengths = _read(Path(file), seq_len)
        if given is not None:
            if len(given) < count:
                raise WorkloadError(
                    "batches", f"{file} gives {len(given)} batches, fewer than {count}"
                )
            return given[:count]
        draw: Iterator[int] = itertools.cycle(lengths)
    else:
        draw = _draws(distribution, random.Random(seed), length, min_len, top, median, sigma,
                      exponent)  # fmt: skip
    return [pack(draw, seq_len) for _ in range(count)]


def pack(lengths: Iterator[int], seq_len: int) -> tuple[int, ...]:
    """One batch: documents taken in order until `seq_len` is full, the last cut to fit."""
    out: list[int] = []
    left = seq_len
    while left:
        n = min(next(lengths), left)
        out.append(n)
        left -= n
    return tuple(out)


def document_ids(lengths: Sequence[int]) -> list[int]:
    """The document of every position: 0 for the first `lengths[0]`, 1 for the next, ..."""
    return [d for d, n in enumerate(lengths) for _ in range(n)]


def summary(lengths: Sequence[int]) -> dict[str, float]:
    """What a batch's row says of its documents: how many, the longest, median and shortest."""
    return {
        "documents": len(lengths),
        "doc_len_max": max(lengths),
        "doc_len_median": statistics.median(lengths),
        "doc_len_min": min(lengths),
    }


def _draws(
    distribution: str, rng: random.Random, length: int, low: int, high: int, median: int,
    sigma: float, exponent: float,
) -> Iterator[int]:  # fmt: skip
    """Document lengths, one after another, forever."""

    def kept(x: float) -> int:
        return max(low, min(high, round(x)))

    while True:
        match distribution:
            case "fixed":
                yield length
            case "uniform":
                yield rng.randint(low, high)
            case "lognormal":
                yield kept(median * math.exp(rng.gauss(0.0, sigma)))
            case "zipf":
                yield kept(low * rng.paretovariate(exponent))
            case _:
                raise WorkloadError(
                    "distribution", f"unknown {distribution!r}; one of {', '.join(DISTRIBUTIONS)}"
                )


def _read(path: Path, seq_len: int) -> tuple[list[tuple[int, ...]] | None, list[int]]:
    """(given batches, None) from a file of JSON lists, or (None, lengths) from one of lengths."""
    try:
        lines = [ln.strip() for ln in path.read_text().splitlines()]
    except (OSError, UnicodeDecodeError) as err:
        raise WorkloadError("file", f"cannot read {path}: {err}") from None
    numbered = [(i + 1, ln) for i, ln in enumerate(lines) if ln and not ln.startswith("#")]
    if not numbered:
        raise WorkloadError("file", f"{path} holds no document lengths")
    given = numbered[0][1].startswith("[")
    out: list = []
    for number, line in numbered:
        where = f"{path}:{number}"
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            value = None
        items = value if given else [value]
        if (
            not isinstance(items, list)
            or not items
            or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in items)
        ):
            want = "a JSON list of positive lengths" if given else "a positive integer length"
            raise WorkloadError("file", f"{where}: {line[:60]!r} is not {want}")
        if given and sum(items) != seq_len:
            raise WorkloadError(
                "file", f"{where}: the lengths sum to {sum(items)}, not shape.seq_len={seq_len}"
            )
        out.append(tuple(items) if given else items[0])
    return (out, []) if given else (None, out)
