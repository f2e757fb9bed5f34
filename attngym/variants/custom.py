"""Your own variant: FlexAttention callbacks from any importable code.

    attngym attention=custom attention.mask_mod=mymasks.checkerboard
    attngym attention=custom attention.mask_mod=attn_gym.masks.generate_sliding_window \
        attention.mask_args.window_size=64

`attention.mask_mod` and `attention.score_mod` are import paths (`package.module.name`, as
Hydra's `_target_`, or `package.module:name`), resolved from the working directory and
PYTHONPATH, so a `mymasks.py` beside your runs needs no installing. Each names the callback
itself, or a factory that returns it, called with `attention.mask_args` / `attention.score_args`
(and with `device=` when it takes one, so the tensors it builds live where the run attends).
Which of the two, its parameter names say, or its *_args being set (`_is_factory`); the run's
log and metrics.json say how each path was read (`Reading`).

User code is foreign input: everything that can be judged before any real tensor work is judged
here, each failure one line naming the config key. The import, the names, the signatures, the
factory's arguments, then a probe: the callback evaluated on a small grid of (b, h, q_idx, kv_idx)
spanning the whole sequence, which must return a bool (mask_mod) or floating (score_mod) tensor
of the grid's broadcast shape.

The contract a callback meets (the README states it for users):

* positions are global: `q_idx` and `kv_idx` index the whole sequence (0 .. seq_len - 1), `b`
  the batch row and `h` the query head, whatever the topology (a context-parallel rank sees
  global positions too);
* tensor ops only, no Python branching on their values, so the same code runs inside
  FlexAttention (compiled), on broadcast index grids (the float64 reference, the pictures, the
  dense SDPA baseline) and on every rank;
* tensors it reads (document ids, offsets, tables) cover the whole sequence and live on the run's
  device: a factory that takes `device` is called with it (again on each rank, for its device); a
  callback that reads a tensor on another device is refused, naming it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import re
import types
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from attngym import user_code
from attngym.errors import CODE_ERRORS, ConfigError, Interrupted, closest, failure_text
from attngym.variants.base import Variant

NAME = "custom"
# The callbacks' positional arguments, in FlexAttention's order.
ARGUMENTS = {
    "mask_mod": ("b", "h", "q_idx", "kv_idx"),
    "score_mod": ("score", "b", "h", "q_idx", "kv_idx"),
}
KEYS = ("mask_mod", "mask_args", "score_mod", "score_args", "label")
PROBE_POSITIONS = 16  # positions per axis of the probe grid, spread over the sequence


def callbacks(entry: Any, key: str = "attention") -> list[tuple[str, str, Any, Any]]:
    """(dotted key, kind, path, its arguments as given) of every callback an attention entry
    names, compose entries included."""
    if not isinstance(entry, Mapping):
        return []
    found = [
        (f"{key}.{kind}", kind, entry[kind], entry.get(kind.replace("_mod", "_args")))
        for kind in ARGUMENTS
        if entry.get(kind) is not None
    ]
    for i, part in enumerate(entry.get("compose") or ()):
        found += callbacks(part, f"{key}.compose.{i}")
    return found


def in_this_process_only(entry: Any, key: str = "attention") -> str | None:
    """The dotted key of the first callback path of an attention entry (compose entries too)
    that names an object of `user_code.objects`, which a new process (a context-parallel rank)
    cannot import; None when every path can be imported anywhere."""
    return next(
        (at for at, _, path, _ in callbacks(entry, key) if user_code.lives_in_this_process(path)),
        None,
    )


def readings(entry: Any, device: Any = "cpu") -> list[Reading]:
    """How each callback of a custom attention entry (compose entries too) is read on
    `device`: for the run's log and metrics.json (`callbacks_read`)."""
    return [
        reading(path, _given(args), kind=kind, key=at, device=device)
        for at, kind, path, args in callbacks(entry)
    ]


