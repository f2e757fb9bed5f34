"""From a config entry to a Variant: `build_variant({"name": ..., **params})`.

The `attention` entry of a config names a catalogue factory and its parameters, or composes
several entries. Its errors are ConfigErrors naming the offending dotted key
(`attention.compose.0.window_size`) with the allowed parameters and a suggestion, so a misspelt
YAML key is one line, not a TypeError from inside a factory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from attngym import registry, variants
from attngym.errors import ConfigError, choice_error
from attngym.registry import ParamError
from attngym.variants import custom
from attngym.variants.base import Variant

# Variant parameters that must equal a shape field: parameter -> (shape key, why).
TIED_TO_SHAPE = {
    "num_heads": ("shape.heads", "ALiBi gives each query head its slope of a geometric sequence"),
}


def names() -> list[str]:
    """Every name `attention.name` takes: the catalogue and `custom` (your own callbacks)."""
    return sorted([*variants.names(), custom.NAME])


def build_variant(
    attention: Mapping[str, Any],
    *,
    key: str = "attention",
    seq_len: int | None = None,
    heads: int | None = None,
) -> Variant:
    """The Variant an `attention` config entry describes, composed entries included.

    Args:
        attention: `{"name": NAME, **params}` or `{"name": NAME, "compose": [entry, ...]}`; each
            composed entry is built like a plain one, then masks are AND-ed and score_mods chained
            (attngym.variants.compose); the result is renamed NAME.
        key: dotted config key of `attention`, used in error messages.
        seq_len: when given, the variant must be defined at this length (document lengths, a
            natten canvas).
        heads: when given, the number of query heads: parameters tied to it (TIED_TO_SHAPE,
            ALiBi's num_heads) must equal it.

    Raises:
        ConfigError: unknown variant or parameter, a missing or bad parameter, a seq_len or
            heads mismatch; the key names the offending entry, e.g.
            `attention.compose.0.window_size`.
    """
    if not isinstance(attention, Mapping) or "name" not in attention:
        raise ConfigError(key, f"needs a 'name' (one of {', '.join(names())})")
    name = attention["name"]
    if name == custom.NAME and "compose" not in attention:
        return custom.build(attention, key=key, seq_len=seq_len, heads=heads)
    if "compose" in attention:
        parts = attention["compose"]
        extra = sorted(set(attention) - {"name", "compose"})
        if extra:
            raise ConfigError(f"{key}.{extra[0]}", "a composed attention takes only name, compose")
        if not isinstance(parts, Sequence) or isinstance(parts, str) or not parts:
            raise ConfigError(f"{key}.compose", f"must be a non-empty list, got {parts!r}")
        built = [
            build_variant(p, key=f"{key}.compose.{i}", seq_len=seq_len, heads=heads)
            for i, p in enumerate(parts)
        ]
        try:
            variant = variants.compose(*built)
        except ValueError as err:
            raise ConfigError(f"{key}.compose", str(err)) from None
        variant = dataclasses.replace(variant, name=str(name))
    else:
        if name not in variants.names():
            raise ConfigError(f"{key}.name", choice_error("attention variant", name, names()))
        params = {k: v for k, v in attention.items() if k != "name"}
        try:
            registry.check_params("variant", name, params)
        except ParamError as err:
            raise ConfigError(f"{key}.{err.param}", err.detail) from None
        shape = {"shape.heads": heads}
        for param, (shape_key, why) in TIED_TO_SHAPE.items():
            if (
                param in params
                and shape[shape_key] is not None
                and params[param] != shape[shape_key]
            ):
                raise ConfigError(
                    f"{key}.{param}",
                    f"{params[param]!r} but {shape_key}={shape[shape_key]}; they must be equal "
                    f"({why}): set both alike, or leave {param} to follow {shape_key}",
                )
        try:
            variant = variants.get(name, **params)
        except (ValueError, TypeError) as err:
            message = str(err)
            bad = next((p for p in params if message.startswith(p)), None)
            raise ConfigError(f"{key}.{bad}" if bad else key, message) from None
    if seq_len is not None and variant.seq_len is not None and variant.seq_len != seq_len:
        what = {"document": "doc_lengths", "natten": "canvas_w"}.get(str(name))
        detail = f"{dict(variant.params)}" if what is None else f"{attention.get(what)!r}"
        hint = {
            "doc_lengths": "the document lengths must sum to shape.seq_len",
            "canvas_w": "canvas_w * canvas_h must equal shape.seq_len",
        }.get(what, "the variant is built for another length")
        raise ConfigError(
            f"{key}.{what}" if what else key,
            f"{detail} describes {variant.seq_len} tokens but shape.seq_len={seq_len}; {hint}",
        )
    return variant


def with_documents(attention: Mapping[str, Any], lengths: Sequence[int], *,
                   key: str = "attention") -> dict[str, Any]:  # fmt: skip
    """The attention entry with its documents replaced by `lengths` (a workload's batch): the
    document variant's doc_lengths, your own factory's `doc_lengths` argument (where it takes
    one: custom.with_documents), in a composed entry every part that has documents.

    Raises:
        ConfigError: (workload) the entry has no documents to replace.
    """
    if "compose" in attention:
        parts, found = [], False
        for part in attention["compose"]:
            try:
                parts.append(with_documents(part, lengths, key=key))
                found = True
            except ConfigError:
                parts.append(dict(part))
        if found:
            return {**attention, "compose": parts}
    elif attention.get("name") == "document":
        return {**attention, "doc_lengths": list(lengths)}
    elif attention.get("name") == custom.NAME:
        entry = custom.with_documents(attention, list(lengths))
        if entry is not None:
            return entry
    raise ConfigError(
        "workload",
        f"{key} {attention.get('name')!r} has no documents for a workload's batches to set: use "
        f"attention=document, compose it with your mask, or a mask factory that takes "
        f"{custom.DOCUMENTS_PARAM}",
    )
