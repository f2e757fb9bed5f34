"""The variant catalogue: `get(name, **params)`, `names()`, `compose(*variants)`.

Each family module registers its factories when imported; importing this package imports every
module of it (`_NOT_FAMILIES` aside), so the catalogue never depends on which module a caller
happened to import first, and a new family needs no line here.
"""

import importlib as _importlib
import pkgutil as _pkgutil

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

# Every module of this package is a variant family, but the catalogue's own machinery and the
# adapters your configs name by path: a new family is a new module, imported here by itself.
_NOT_FAMILIES = {"base", "spec", "custom", "gym"}
for _module in _pkgutil.iter_modules(__path__):
    if _module.name not in _NOT_FAMILIES:
        _importlib.import_module(f"{__name__}.{_module.name}")


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
