"""A config entry becomes a Variant, or a ConfigError naming the offending key."""

from __future__ import annotations

import pytest

from attngym.errors import ConfigError
from attngym.variants.spec import build_variant


def test_build_variant_rejections_name_the_key():
    with pytest.raises(ConfigError) as info:
        build_variant({"name": "document", "doc_lengths": [10, 20]}, seq_len=64)
    assert info.value.key == "attention.doc_lengths" and "30" in str(info.value)
    assert build_variant({"name": "document", "doc_lengths": [40, 24]}, seq_len=64)
    with pytest.raises(ConfigError) as info:
        build_variant({"name": "gemma2", "compose": [{"name": "softcapp", "soft_cap": 1.0}]})
    assert info.value.key == "attention.compose.0.name"


def test_unknown_variant_parameter_suggests_the_closest():
    with pytest.raises(ConfigError) as info:
        build_variant({"name": "sliding_window", "window_siz": 3})
    assert info.value.key == "attention.window_siz"
    assert str(info.value).endswith("(did you mean 'window_size'?)")
    assert build_variant({"name": "sliding_window", "window_size": 3}).name
