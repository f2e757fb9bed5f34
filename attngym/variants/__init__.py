"""The variant catalogue: `get(name, **params)`, `names()`, `compose(*variants)`.

Each family module registers its factories when imported; importing this package imports them all.
"""

from attngym.variants import causal  # noqa: F401,E402  (registers full, causal)
from attngym.variants.base import (
    MaskMod,
    ScoreMod,
    Variant,
    check_params,
    compose,
    factory,
    get,
    names,
    register,
)

__all__ = [
    "MaskMod",
    "ScoreMod",
    "Variant",
    "check_params",
    "compose",
    "factory",
    "get",
    "names",
    "register",
]
