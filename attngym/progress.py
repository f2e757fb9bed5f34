"""Progress that reads well wherever the output goes: a terminal, a CI log, a SLURM file, nohup.

* On a terminal (stderr is a TTY) a tqdm bar, redrawn in place; log lines print above it
  (`redirect_logging` routes the console log handlers through tqdm), so the two never mix.
* Redirected, a log line when a phase ends and, while one runs, every `INTERVAL_S` seconds from
  a timer thread, so a long step (a big reference, a slow compile) is never silent: what is
  running, how far it is, the elapsed time and an ETA.

Steps are reported by `update()`, or counted by a function polled as the phase runs (`counted=`:
a sweep whose jobs run on other machines counts the job folders that have finished).

`ATTNGYM_PROGRESS=0` turns both off. Every loop that shows progress goes through `Progress` (or
`progress` for a plain iterable), so the project has one way of reporting it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")

log = logging.getLogger(__name__)

INTERVAL_S = 10.0  # seconds between two lines of a running phase when output is redirected
POLL_S = 2.0  # seconds between two counts of a `counted` phase shown as a bar


def enabled() -> bool:
    """False when `ATTNGYM_PROGRESS=0`: no bar and no progress lines."""
    return os.environ.get("ATTNGYM_PROGRESS", "1").strip() != "0"


def on_terminal() -> bool:
    """True when stderr is a TTY: a bar is drawn; otherwise progress goes to the log."""
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    """A phase of `total` steps that reports its progress (see the module docstring).

    Use as a context manager; call `update()` when a step is done and `running(what)` to say
    what runs now. Lines in redirected output read:
    `sweep jobs: 3/13 done, running attention=natten, 0:00:45 elapsed, ETA 0:02:30`.
    """

    def __init__(
        self,
        total: int | None,
        label: str,
        *,
        interval: float | None = None,
        counted: Callable[[], int] | None = None,
        line_per_step: bool = False,
    ):
        """Args:
        total: the number of steps (None: unknown).
        label: what the phase is called in the bar and the lines.
        interval: seconds between two lines when output is redirected (0: none; None:
            INTERVAL_S).
        counted: returns how many steps are done; polled (every POLL_S on a terminal, before
            each line otherwise, and on `recount()`) instead of counting `update()` calls.
        line_per_step: with output redirected, also a line at each `update()` (steps of
            seconds each, such as topology=auto's candidates).
        """
        if total is not None and (
            isinstance(total, bool) or not isinstance(total, int) or total < 0
        ):
            raise ValueError(f"total must be a non-negative integer or None, got {total!r}")
        interval = INTERVAL_S if interval is None else interval
        self.total, self.label, self.interval = total, label, interval
        self.line_per_step = line_per_step
        self.done = 0
        self.what = ""
        self.noted = ""
        self._counted = counted
        self._start = time.monotonic()
        self._bar = None
        self._stop = threading.Event()
        self._timer: threading.Thread | None = None
        if not enabled():
            return
        if on_terminal():
            from tqdm import tqdm

            self._bar = tqdm(
                total=total, desc=label, file=sys.stderr, leave=False, dynamic_ncols=True
            )
            if counted is not None:
                self._start_timer(POLL_S, log_lines=False)
        elif interval > 0:
            self._start_timer(interval, log_lines=True)

    def line(self) -> str:
        """What a redirected log shows now: done/total, what runs, elapsed and ETA."""
        elapsed = time.monotonic() - self._start
        parts = [f"{self.label}: {self.done}/{self.total if self.total is not None else '?'} done"]
        if self.what and (self.total is None or self.done < self.total):
            parts.append(f"running {self.what}")
        if self.noted:
            parts.append(self.noted)
        parts.append(f"{_clock(elapsed)} elapsed")
        if self.total and 0 < self.done < self.total:
            parts.append(f"ETA {_clock(elapsed / self.done * (self.total - self.done))}")
        return ", ".join(parts)

    def running(self, what: str) -> None:
        """Say what the phase is doing now (shown on the bar and in the next line)."""
        self.what = what
        self._postfix()

    def note(self, text: str) -> None:
        """A fact the phase has found so far (`best so far ...`), shown after what runs."""
        self.noted = text
        self._postfix()

    def _postfix(self) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str("; ".join(t for t in (self.what, self.noted) if t))

    def update(self, steps: int = 1) -> None:
        """`steps` more steps are done."""
        self.done += steps
        if self._bar is not None:
            self._bar.update(steps)
        elif self.line_per_step and enabled():
            log.info("%s", self.line())

    def grow(self, steps: int) -> None:
        """`steps` more steps to do than the total said (work found while working)."""
        if self.total is not None:
            self.total += steps
        if self._bar is not None:
            self._bar.total = self.total
            self._bar.refresh()

    def clear(self) -> None:
        """Erase the bar until its next redraw, so a line printed outside `redirect_logging`
        (Hydra's own launch lines between sweep jobs) starts on a clean line."""
        if self._bar is not None:
            self._bar.clear()

    def recount(self) -> bool:
        """Poll `counted` now (nothing without one; a count that fails leaves the last one);
        with output redirected, a line when the count changed. True when it logged one."""
        if self._counted is None:
            return False
        try:
            done = self._counted()
        except Exception as err:  # counting is for the progress line only
            log.debug("could not count the steps done: %s", err)
            return False
        if done == self.done:
            return False
        self.update(done - self.done)
        if self._bar is None and enabled():
            log.info("%s", self.line())  # redirected: a line per step done
            return True
        return False

    def _start_timer(self, every: float, *, log_lines: bool) -> None:
        def tick() -> None:
            while not self._stop.wait(every):
                if not self.recount() and log_lines:
                    log.info("%s", self.line())

        self._timer = threading.Thread(target=tick, name=f"progress {self.label}", daemon=True)
        self._timer.start()

    def close(self) -> None:
        """End the phase: remove the bar, or log its last line when it ran long enough to have
        reported (a phase shorter than the interval stays quiet)."""
        self._stop.set()
        counted = self.recount()
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif (
            self._timer is not None
            and not counted
            and not (self.line_per_step and self.done)  # its last step said it
            and self._ran_an_interval()
        ):
            log.info("%s", self.line())
        self._timer = None

    def _ran_an_interval(self) -> bool:
        return time.monotonic() - self._start >= self.interval

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def progress(iterable: Iterable[T], *, total: int | None = None, label: str = "") -> Iterator[T]:
    """Yield the items of `iterable` unchanged, reporting them as the steps of a `Progress`.

    Args:
        iterable: what to iterate over.
        total: number of items; defaults to `len(iterable)` when it has one.
        label: what the phase is called in the bar and the lines.

    Raises:
        ValueError: `total` is not a non-negative integer or None.
    """
    if total is not None and (isinstance(total, bool) or not isinstance(total, int) or total < 0):
        raise ValueError(f"total must be a non-negative integer or None, got {total!r}")
    if total is None:
        try:
            total = len(iterable)  # type: ignore[arg-type]
        except TypeError:
            total = None
    return _steps(iterable, total, label)


def _steps(iterable: Iterable[T], total: int | None, label: str) -> Iterator[T]:
    with Progress(total, label) as bar:
        for item in iterable:
            yield item
            bar.update()


@contextlib.contextmanager
def redirect_logging() -> Iterator[None]:
    """On a terminal, print log records above the bars (tqdm's logging redirect); else nothing."""
    if not (enabled() and on_terminal()):
        yield
        return
    from tqdm.contrib.logging import logging_redirect_tqdm

    with logging_redirect_tqdm():
        yield
