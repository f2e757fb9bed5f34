"""The project's error types, in one place.

`ConfigError` is what a user sees for a bad configuration value: it is a `ValueError` (so library
callers can catch it as one) that carries the dotted key, the value received and what is allowed.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

# Words users type for a choice spelled otherwise: spelling alone would suggest gpu -> cpu.
SYNONYMS = {"gpu": "cuda"}


def closest(name: str, choices: Iterable[str]) -> str | None:
    """The choice `name` most likely means (a synonym, else the closest spelling), or None
    when nothing is close."""
    choices = list(choices)
    if SYNONYMS.get(str(name).lower()) in choices:
        return SYNONYMS[str(name).lower()]
    matches = difflib.get_close_matches(str(name), choices, n=1, cutoff=0.5)
    return matches[0] if matches else None


def choice_error(what: str, value: Any, choices: Iterable[str]) -> str:
    """`unknown <what> 'x'; choose one of: a, b, c (did you mean 'b'?)`."""
    choices = sorted(choices)
    hint = closest(str(value), choices)
    suffix = f" (did you mean {hint!r}?)" if hint else ""
    return f"unknown {what} {value!r}; choose one of: {', '.join(choices)}{suffix}"


class ConfigError(ValueError):
    """A configuration value that cannot run, named by its dotted key."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"{key}: {message}")


class UserCodeError(RuntimeError):
    """The user's code the config names (a callback, scheme or balancer) raised during the run,
    past the checks before it: one line naming the config key and the user's file and line; the
    original error is its cause (HYDRA_FULL_ERROR=1 shows its traceback)."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"{key}: {message}")


class RankFailure(RuntimeError):
    """A rank of a distributed run died or timed out; raised on the ranks that outlive it."""


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived: the run stops, keeping what it measured (exit 128 + signal).

    A KeyboardInterrupt, so code that cleans up after Ctrl-C cleans up after SIGTERM alike.
    """

    def __init__(self, signum: int):
        import signal

        self.signum = signum
        self.exit_code = 128 + signum
        super().__init__(f"interrupted by {signal.Signals(signum).name}")


# What a run's code can raise: every Exception, and what code raises to end the process, which
# inside a run ends only the run (a sys.exit or argparse in a user's module, a KeyboardInterrupt
# or GeneratorExit raised by a callback). Catch it after `except Interrupted: raise`: a real
# Ctrl-C or SIGTERM (Interrupted) stops the run or sweep instead.
CODE_ERRORS = (Exception, SystemExit, KeyboardInterrupt, GeneratorExit)


def failure_text(err: BaseException) -> str:
    """`<Type>: <message>`, one line, for an error of a run's code; SystemExit and its kin say
    that code must not end the process."""
    text = f"{type(err).__name__}: {err}"
    if isinstance(err, SystemExit):
        return f"{text} (the run's code called sys.exit, or argparse at import; it must raise)"
    if not isinstance(err, Exception):
        return f"{text} (raised by the run's code; only a real Ctrl-C or SIGTERM stops a run)"
    return text
