"""Code a user names by import path: their mask and score callbacks, context-parallel schemes and
load balancers.

A path is `package.module.name` (as Hydra's `_target_`) or `package.module:name`, resolved from
the working directory and PYTHONPATH, so a `mymasks.py` beside the runs needs no installing.
Importing a path runs the module's code, and calling a factory runs the factory's: what can be
judged first (the names, the signature, the arguments) is judged first, and every failure is
one `ConfigError` line naming the config key. Objects handed over in this process (attngym.run:
a lambda, a closure, a notebook cell's function) are found by path in `objects`; no other
process has them (`lives_in_this_process`).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import os
import sys
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from attngym.errors import CODE_ERRORS, ConfigError, Interrupted, closest, failure_text

# Callables handed over as objects in this process (attngym.run: a lambda, a closure, a function
# of a notebook cell) are found by path in this module; no other process has them.
objects = types.ModuleType(f"{__name__}.objects", "callables handed over in this process")
sys.modules[objects.__name__] = objects


# Packages an import path often names, and how to install them (the gym_* options' attention-gym).
INSTALL = {
    "attn_gym": "pip install attn-gym (in a clone of attngym, make setup installs it)",
}


@contextlib.contextmanager
def working_directory_importable() -> Iterator[None]:
    """The working directory on sys.path while importing: `python -m` puts it there, the
    `attngym` console script does not, and a researcher's mymasks.py lives beside their runs."""
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added:
            with contextlib.suppress(ValueError):
                sys.path.remove(cwd)


def import_module(module: str, path: str, key: str) -> types.ModuleType:
    try:
        with working_directory_importable():
            return importlib.import_module(module)
    except ModuleNotFoundError as err:
        package = (err.name or "").split(".")[0]
        if package in INSTALL:
            install = INSTALL[package]
            raise ConfigError(key, f"{path!r} needs {package}, not installed: {install}") from None
        if err.name is not None and (module == err.name or module.startswith(f"{err.name}.")):
            raise ConfigError(
                key,
                f"{path!r}: no module {err.name!r} (looked in the working directory "
                f"{os.getcwd()} and PYTHONPATH); the path is module.name, e.g. "
                "mymasks.checkerboard for a mymasks.py beside your runs",
            ) from None
        raise ConfigError(key, f"{path!r}: importing {module} failed: {err}") from None
    except Interrupted:
        raise
    except CODE_ERRORS as err:  # the user's module raised while importing (a SyntaxError too)
        raise ConfigError(
            key, f"{path!r}: importing {module} failed: {failure_text(err)}"
        ) from None


def resolve(path: Any, *, key: str) -> Any:
    """The object an import path names: `package.module.name` or `package.module:name`.

    Raises:
        ConfigError(key, ...): not a path, no such module, no such name in it (with the closest
            public name), or the module raised while importing.
    """
    if not isinstance(path, str) or not path.strip() or path.count(":") > 1:
        raise ConfigError(key, f"must be an import path such as mymasks.checkerboard, got {path!r}")
    if ":" in path:
        module_name, _, rest = path.partition(":")
        module, attrs = import_module(module_name, path, key), rest.split(".")
    else:
        parts = path.split(".")
        if len(parts) < 2:
            raise ConfigError(
                key, f"{path!r} names a module only; name its function too: {path}.NAME"
            )
        module, attrs = None, []
        for cut in range(len(parts) - 1, 0, -1):  # the longest prefix that is a module
            name = ".".join(parts[:cut])
            try:
                with working_directory_importable():
                    found = importlib.util.find_spec(name) is not None
            except Interrupted:
                raise
            except CODE_ERRORS:  # a parent that is no module, or raises: _import says which
                found = False
            if found or cut == 1:
                module, attrs = import_module(name, path, key), parts[cut:]
                break
    obj: Any = module
    for i, attr in enumerate(attrs):
        if not hasattr(obj, attr):
            public = [n for n in dir(obj) if not n.startswith("_")]
            hint = closest(attr, public)
            where = ".".join([module.__name__, *attrs[:i]])
            suffix = f"; did you mean {hint!r}?" if hint else ""
            raise ConfigError(key, f"{path!r}: {where} has no {attr!r}{suffix}")
        obj = getattr(obj, attr)
    return obj


def lives_in_this_process(path: Any) -> bool:
    """Whether `path` names an object of `objects`, which a new process (a context-parallel
    rank) cannot import."""
    return isinstance(path, str) and path.startswith(objects.__name__)


# Return annotations that say a factory returns no callback: refused before it is called.
NOT_A_CALLBACK = ("None", "NoneType", "bool", "int", "float", "str", "bytes", "list", "dict")


def check_factory(factory: Any, *, kind: str, path: str, key: str) -> None:
    """ConfigError(key) for what cannot be a factory of a `kind`, judged without calling it: a
    built-in function (os.system) or one whose return annotation names no callable. Calling a
    factory runs its code, as Hydra's `_target_` does: what can be checked is checked first."""
    if inspect.isbuiltin(factory):
        raise ConfigError(
            key, f"{path} is a built-in function, not a {kind} or a factory that returns one"
        )
    try:
        returns = inspect.signature(factory).return_annotation
    except (TypeError, ValueError):
        return
    name = returns if isinstance(returns, str) else getattr(returns, "__name__", str(returns))
    if returns is not inspect.Signature.empty and name in NOT_A_CALLBACK:
        raise ConfigError(
            key, f"{path} returns {name} (its annotation), not a {kind}: name a factory of one"
        )


def call_factory(
    factory: Callable[..., Any], args: Mapping[str, Any], *, path: str, key: str, device: Any
) -> Any:
    """factory(**args), its arguments checked against its signature first (and `device` passed
    when it takes one and the config does not set it)."""
    params = inspect.signature(factory).parameters
    named = {n: p for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    open_keywords = any(p.kind == p.VAR_KEYWORD for p in params.values())
    for arg in args:
        if arg not in named and not open_keywords:
            hint = closest(arg, named)
            suffix = f" (did you mean {hint!r}?)" if hint else ""
            allowed = ", ".join(named) or "none"
            raise ConfigError(
                f"{key}.{arg}",
                f"{path} takes no argument {arg!r}; its arguments: {allowed}{suffix}",
            )
    call = dict(args)
    if "device" in named and "device" not in call:
        call["device"] = device
    for name, p in named.items():
        if p.default is p.empty and name not in call and p.kind != p.POSITIONAL_ONLY:
            raise ConfigError(
                f"{key}.{name}", f"{path} needs argument {name!r}: set {key}.{name}=..."
            )
    try:
        return factory(**call)
    except Interrupted:
        raise
    except CODE_ERRORS as err:  # the user's factory refused its arguments
        shown = ", ".join(f"{k}={v!r}" for k, v in call.items())
        raise ConfigError(key, f"{path}({shown}) raised {failure_text(err)}") from None
