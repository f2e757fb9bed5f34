"""`attngym.run(...)`: the command line's experiment from a notebook, in one call.

    import attngym
    metrics = attngym.run(mask_mod=checkerboard, overrides=["shape.seq_len=2048"])
    metrics = attngym.run(mask_mod="attn_gym.masks.generate_sliding_window",
                          mask_args={"window_size": 64}, overrides=["topology=ring"])

It runs exactly what `attngym [overrides]` runs (the same composition, checks, task, validation,
baselines, pictures, metrics.json and tracker, through `attngym.runner.cli.entry`) in this process,
and returns the run's metrics.json as a dict, so a notebook needs no Hydra of its own.

Callables given as objects reach the run by an import path: a function defined at the top of an
importable module by its own (`mymasks:checkerboard`), anything else (a lambda, a closure a
factory returned, a function of a notebook cell) through a module this process keeps,
`attngym.user_code.objects`. Context-parallel ranks start as new processes and rebuild the
variant by its import path, so there only the first kind can travel: the CP task refuses the
others before it starts a rank, naming the key and what to do instead.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import io
import os
import signal
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from attngym import user_code
from attngym.errors import ConfigError

# The module through which in-process objects are found by path (attngym.user_code).
objects = user_code.objects


def _own_path(fn: Any) -> str | None:
    """`module:qualname` when fn is found there again in a new process, else None."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or "<" in qualname or module == objects.__name__:
        return None
    main = sys.modules.get("__main__")
    if module == "__main__" and not getattr(main, "__file__", None):
        return None  # a notebook's or a REPL's: no file a new process could import
    with contextlib.suppress(Exception):
        found = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
        if found is fn:
            return f"{module}:{qualname}"
    return None


def _path_of(fn: Any, kind: str) -> str:
    """The import path the config gets for `fn` (a path string passes as it is)."""
    if isinstance(fn, str):
        return fn
    if not callable(fn):
        key = "topology.scheme" if kind == "scheme" else f"attention.{kind}"
        raise ConfigError(key, f"must be a callable or an import path, got {type(fn).__name__}")
    own = _own_path(fn)
    if own is not None:
        return own
    name = f"{kind}_{len(vars(objects))}"
    setattr(objects, name, fn)
    return f"{objects.__name__}:{name}"


def _value(value: Any) -> str:
    """A Python value as a Hydra override value."""
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k}:{_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, Sequence):
        return "[" + ",".join(_value(v) for v in value) + "]"
    return repr(value)