def _positional(fn: Callable[..., Any]) -> tuple[int, int] | None:
    """(required, most) positional parameters of fn; most is large for *args; None when its
    signature cannot be read."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = sum(p.default is p.empty for p in positional)
    most = 1 << 30 if any(p.kind == p.VAR_POSITIONAL for p in params) else len(positional)
    return required, most


def _takes(fn: Callable[..., Any], count: int) -> bool:
    arity = _positional(fn)
    return arity is None or arity[0] <= count <= arity[1]


def _args_key(key: str, kind: str) -> str:
    """`attention.mask_args` for `attention.mask_mod` (a compose entry's alike)."""
    return f"{key.rsplit('.', 1)[0]}.{kind.replace('_mod', '_args')}"


def _is_factory(obj: Any, kind: str, args: Mapping[str, Any] | None) -> tuple[bool, str]:
    """Whether `obj` is read as a factory of a `kind` (else as the `kind` itself), and why.

    Its parameters' names decide, not how many it takes: a factory whose arguments all have
    defaults takes four arguments too (`random_block(block=128, p=0.3, seed=0, seq_len=1024,
    device="cpu")`). The callback itself: its first parameters are the callback's (b, h, q_idx,
    kv_idx; score first for a score_mod), or it takes exactly as many with no default (`lambda
    b, h, q, kv: ...`), or *args. A factory: anything else, and whatever `args` are given for
    (`attention.mask_args: {}` calls it with none)."""
    names = ARGUMENTS[kind]
    if args is not None:
        return True, "its arguments set"
    try:
        params = list(inspect.signature(obj).parameters.values())
    except (TypeError, ValueError):
        return False, "its signature unreadable"
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if _named_as(obj, kind):
        return False, "by its parameter names"
    if sum(p.default is p.empty for p in positional) == len(names):
        return False, f"by its {len(names)} parameters, none defaulted"
    if not positional and any(p.kind == p.VAR_POSITIONAL for p in params):
        return False, "by its *args"
    return True, "by its parameter names"


def _named_as(obj: Any, kind: str) -> bool:
    """Whether obj's first positional parameters are a `kind`'s, by name."""
    try:
        params = inspect.signature(obj).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return tuple(positional[: len(ARGUMENTS[kind])]) == ARGUMENTS[kind]


@dataclasses.dataclass(frozen=True)
class Reading:
    """How an import path's object is read: as the `kind` itself, or as a factory called as
    `call` (its arguments, the defaults it fills in included); `why` says what decided it."""

    key: str
    kind: str
    shown: str
    factory: bool
    why: str
    call: str = ""

    def __str__(self) -> str:
        """What metrics.json records (`callbacks_read`)."""
        what = f"factory {self.call}" if self.factory else f"the {self.kind} itself"
        return f"{self.key}: {self.shown} as {what}"

    def sentence(self) -> str:
        """The run log's line: how, and why (the README says how to read it the other way)."""
        if self.factory:
            return f"{self.key}: {self.shown} is a factory, {self.why}: {self.call}"
        return f"{self.key}: {self.shown} is the {self.kind}, {self.why}"


def _read(
    path: Any, args: Mapping[str, Any] | None, *, kind: str, key: str, device: Any
) -> tuple[Reading, Any]:
    """(how `path` is read, the object it names); a factory's arguments are checked against its
    signature, nothing of the user's is called but the import."""
    args_key = _args_key(key, kind)
    if args is not None and not isinstance(args, Mapping):
        raise ConfigError(args_key, f"must be a mapping of the factory's arguments, got {args!r}")
    obj = path if callable(path) else user_code.resolve(path, key=key)
    shown = path if isinstance(path, str) else getattr(obj, "__qualname__", repr(obj))
    if not callable(obj):
        raise ConfigError(
            key,
            f"{shown} is a {type(obj).__name__}, not a function: name a {kind} or a factory "
            "that returns one",
        )
    want = len(ARGUMENTS[kind])
    signature = f"({', '.join(ARGUMENTS[kind])})"
    factory, why = _is_factory(obj, kind, args)
    if args and _named_as(obj, kind):
        raise ConfigError(
            f"{args_key}.{next(iter(args))}",
            f"{shown} is a {kind} itself {signature}, not a factory: it takes no {args_key}; "
            f"remove them, or name a factory that returns a {kind}",
        )
    if not factory:
        return Reading(key, kind, shown, False, why), obj
    required = _required_names(obj)
    if args is None and required:
        raise ConfigError(
            key,
            f"{shown} takes ({', '.join(required)}); a {kind} takes {want} {signature}; if it "
            f"is a factory, give its arguments: "
            + " ".join(f"{args_key}.{name}=..." for name in required),
        )
    user_code.check_factory(obj, kind=kind, path=shown, key=key)
    call = user_code.factory_call(obj, args or {}, path=shown, key=args_key, device=device)
    return Reading(key, kind, shown, True, why, user_code.described_call(obj, call)), obj


def _required_names(fn: Callable[..., Any]) -> list[str]:
    """The names of fn's required positional parameters."""
    params = inspect.signature(fn).parameters.values()
    return [
        p.name
        for p in params
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    ]


def reading(
    path: Any, args: Mapping[str, Any] | None, *, kind: str, key: str, device: Any = "cpu"
) -> Reading:
    """How `callback` reads `path` (with `args`, on `device`), for the run's log and
    metrics.json."""
    return _read(path, args, kind=kind, key=key, device=device)[0]


def callback(
    path: Any, args: Mapping[str, Any] | None, *, kind: str, key: str, device: Any = "cpu"
) -> Callable[..., torch.Tensor]:
    """The `kind` callback ("mask_mod" or "score_mod") an import path names: the object itself,
    or what it returns called as a factory with `args` (`_is_factory` decides which; None: no
    arguments given, {}: called with none).

    Raises:
        ConfigError: the path does not resolve, is not callable, takes or returns the wrong
            arguments, or its factory raised; key is `attention.<kind>` or
            `attention.<kind>_args.<name>`.
    """
    read, obj = _read(path, args, kind=kind, key=key, device=device)
    if not read.factory:
        return obj
    want = len(ARGUMENTS[kind])
    built = user_code.call_factory(
        obj, args or {}, path=read.shown, key=_args_key(key, kind), device=device
    )
    if not callable(built) or not _takes(built, want):
        what = (
            f"a function of {_positional(built)[0]} argument(s)"
            if callable(built) and _positional(built)
            else f"a {type(built).__name__}"
        )
        raise ConfigError(
            key,
            f"{read.shown} returned {what}; a {kind} takes {want} arguments "
            f"({', '.join(ARGUMENTS[kind])})",
        )
    return built


def _probe_built(
    fn: Callable[..., Any],
    args: Mapping[str, Any],
    *,
    kind: str,
    key: str,
    seq_len: int,
    heads: int,
) -> None:
    """probe(fn), a failure blamed on the factory argument that is text where the callback
    raised TypeError or ValueError (`mask_args.window=abc`: the value is wrong, not the code)."""
    try:
        probe(fn, kind=kind, key=f"{key}.{kind}", seq_len=seq_len, heads=heads)
    except ConfigError as err:
        texts = [name for name, value in args.items() if isinstance(value, str)]
        if not texts or not re.search(r"raised (TypeError|ValueError)", str(err)):
            raise
        args_key = f"{key}.{kind.replace('_mod', '_args')}.{texts[0]}"
        detail = str(err).removeprefix(f"{err.key}: ")
        raise ConfigError(
            args_key, f"{args[texts[0]]!r} is text, and the {kind} built with it {detail}"
        ) from err


def _grid(seq_len: int, heads: int, batch: int = 2) -> tuple[torch.Tensor, ...]:
    """(b, h, q_idx, kv_idx) broadcasting to (B, H, P, P), positions spread over the whole
    sequence (its first and last included), int32 as FlexAttention passes them."""
    pos = torch.linspace(0, seq_len - 1, min(PROBE_POSITIONS, seq_len)).round().to(torch.int32)
    pos = pos.unique()
    b = torch.arange(batch, dtype=torch.int32).view(-1, 1, 1, 1)
    h = torch.arange(min(heads, 4), dtype=torch.int32).view(1, -1, 1, 1)
    return b, h, pos.view(1, 1, -1, 1), pos.view(1, 1, 1, -1)


def _vmapped(fn: Callable[..., Any], kind: str) -> Callable[..., Any]:
    """fn as create_block_mask and FlexAttention's CPU path call it: one torch.vmap per index,
    kv_idx innermost, each index a 1-d tensor (a score_mod's score mapped at every level), with
    vmap's default of refusing random numbers."""
    for i in reversed(range(4)):
        dims = [None] * 4
        dims[i] = 0
        fn = torch.vmap(fn, in_dims=(0, *dims) if kind == "score_mod" else tuple(dims))
    return fn


def probe(fn: Callable[..., Any], *, kind: str, key: str, seq_len: int, heads: int) -> None:
    """Evaluate fn on a small grid spanning the sequence, broadcast and then under vmap as
    FlexAttention calls it; ConfigError(key) when it raises (naming the user's file and line)
    or returns other than a bool (mask_mod) or floating (score_mod) tensor of the grid's
    shape."""
    b, h, q_idx, kv_idx = _grid(seq_len, heads)
    shape = torch.broadcast_shapes(b.shape, h.shape, q_idx.shape, kv_idx.shape)
    args = (b, h, q_idx, kv_idx)
    if kind == "score_mod":
        score = torch.randn(shape, generator=torch.Generator().manual_seed(0))
        args = (score, *args)
    where = f"on a probe grid (b < {b.numel()}, h < {h.numel()}, positions 0..{seq_len - 1})"
    out = _probed(fn, args, key=key, where=where)
    _check_output(out, kind=kind, key=key, where=where, shape=shape)
    flat = tuple(a.flatten() for a in args[-4:])
    _probed(
        _vmapped(fn, kind),
        (score, *flat) if kind == "score_mod" else flat,
        key=key,
        where="under torch.vmap, as create_block_mask and FlexAttention call it",
    )


def _probed(fn: Callable[..., Any], args: tuple[Any, ...], *, key: str, where: str) -> Any:
    """fn(*args); ConfigError(key) naming where the user's code raised, and how to fix it."""
    try:
        with warnings.catch_warnings():  # vmap's note on ops without a batching rule
            warnings.simplefilter("ignore")
            return fn(*args)
    except Interrupted:
        raise
    except CODE_ERRORS as err:  # the user's code, on tensors shaped as FlexAttention passes them
        message = failure_text(err).partition(": ")[2].splitlines()[0] if str(err) else ""
        hint = (
            "; callbacks must use tensor ops only (torch.where, &, |), not Python if/and/or"
            if "ambiguous" in message or "Boolean value" in message
            else "; tensors it reads must cover shape.seq_len"
            if isinstance(err, IndexError)
            else "; callbacks must use tensor ops only: no .item(), int(tensor) or random "
            "numbers, which vmap cannot batch"
            if "vmap" in message
            else ""
        )
        at = user_code.location(err)
        at = f" at {at}" if at else ""
        raise ConfigError(key, f"raised {type(err).__name__} {where}{at}: {message}{hint}") from err


def _check_output(out: Any, *, kind: str, key: str, where: str, shape: torch.Size) -> None:
    """ConfigError(key) for an output that is no bool (mask_mod) or floating (score_mod) tensor
    broadcasting to the probe grid's `shape`."""
    if callable(out) and not isinstance(out, torch.Tensor):  # a factory taken for the callback
        args_key = _args_key(key, kind)
        raise ConfigError(
            key,
            f"returned a function {where}: read as the {kind} itself, it is a factory; give "
            f"its arguments ({args_key}.NAME=...), or {args_key}={{}} to call it with none",
        )
    if not isinstance(out, torch.Tensor):
        raise ConfigError(key, f"returned a {type(out).__name__} {where}; it must return a tensor")
    want = "bool" if kind == "mask_mod" else "floating"
    ok_dtype = out.dtype == torch.bool if kind == "mask_mod" else out.dtype.is_floating_point
    if not ok_dtype:
        raise ConfigError(key, f"returned {out.dtype} {where}; a {kind} returns a {want} tensor")
    try:
        fits = torch.broadcast_shapes(out.shape, shape) == shape
    except RuntimeError:
        fits = False
    if not fits:
        raise ConfigError(
            key,
            f"returned shape {tuple(out.shape)} {where}; it must broadcast to the grid's "
            f"{tuple(shape)} (one value per (b, h, q_idx, kv_idx))",
        )


def tensors_read(fn: Any) -> list[tuple[str, torch.Tensor]]:
    """The tensors a callback can read: in its closure, its default arguments, the globals it
    names, and recursively in the functions, partials and callable objects among those."""
    found: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()

    def visit(name: str, obj: Any, depth: int) -> None:
        if id(obj) in seen or depth > 8:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append((name, obj))
        elif isinstance(obj, list | tuple):
            for i, item in enumerate(obj):
                visit(f"{name}[{i}]", item, depth + 1)
        elif isinstance(obj, dict):
            for k, item in obj.items():
                visit(f"{name}[{k!r}]", item, depth + 1)
        elif isinstance(obj, types.FunctionType):
            code = obj.__code__
            for var, cell in zip(code.co_freevars, obj.__closure__ or (), strict=False):
                with contextlib.suppress(ValueError):  # an empty cell
                    visit(var, cell.cell_contents, depth + 1)
            for var in code.co_names:
                if var in obj.__globals__ and not isinstance(
                    obj.__globals__[var], types.ModuleType
                ):
                    visit(var, obj.__globals__[var], depth + 1)
            for i, default in enumerate(obj.__defaults__ or ()):
                visit(f"{obj.__name__} default {i}", default, depth + 1)
        elif hasattr(obj, "func") and hasattr(obj, "args"):  # functools.partial
            visit(name, obj.func, depth + 1)
            visit(name, obj.args, depth + 1)
            visit(name, getattr(obj, "keywords", {}), depth + 1)
        elif callable(obj) and hasattr(obj, "__dict__") and not isinstance(obj, type):
            for attr, item in vars(obj).items():
                visit(attr, item, depth + 1)

    visit(getattr(fn, "__name__", "callback"), fn, 0)
    return found


def check_device(fn: Any, device: Any, *, key: str, variant: str) -> None:
    """ConfigError(key) when fn reads a tensor that is not on `device`: FlexAttention would
    fail to compile it deep inside, or the reference would index across devices."""
    want = torch.device(device)
    for name, tensor in tensors_read(fn):
        if tensor.device.type != want.type:
            raise ConfigError(
                key,
                f"variant {variant!r} reads {name}, a {tensor.device.type} tensor of shape "
                f"{tuple(tensor.shape)}, but the run is on {want.type}: let its factory take "
                f"`device` (attngym passes the run's), or build the tensor on {want.type}",
            )


def _given(args: Any) -> Any:
    """A factory's arguments as the entry gives them: None (not given: the signature decides how
    the path is read), a mapping (a copy), or what else was given (refused by `_read`)."""
    return dict(args) if isinstance(args, Mapping) else args


@dataclasses.dataclass(frozen=True)
class _Recipe:
    """How to rebuild the callbacks on another device: paths (or objects) and arguments."""

    mask_mod: Any
    mask_args: Mapping[str, Any] | None
    score_mod: Any
    score_args: Mapping[str, Any] | None
    key: str

    def build(self, device: Any) -> tuple[Any, Any]:
        """(score_mod, mask_mod) built for `device` (None where the entry has none)."""
        built = {
            kind: callback(path, args, kind=kind, key=f"{self.key}.{kind}", device=device)
            for kind, path, args in (
                ("score_mod", self.score_mod, self.score_args),
                ("mask_mod", self.mask_mod, self.mask_args),
            )
            if path is not None
        }
        return built.get("score_mod"), built.get("mask_mod")


# Names a closure often has that say nothing of the variant: the factory's name says more.
_GENERIC_NAMES = {"mask_mod", "score_mod", "mask", "score", "mod", "fn", "inner", "wrapper"}


def _label(fn: Any, path: Any) -> str:
    """The name of a callback in tables and W&B: its __name__ (attention-gym's closures carry
    their parameters, e.g. sliding_window_64), else the function it was made in (`strided` for
    `strided.<locals>.mask_mod`), else the last part of its import path."""
    name = getattr(fn, "__name__", None)
    if isinstance(name, str) and name.isidentifier() and name not in _GENERIC_NAMES:
        return name
    if name == "<lambda>":
        return "lambda"
    qualname = getattr(fn, "__qualname__", "")
    maker = qualname.rpartition(".<locals>.")[0].rsplit(".", 1)[-1]
    if maker.isidentifier() and maker not in _GENERIC_NAMES:
        return maker
    if isinstance(path, str):
        return path.replace(":", ".").rsplit(".", 1)[-1]
    return getattr(path, "__name__", "callback")


def build(
    entry: Mapping[str, Any],
    *,
    key: str = "attention",
    seq_len: int | None = None,
    heads: int | None = None,
) -> Variant:
    """The Variant of a `{"name": "custom", "mask_mod": ..., "score_mod": ...}` config entry,
    probed on a small grid (see the module docstring). Its callbacks are rebuilt by `.to(device)`
    (a factory taking `device` is called again with it; otherwise the tensors its callbacks read
    must already be on that device)."""
    extra = sorted(set(entry) - {"name", *KEYS})
    if extra:
        hint = closest(extra[0], KEYS)
        suffix = f"; did you mean {key}.{hint}?" if hint else ""
        raise ConfigError(
            f"{key}.{extra[0]}", f"a custom attention takes {', '.join(KEYS)}{suffix}"
        )
    mask_path, score_path = entry.get("mask_mod"), entry.get("score_mod")
    if mask_path is None and score_path is None:
        raise ConfigError(
            f"{key}.mask_mod",
            "a custom attention needs mask_mod or score_mod (or both): an import path such as "
            f"{key}.mask_mod=mymasks.checkerboard",
        )
    recipe = _Recipe(
        mask_mod=mask_path,
        mask_args=_given(entry.get("mask_args")),
        score_mod=score_path,
        score_args=_given(entry.get("score_args")),
        key=key,
    )
    score_mod, mask_mod = recipe.build("cpu")
    size, head_count = seq_len or 1024, heads or 4
    for kind, fn in (("mask_mod", mask_mod), ("score_mod", score_mod)):
        if fn is not None:
            check_device(fn, "cpu", key=f"{key}.{kind}", variant=_label(fn, entry.get(kind)))
            args = recipe.mask_args if kind == "mask_mod" else recipe.score_args
            _probe_built(fn, args or {}, kind=kind, key=key, seq_len=size, heads=head_count)
    parts = [
        _label(fn, entry.get(k))
        for k, fn in (("mask_mod", mask_mod), ("score_mod", score_mod))
        if fn
    ]
    name = entry.get("label") or "+".join(parts)
    params = {k: entry[k] for k in KEYS if k != "label" and entry.get(k) not in (None, {})}
    params = {
        k: v if isinstance(v, str | Mapping) else getattr(v, "__qualname__", repr(v))
        for k, v in params.items()
    }

    def bind(buffers: Mapping[str, torch.Tensor]) -> tuple[Any, Any]:
        device = buffers["device"].device
        score, mask = recipe.build(device)
        for kind, fn in (("mask_mod", mask), ("score_mod", score)):
            if fn is not None:
                check_device(fn, device, key=f"{key}.{kind}", variant=str(name))
        return score, mask

    return Variant(
        name=str(name),
        params=params,
        score_mod=score_mod,
        mask_mod=mask_mod,
        # An empty tensor marks the device the callbacks were built for: `.to(device)` moves it
        # and rebuilds them there (Variant.bind), as for a catalogue variant's buffers.
        buffers={"device": torch.empty(0)},
        bind=bind,
    )


# The factory parameter a workload's batch sets: the document lengths of the batch.
DOCUMENTS_PARAM = "doc_lengths"


def with_documents(entry: Mapping[str, Any], lengths: list[int]) -> dict[str, Any] | None:
    """The custom entry with `lengths` given to every factory of it that takes DOCUMENTS_PARAM
    (as attention.mask_args.doc_lengths / score_args.doc_lengths), or None where none does."""
    out, found = dict(entry), False
    for kind in ARGUMENTS:
        path = entry.get(kind)
        if path is None:
            continue
        obj = path if callable(path) else user_code.resolve(path, key=f"attention.{kind}")
        try:
            takes = DOCUMENTS_PARAM in inspect.signature(obj).parameters
        except (TypeError, ValueError):
            takes = False
        if takes:
            args_key = f"{kind.removesuffix('_mod')}_args"
            out[args_key] = {**(entry.get(args_key) or {}), DOCUMENTS_PARAM: list(lengths)}
            found = True
    return out if found else None
