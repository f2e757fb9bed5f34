"""Name → factory, per kind of component: how configs become objects.

Kinds used by attngym: "variant" (the attention catalogue, delegated to attngym.variants),
"task" (one per topology), "transport", "profiler", "tracker". `build(kind, name, **params)` checks
`params` against the factory's signature before calling it, so a misspelt config key fails with the
parameter list instead of a TypeError deep inside.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from attngym.errors import choice_error

_REGISTRY: dict[str, dict[str, Callable[..., Any]]] = {}


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
    if kind == "variant":
        from attngym import variants

        return {n: variants.factory(n) for n in variants.names()}
    _load(kind)
    if kind not in _REGISTRY:
        raise ValueError(choice_error("component kind", kind, _REGISTRY))
    return _REGISTRY[kind]


def _load(kind: str) -> None:
    """Import the package whose modules register `kind`, so lookups never depend on import order."""
    import importlib

    package = {
        "task": "attngym.tasks",
        "tracker": "attngym.tracking",
        "profiler": "attngym.profiling",
        "transport": "attngym.distributed",
    }.get(kind)
    if package:
        importlib.import_module(package)


def names(kind: str) -> list[str]:
    """Registered names of one kind, sorted."""
    return sorted(_table(kind))


def get(kind: str, name: str) -> Callable[..., Any]:
    """The factory for (kind, name); unknown names list the choices and suggest the closest."""
    table = _table(kind)
    if name not in table:
        raise ValueError(choice_error(kind, name, table))
    return table[name]


def check_params(kind: str, name: str, params: dict[str, Any]) -> None:
    """ValueError for parameters the factory does not take, naming the ones it does."""
    sig = inspect.signature(get(kind, name))
    if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        return
    for key in params:
        if key not in sig.parameters:
            allowed = ", ".join(sig.parameters) or "none"
            raise ValueError(f"{kind} {name!r} has no parameter {key!r}; its parameters: {allowed}")


def build(kind: str, name: str, **params: Any) -> Any:
    """Call the factory for (kind, name) with `params`, checked against its signature."""
    check_params(kind, name, params)
    return get(kind, name)(**params)