@contextlib.contextmanager
def _as_the_command_line() -> Iterator[None]:
    """sys.argv and the SIGINT/SIGTERM handlers the command line sets, restored afterwards."""
    argv = list(sys.argv)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        sys.argv = argv
        for signum, handler in handlers.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def _silenced() -> Iterator[None]:
    """stdout and stderr to /dev/null, Python's and the file descriptors' (the ranks and W&B's
    child write to those), restored afterwards."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(fd) for fd in (1, 2)]
    sink = _Discard()  # never closed: a log handler made meanwhile may keep it
    with open(os.devnull, "w") as null:
        try:
            for fd in (1, 2):
                os.dup2(null.fileno(), fd)
            with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
                yield
        finally:
            for fd, kept in zip((1, 2), saved, strict=True):
                os.dup2(kept, fd)
                os.close(kept)


class _Discard(io.TextIOBase):
    """A text stream that keeps nothing."""

    def write(self, text: str) -> int:
        return len(text)


def run(
    *,
    mask_mod: Callable[..., Any] | str | None = None,
    score_mod: Callable[..., Any] | str | None = None,
    mask_args: Mapping[str, Any] | None = None,
    score_args: Mapping[str, Any] | None = None,
    variant: Any = None,
    scheme: Callable[..., Any] | str | None = None,
    scheme_args: Mapping[str, Any] | None = None,
    overrides: Sequence[str] = (),
    run_dir: str | os.PathLike[str] | None = None,
    quiet: bool = False,
) -> dict[str, Any]:
    """Run one experiment as `attngym [overrides]` does; return its metrics.

    Args:
        mask_mod, score_mod: your callbacks (or factories, with mask_args / score_args), as
            objects or import paths (`attention=custom`); None leaves `attention` to the
            overrides (a catalogue variant).
        mask_args, score_args: a factory's arguments.
        variant: an attngym Variant instead of the callbacks (its buffers move to the run's
            device); its name labels the run.
        scheme, scheme_args: your context-parallel scheme (or its factory, with its arguments)
            as an object or an import path: `topology=custom` (attngym.distributed.schemes.custom).
        overrides: the command line's override strings, e.g. ["shape.seq_len=4096",
            "topology=ring"]; a sweep (-m) is the command line's.
        run_dir: the run folder; default outputs/<date>/<time-microseconds>-<pid>, as on the
            command line.
        quiet: print nothing (the log lines, the progress, the results table; its ranks' and
            W&B's children too): the run's attngym.log and metrics.json keep it all.

    Returns:
        The run's metrics.json as a dict: status ok, or failed with its error (a failed
        validation keeps every number).

    Raises:
        ConfigError: a bad config value or callback, before any tensor work (the command line's
            exit code 2).
        KeyboardInterrupt: the run was interrupted (what it measured is in its metrics.json).
    """
    from attngym.runner.cli import entry
    from attngym.runner.overrides import run_id
    from attngym.runner.tracking import read_metrics

    overrides = [str(o) for o in overrides]
    if any(o in ("-m", "--multirun") for o in overrides):
        raise ConfigError("overrides", "attngym.run runs one experiment; sweep with attngym -m")
    extra: list[str] = []
    if variant is not None:
        if mask_mod is not None or score_mod is not None:
            raise ConfigError("variant", "give a variant or mask_mod/score_mod, not both")
        if variant.mask_mod is not None:
            mask_mod = _factory(variant, "mask_mod")
        if variant.score_mod is not None:
            score_mod = _factory(variant, "score_mod")
        extra.append(f"attention.label={_value(variant.name)}")
    if mask_mod is not None or score_mod is not None:
        extra.insert(0, "attention=custom")
        for kind, fn, args in (("mask", mask_mod, mask_args), ("score", score_mod, score_args)):
            if fn is not None:
                extra.append(f"attention.{kind}_mod={_value(_path_of(fn, f'{kind}_mod'))}")
            for key, value in (args or {}).items():
                extra.append(f"attention.{kind}_args.{key}={_value(value)}")
    if scheme is not None:
        extra += ["topology=custom", f"topology.scheme={_value(_path_of(scheme, 'scheme'))}"]
        for key, value in (scheme_args or {}).items():
            extra.append(f"topology.scheme_args.{key}={_value(value)}")
    if run_dir is None:  # the command line's default (conf/hydra/default.yaml's run.dir)
        run_dir = Path("outputs", f"{datetime.date.today():%Y-%m-%d}", run_id())
    run_dir = Path(run_dir)
    argv = [*extra, *overrides, f"hydra.run.dir={_value(str(run_dir))}"]
    code: Any = 0
    with _as_the_command_line(), _silenced() if quiet else contextlib.nullcontext():
        try:
            entry(argv)
        except SystemExit as stop:
            code = stop.code
    metrics = read_metrics(run_dir)
    if code == 2 or (metrics is None and code):
        error = (metrics or {}).get("error") or f"attngym exited {code}"
        key, _, message = str(error).partition(": ")
        raise ConfigError(key, message or error)
    if code in (130, 143):
        raise KeyboardInterrupt(f"interrupted; what was measured is in {run_dir}")
    if metrics is None:
        raise RuntimeError(f"the run wrote no metrics.json in {run_dir} (exit {code})")
    return {**metrics, "run_dir": str(run_dir)}


def _factory(variant: Any, kind: str) -> Callable[..., Any]:
    """A factory of variant's `kind` callback on a device: its buffers move with it."""

    def on_device(device: Any = "cpu") -> Callable[..., Any]:
        return getattr(variant.to(device), kind)

    on_device.__name__ = str(variant.name)
    return on_device
