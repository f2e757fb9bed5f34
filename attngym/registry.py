"""Name → factory, per kind of component: how configs become objects.

One table for every kind attngym builds from a name: "variant" (the attention catalogue),
"task" (one per topology), "transport", "profiler", "tracker". A kind's package registers its
factories when imported, and a lookup imports that package first, so names never depend on import
order. `build(kind, name, **params)` checks `params` against the factory's signature before
calling it (`check_params`, the one signature check), so a misspelt config key fails with the
parameter list and a suggestion instead of a TypeError deep inside.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from attngym.errors import choice_error, closest

_REGISTRY: dict[str, dict[str, Callable[..., Any]]] = {}

# The package whose modules register each kind.
PACKAGES = {
    "variant": "attngym.variants",
    "task": "attngym.runner.tasks",
    "tracker": "attngym.runner.tracking",
    "profiler": "attngym.profiling",
    "transport": "attngym.distributed",
    "topology": "attngym.distributed.schemes.topologies",
}
# How an unknown name of a kind is described to the user.
_LABELS = {"variant": "attention variant"}


class ParamError(ValueError):
    """A parameter a factory does not take, or a required one missing.

    Attributes:
        param: the parameter's name.
        detail: the message without the kind, e.g. "'sliding_window' has no parameter 'w' ...".
    """

    def __init__(self, kind: str, param: str, detail: str):
        self.param = param
        self.detail = detail
        super().__init__(f"{kind} {detail}")


def register(kind: str, name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: file `factory` under (kind, name)."""

    def deco(factory: Callable[..., Any]) -> Callable[..., Any]:
        table = _REGISTRY.setdefault(kind, {})
        if name in table:
            raise RuntimeError(f"{kind} {name!r} registered twice")
        table[name] = factory
        return factory

    return deco


def _table(kind: str) -> dict[str, Callable[..., Any]]:
    if kind in PACKAGES:
        importlib.import_module(PACKAGES[kind])
    if kind not in _REGISTRY:
        raise ValueError(choice_error("component kind", kind, _REGISTRY))
    return _REGISTRY[kind]


def names(kind: str) -> list[str]:
    """Registered names of one kind, sorted."""
    return sorted(_table(kind))


def get(kind: str, name: str) -> Callable[..., Any]:
    """The factory for (kind, name); unknown names list the choices and suggest the closest."""
    table = _table(kind)
    if name not in table:
        raise ValueError(choice_error(_LABELS.get(kind, kind), name, table))
    return table[name]


def check_params(kind: str, name: str, params: Mapping[str, Any]) -> None:
    """ParamError for a parameter the factory does not take (naming the ones it does, with the
    closest spelling) or a required one missing."""
    sig = inspect.signature(get(kind, name))
    named = {
        key: p
        for key, p in sig.parameters.items()
        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }
    if len(named) == len(sig.parameters):  # no **kwargs: every key must be a parameter
        for key in params:
            if key not in named:
                allowed = ", ".join(named) or "none"
                hint = closest(key, named)
                suffix = f" (did you mean {hint!r}?)" if hint else ""
                raise ParamError(
                    kind,
                    key,
                    f"{name!r} has no parameter {key!r} (value {params[key]!r}); "
                    f"its parameters: {allowed}{suffix}",
                )
    for key, p in named.items():
        if p.default is inspect.Parameter.empty and key not in params:
            raise ParamError(kind, key, f"{name!r} needs parameter {key!r}; none given")


def build(kind: str, name: str, **params: Any) -> Any:
    """Call the factory for (kind, name) with `params`, checked against its signature."""
    check_params(kind, name, params)
    return get(kind, name)(**params)
