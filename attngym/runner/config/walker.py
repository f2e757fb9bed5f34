"""The one walker: a section checked from the fields of its dataclass, the dotted key named in
every message, and `Settings` read back from the checked data; the keys a config may hold
(`check_key`, with a did-you-mean).

Apart from the types (settings.py) because one walker serves every section, a topology's
options dataclass included (topology.py).
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from attngym.errors import ConfigError, choice_error, closest
from attngym.runner.config.machine import _option_names
from attngym.runner.config.settings import Settings, _Rule, _rule

# ---------------------------------------------------------------------------------------------
# Reading the fields.


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """The evaluated field types of `cls` (Variant, imported only for type checkers, as Any)."""
    return get_type_hints(cls, localns={"Variant": Any})


def _is_section(hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def _written(cls: type) -> list[dataclasses.Field]:
    """The fields of `cls` a config may write."""
    return [f for f in dataclasses.fields(cls) if _rule(f).written]


def _default(field: dataclasses.Field, key: str) -> Any:
    """The field's default as a config writes it (a fresh copy; a tuple as a list): a key the
    config leaves out takes it."""
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    if field.default is dataclasses.MISSING:
        raise ConfigError(key, "missing; it has no default")
    return list(field.default) if isinstance(field.default, tuple) else field.default


def _mapping_at(node: dict[str, Any], name: str, key: str) -> dict[str, Any]:
    """node[name] as a mapping; a missing or null one is made empty (its keys take defaults)."""
    child = node.get(name)
    if child is None:
        child = node[name] = {}
    if not isinstance(child, dict):
        raise ConfigError(key, f"must be a mapping, got {child!r}")
    return child


def _literals(args: Sequence[Any]) -> tuple[Any, ...]:
    """The choices of the Literal types among `args` (a union's members)."""
    return tuple(c for a in args if get_origin(a) is Literal for c in get_args(a))


def _check_value(key: str, value: Any, hint: Any, rule: _Rule, name: str) -> Any:
    """`value` checked against the field's type and rule: the value as checked (a float for
    a float, {} for a null mapping, [] for a null list), or a ConfigError naming `key`."""
    if rule.check is not None:
        return rule.check(key, value)
    what = rule.what or name.replace("_", " ")
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        choices = _literals(args)
        if value in choices and not isinstance(value, bool):
            return value
        rest = [a for a in args if a is not type(None) and get_origin(a) is not Literal]
        if not rest:
            raise ConfigError(key, choice_error(what, value, choices))
        (other,) = rest
        return _check_value(key, value, other, rule, name)
    if origin is Literal:
        if value not in args or isinstance(value, bool):
            raise ConfigError(key, choice_error(what, value, args))
        return value
    if origin is tuple:  # tuple[X, ...]: a list in the config; null is none
        values = [] if value is None else value
        choices = list(_literals(args[:1]))
        if not isinstance(values, list):
            raise ConfigError(key, f"must be a list of {choices}, got {value!r}")
        if rule.non_empty and not values:
            raise ConfigError(key, f"must be a non-empty list of {choices}, got {values!r}")
        return [_check_value(key, v, args[0], rule, name) for v in values]
    if origin is dict:  # an open mapping: its keys are its owner's (checked by a rule)
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            raise ConfigError(key, f"must be a mapping, got {value!r}")
        return dict(value)
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, f"must be true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int) or value < rule.low:
            need = "a positive integer" if rule.low == 1 else f"an integer >= {rule.low}"
            raise ConfigError(key, f"must be {need}, got {value!r}")
        return value
    if hint is str:
        if rule.choices is not None:
            choices = list(rule.choices())
            if value not in choices:
                raise ConfigError(key, choice_error(what, value, choices))
        elif not isinstance(value, str):
            raise ConfigError(key, f"must be a string, got {value!r}")
        return value
    raise TypeError(f"{key}: no check for a field of type {hint!r}")  # a new type needs one


def _check_section(cls: type, node: dict[str, Any], prefix: str = "") -> None:
    """Check `node` against the fields of `cls`, in place: a key it leaves out takes the
    field's default, every value its checked form; a bad value is a ConfigError naming the
    dotted key (`prefix` + the field)."""
    hints = _hints(cls)
    for field in _written(cls):
        key, hint, rule = prefix + field.name, hints[field.name], _rule(field)
        if _is_section(hint):
            _check_section(hint, _mapping_at(node, field.name, key), f"{key}.")
        elif rule.keys:
            child = _mapping_at(node, field.name, key)
            several = len(rule.keys) > 1
            defaults = _default(field, key) if several else (_default(field, key),)
            items = get_args(hint) if several else (hint,)
            for sub, default, item in zip(rule.keys, defaults, items, strict=True):
                value = child.get(sub, default)
                child[sub] = _check_value(f"{key}.{sub}", value, item, rule, field.name)
        else:
            if field.name not in node:
                node[field.name] = _default(field, key)
            node[field.name] = _check_value(key, node[field.name], hint, rule, field.name)


def _build(cls: type, node: Mapping[str, Any], **given: Any) -> Any:
    """`cls` from a checked section, field by field (`given` for the fields no config writes)."""
    hints = _hints(cls)
    values = {}
    for field in _written(cls):
        value, hint, keys = node[field.name], hints[field.name], _rule(field).keys
        if _is_section(hint):
            value = _build(hint, value)
        elif keys:
            value = value[keys[0]] if len(keys) == 1 else tuple(value[k] for k in keys)
        elif get_origin(hint) is tuple:
            value = tuple(value)
        elif get_origin(hint) is dict:
            value = dict(value)
        values[field.name] = value
    return cls(**values, **given)


def _keys_of(cls: type, prefix: str = "") -> list[str]:
    keys = []
    for field in _written(cls):
        key, hint, rule = prefix + field.name, _hints(cls)[field.name], _rule(field)
        if _is_section(hint):
            keys += _keys_of(hint, f"{key}.")
        elif rule.keys:
            keys += [f"{key}.{sub}" for sub in rule.keys]
        else:
            keys.append(key)
    return keys


def _open_mappings(cls: type, prefix: str = "") -> tuple[str, ...]:
    """The dotted keys of the open mappings (dict fields) of `cls` and its sections."""
    found: list[str] = []
    for field in _written(cls):
        hint, key = _hints(cls)[field.name], prefix + field.name
        if _is_section(hint):
            found += _open_mappings(hint, f"{key}.")
        elif get_origin(hint) is dict:
            found.append(key)
    return tuple(found)


# Mappings that take any key, each checked by its owner: the variant's parameters by
# attngym.variants.spec, flex's kernel options by flex, a tracker's by its factory, a topology's
# options by its spec, a scheme factory's arguments by its signature.
OPEN_MAPPINGS = _open_mappings(Settings)


def _in_open_mapping(key: str) -> bool:
    return any(key == m or key.startswith(f"{m}.") for m in OPEN_MAPPINGS)


def known_keys() -> list[str]:
    """Every dotted key a config may set (an open mapping as its own name)."""
    return _keys_of(Settings)


def check_key(key: str) -> None:
    """`key` (dotted) maps to a Settings field, or lies in an open mapping; else a ConfigError
    with the key it most likely means (`seq_len` → `shape.seq_len`, `shape.seqlen` →
    `shape.seq_len`)."""
    if _in_open_mapping(key):
        return
    known = known_keys()
    if key in known or any(k.startswith(f"{key}.") for k in known):
        return
    known += [f"topology.options.{name}" for name in _option_names()]  # what a key may mean
    leaves = {k.rsplit(".", 1)[-1]: k for k in known}
    leaf = key.rsplit(".", 1)[-1]
    hint = leaves.get(leaf) or closest(key, known) or leaves.get(closest(leaf, leaves) or "")
    suffix = f"; did you mean {hint}?" if hint else ""
    raise ConfigError(key, f"unknown key{suffix} (attngym --cfg job lists the keys)")


def _check_keys(data: Mapping[str, Any], prefix: str = "") -> None:
    """Every key of the composed config maps to a Settings field (the one check of the rule)."""
    for name, value in data.items():
        key = f"{prefix}{name}"
        check_key(key)
        if isinstance(value, Mapping) and not _in_open_mapping(key):
            _check_keys(value, f"{key}.")


def plain(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """A nested dict/list copy of a mapping, the `hydra` node left out, so the checks can fill
    in defaults without touching the caller's mapping."""

    def copy(node: Any) -> Any:
        if isinstance(node, Mapping):
            return {str(k): copy(v) for k, v in node.items()}
        if isinstance(node, Sequence) and not isinstance(node, str):
            return [copy(v) for v in node]
        return node

    return {str(k): copy(v) for k, v in cfg.items() if k != "hydra"}
