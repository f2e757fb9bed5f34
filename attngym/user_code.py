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
import hashlib
import importlib
import importlib.util
import inspect
import os
import re
import sys
import sysconfig
import traceback
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from attngym.errors import (
    CODE_ERRORS,
    ConfigError,
    Interrupted,
    UserCodeError,
    closest,
    failure_text,
)

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
        raise ConfigError(key, f"{path!r}: importing {module} failed: {raised(err)}") from err
    except Interrupted:
        raise
    except CODE_ERRORS as err:  # the user's module raised while importing (a SyntaxError too)
        raise ConfigError(key, f"{path!r}: importing {module} failed: {raised(err)}") from err


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


def factory_call(
    factory: Callable[..., Any], args: Mapping[str, Any], *, path: str, key: str, device: Any
) -> dict[str, Any]:
    """The keywords `factory` is called with: `args`, checked against its signature (a name it
    does not take, a required one left out: ConfigError naming `key.<name>`), and `device` when
    it takes one and the config does not set it."""
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
    return call


def described_call(factory: Callable[..., Any], call: Mapping[str, Any]) -> str:
    """`name(a=1, b=2)`: the call `factory(**call)` with the defaults it fills in, as the run's
    log and metrics.json say how a factory was called."""
    arguments: Mapping[str, Any] = call
    with contextlib.suppress(TypeError, ValueError):
        bound = inspect.signature(factory).bind_partial(**call)
        bound.apply_defaults()
        arguments = bound.arguments
    name = getattr(factory, "__name__", type(factory).__name__)
    return f"{name}({', '.join(f'{k}={v!r}' for k, v in arguments.items())})"


def call_factory(
    factory: Callable[..., Any], args: Mapping[str, Any], *, path: str, key: str, device: Any
) -> Any:
    """factory(**args), its arguments checked against its signature first (factory_call)."""
    call = factory_call(factory, args, path=path, key=key, device=device)
    try:
        return factory(**call)
    except Interrupted:
        raise
    except CODE_ERRORS as err:  # the user's factory refused its arguments
        shown = ", ".join(f"{k}={v!r}" for k, v in call.items())
        raise ConfigError(key, f"{path}({shown}) raised {raised(err)}") from err


# --------------------------------------------------------------------------------------------
# Where in the user's code an error was raised


