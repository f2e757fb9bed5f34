"""The variant catalogue: `get(name, **params)`, `names()`, `compose(*variants)`.

Each family module registers its factories when imported; importing this package imports them all,
so the catalogue never depends on which module a caller happened to import first.
"""

from attngym.variants import (  # noqa: F401  (imported to register their factories)
    alibi,
    block_diffusion,
    causal,
    chunked_causal,
    document,
    global_sliding_window,
    natten,
    prefix_lm,
    relative_position,
    shared_prefix,
    sinks,
    sliding_window,
    softcap,
)
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
