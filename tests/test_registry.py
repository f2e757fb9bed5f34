"""One registry for every component kind, variants included, with one signature check."""

from __future__ import annotations

import pytest

from attngym import registry, variants
from attngym.registry import ParamError


def test_variants_are_a_registry_kind():
    assert registry.names("variant") == variants.names()
    assert "sliding_window" in variants.names()
    assert registry.get("variant", "sliding_window") is variants.factory("sliding_window")
    built = registry.build("variant", "sliding_window", window_size=8)
    assert built.name == "sliding_window" and built.params == {"window_size": 8}


def test_every_kind_loads_its_package():
    for kind in ("variant", "task", "transport", "profiler", "tracker"):
        assert registry.names(kind), kind
    with pytest.raises(ValueError, match="unknown component kind 'widget'"):
        registry.names("widget")


def test_unknown_names_suggest_the_closest():
    with pytest.raises(
        ValueError, match=r"unknown attention variant 'sliding_windw'.*'sliding_window'"
    ):
        variants.get("sliding_windw")
    with pytest.raises(ValueError, match=r"unknown tracker 'lokal'.*did you mean 'local'"):
        registry.get("tracker", "lokal")


def test_one_signature_check_for_variants_and_components(tmp_path):
    with pytest.raises(ParamError) as info:
        variants.get("sliding_window", window_siz=8)
    assert info.value.param == "window_siz"
    assert str(info.value) == (
        "variant 'sliding_window' has no parameter 'window_siz' (value 8); its parameters: "
        "window_size (did you mean 'window_size'?)"
    )
    with pytest.raises(ParamError, match="variant 'sliding_window' needs parameter 'window_size'"):
        variants.check_params("sliding_window", {})
    with pytest.raises(ParamError) as info:
        registry.build("profiler", "trace", run_dir=tmp_path, kernel_patern="x")
    assert info.value.param == "kernel_patern" and str(info.value).startswith("profiler 'trace'")
    with pytest.raises(ParamError, match="profiler 'trace' needs parameter 'run_dir'"):
        registry.build("profiler", "trace")
    registry.check_params("profiler", "trace", {"run_dir": tmp_path})  # accepted


def test_a_name_registers_once():
    with pytest.raises(RuntimeError, match="variant 'causal' registered twice"):
        variants.register("causal")(lambda: None)
    with pytest.raises(RuntimeError, match="tracker 'none' registered twice"):
        registry.register("tracker", "none")(lambda: None)