def _library_folders() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(folders of code that is never the user's: attngym, torch, Python's own; folders of
    installed packages, the user's only when nothing nearer is)."""
    own = [os.path.dirname(os.path.abspath(__file__))]  # attngym/, not the clone around it
    torch = sys.modules.get("torch")
    if torch is not None and getattr(torch, "__file__", None):
        own.append(os.path.dirname(os.path.abspath(torch.__file__)))
    paths = sysconfig.get_paths()
    own += [paths[name] for name in ("stdlib", "platstdlib") if name in paths]
    installed = [paths[name] for name in ("purelib", "platlib") if name in paths]
    return tuple(os.path.join(d, "") for d in own), tuple(os.path.join(d, "") for d in installed)


# Dynamo's errors name the traced user frame in their text, not in the traceback.
_QUOTED_FRAME = re.compile(r'File "([^"]+)", line (\d+), in ([^\s]+)')


def user_frame(err: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of `err` in the user's code: not attngym's, torch's or Python's own,
    and in an installed package only when no file of the user's own is on the way (attention-gym
    is the user's code when its mask raises; numpy called by the user's mask is not). Dynamo
    names a traced frame only in its message (`from user code: File "...", line N`); None
    when no frame is the user's."""
    if isinstance(err, SyntaxError) and err.filename and err.lineno:
        return traceback.FrameSummary(err.filename, err.lineno, "<module>")
    never, installed = _library_folders()
    frames = [
        f
        for f in traceback.extract_tb(err.__traceback__)
        if not f.filename.startswith("<") and not os.path.abspath(f.filename).startswith(never)
    ]
    quoted = [
        traceback.FrameSummary(name, int(line), func)
        for name, line, func in _QUOTED_FRAME.findall(str(err))
        if not os.path.abspath(name).startswith(never)
    ]
    frames += quoted
    own = [f for f in frames if not os.path.abspath(f.filename).startswith(installed)]
    found = own or frames
    return found[-1] if found else None


def shown_path(filename: str) -> str:
    """A file as the user reads it: relative to the working directory when inside it."""
    path = os.path.abspath(filename)
    cwd = os.path.join(os.getcwd(), "")
    return path[len(cwd) :] if path.startswith(cwd) else path


def location(err: BaseException) -> str:
    """`mymasks.py:19 (in vm)`: where the user's code raised `err`, or "" where none of its
    frames is the user's."""
    frame = user_frame(err)
    if frame is None:
        return ""
    return f"{shown_path(frame.filename)}:{frame.lineno} (in {frame.name})"


def raised(err: BaseException) -> str:
    """failure_text(err)'s first line and where the user's code raised it: `RuntimeError: boom,
    at mymasks.py:19 (in vm)` (a SyntaxError's text says where already); the whole error and
    its traceback are the ConfigError's cause (HYDRA_FULL_ERROR=1 shows them)."""
    text = next((line for line in failure_text(err).splitlines() if line.strip()), "")
    where = "" if isinstance(err, SyntaxError) else location(err)
    return f"{text}, at {where}" if where else text


# --------------------------------------------------------------------------------------------
# The code a job ran: what a resumed sweep compares


def _module_names(path: str) -> list[str]:
    """The modules of an import path that are loaded: the one it names, then the one its object
    was defined in (a closure's factory's, attention-gym's submodule), attngym's own left out
    (its version stands for them)."""
    head = path.partition(":")[0] if ":" in path else path.rsplit(".", 1)[0]
    parts = head.split(".")
    named = next(
        (
            ".".join(parts[:i])
            for i in range(len(parts), 0, -1)
            if ".".join(parts[:i]) in sys.modules
        ),
        None,
    )
    names = [named] if named else []
    with contextlib.suppress(ConfigError):
        defined = getattr(resolve(path, key="code"), "__module__", None)
        if isinstance(defined, str) and defined not in names:
            names.append(defined)
    return [n for n in names if n != "attngym" and not n.startswith(("attngym.", objects.__name__))]


def _sha256(file: str) -> str | None:
    try:
        with open(file, "rb") as source:
            return hashlib.sha256(source.read()).hexdigest()
    except OSError:
        return None


def _attngym_version() -> str:
    """attngym.__version__, read from the package already loaded (it is, before any of its
    modules): importing it from here would make an import cycle."""
    return sys.modules["attngym"].__version__


def record(paths: Iterable[str]) -> dict[str, Any]:
    """What a job's metrics.json records of the code it ran: attngym's version, and the source
    file and its sha256 of every module the import paths `paths` name or define their objects
    in (masks, score mods, schemes, balancers; already imported by the run's checks), and one
    fingerprint of all of it; `changed` compares a record with the files as they are now."""
    version = _attngym_version()
    sources: dict[str, dict[str, str]] = {}
    for path in paths:
        for name in _module_names(path):
            file = getattr(sys.modules.get(name), "__file__", None)
            digest = _sha256(file) if isinstance(file, str) else None
            if digest is not None:
                sources[name] = {"file": os.path.abspath(file), "sha256": digest}
    whole = hashlib.sha256(version.encode())
    for name in sorted(sources):
        whole.update(f"\0{name}\0{sources[name]['sha256']}".encode())
    return {
        "attngym_version": version,
        "code_sources": sources,
        "code_fingerprint": whole.hexdigest()[:12],
    }


def changed(recorded: Mapping[str, Any]) -> str | None:
    """Why the code a job ran (its metrics.json's `record`) is not the code here now: another
    attngym version, a source file edited or gone; None when it is the same."""
    version, now = recorded.get("attngym_version"), _attngym_version()
    sources = recorded.get("code_sources")
    if not isinstance(version, str) or not isinstance(sources, Mapping):
        return "its metrics.json records no code fingerprint (an earlier attngym wrote it)"
    if version != now:
        return f"it ran on attngym {version}, this is attngym {now}"
    for name, source in sorted(sources.items()):
        file = source.get("file") if isinstance(source, Mapping) else None
        if not isinstance(file, str):
            return f"its record of {name}'s source cannot be read"
        now = _sha256(file)
        if now is None:
            return f"its code changed: {shown_path(file)} ({name}) is gone"
        if now != source.get("sha256"):
            return f"its code changed: {shown_path(file)} ({name}) was edited since it ran"
    return None


def blame(err: BaseException, paths: Mapping[str, str]) -> UserCodeError | None:
    """A UserCodeError naming the config key (of `paths`: key -> import path) whose code raised
    `err` during the run, past the probe on index grids, with the user's file and line; None
    when none of its frames is in a module those paths name. A sys.exit or GeneratorExit of
    the user's code is blamed alike (failure_text says it must raise instead)."""
    frame = user_frame(err)
    if frame is None:
        return None
    file = os.path.abspath(frame.filename)
    for key, path in paths.items():
        modules = (sys.modules.get(name) for name in _module_names(path))
        if any(os.path.abspath(getattr(m, "__file__", None) or "") == file for m in modules):
            text = str(err) if isinstance(err, Exception) else failure_text(err).partition(": ")[2]
            first = next((line for line in text.splitlines() if line.strip()), "")
            hint = (
                "; callbacks must use tensor ops only: no .item(), int(tensor) or random numbers"
                if "vmap" in first
                else ""
            )
            return UserCodeError(
                key,
                f"{path} raised {type(err).__name__} at {location(err)} during the run (past "
                f"the probe on index grids): {first}{hint}",
            )
    return None
