"""A one-line progress bar on stderr, for timing repeats and sweep jobs.

Neither tqdm nor rich is a dependency of attngym, so this small bar is written once, here, and every
loop that wants to show progress goes through `progress`. It draws only for a person watching: when
stderr is a terminal and the environment variable `ATTNGYM_PROGRESS` is not `0`. Logs, CI and
redirected runs stay clean (the bar is silent there and the iterable passes through untouched).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")

_WIDTH = 20  # characters between the brackets


def enabled() -> bool:
    """True when a bar would be drawn: stderr is a TTY and `ATTNGYM_PROGRESS` is not `0`."""
    if os.environ.get("ATTNGYM_PROGRESS", "1").strip() == "0":
        return False
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


def render(done: int, total: int | None, label: str = "") -> str:
    """The bar's text: `label [######              ] 3/10`, or `label 3` when total is unknown."""
    prefix = f"{label} " if label else ""
    if not total:
        return f"{prefix}{done}"
    filled = min(_WIDTH, _WIDTH * done // total)
    return f"{prefix}[{'#' * filled}{' ' * (_WIDTH - filled)}] {done}/{total}"


def progress(iterable: Iterable[T], *, total: int | None = None, label: str = "") -> Iterator[T]:
    """Yield the items of `iterable`, redrawing a bar on stderr after each one.

    Args:
        iterable: what to iterate over.
        total: number of items; defaults to `len(iterable)` when it has one.
        label: text in front of the bar.

    Returns:
        An iterator over the items of `iterable`, unchanged.

    Raises:
        ValueError: `total` is not a non-negative integer or None.
    """
    if total is not None and (isinstance(total, bool) or not isinstance(total, int) or total < 0):
        raise ValueError(f"total must be a non-negative integer or None, got {total!r}")
    if not enabled():
        return iter(iterable)
    if total is None:
        try:
            total = len(iterable)  # type: ignore[arg-type]
        except TypeError:
            total = None
    return _draw(iterable, total, label)


def _draw(iterable: Iterable[T], total: int | None, label: str) -> Iterator[T]:
    stream = sys.stderr
    done = 0
    stream.write("\r" + render(done, total, label))
    stream.flush()
    try:
        for item in iterable:
            yield item
            done += 1
            stream.write("\r" + render(done, total, label))
            stream.flush()
    finally:
        stream.write("\n")
        stream.flush()
