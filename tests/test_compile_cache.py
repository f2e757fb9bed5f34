"""attngym.compile_cache: torch.compile's caches in the folder the config names."""

from __future__ import annotations

import os

import pytest

from attngym import compile_cache


@pytest.fixture
def clean_env(monkeypatch):
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_COMPILE_THREADS"):
        monkeypatch.delenv(name, raising=False)
    import torch._inductor.config as inductor_config

    threads = inductor_config.compile_threads
    yield monkeypatch
    inductor_config.compile_threads = threads


def test_auto_is_under_the_xdg_cache(clean_env, tmp_path):
    clean_env.setenv("XDG_CACHE_HOME", str(tmp_path))
    out = compile_cache.use("auto", 1)
    assert out == {"compile_cache": str(tmp_path / "attngym" / "compile")}
    assert (tmp_path / "attngym" / "compile").is_dir()
    assert os.environ["TORCHINDUCTOR_COMPILE_THREADS"] == "1"
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    assert cache_dir() == str(tmp_path / "attngym" / "compile")  # where Inductor now writes


def test_a_folder_the_user_chose_for_pytorch_wins(clean_env, tmp_path):
    clean_env.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert compile_cache.use(str(tmp_path / "attngym"), None) == {
        "compile_cache": str(tmp_path / "mine")
    }


def test_null_leaves_pytorchs_place(clean_env):
    assert compile_cache.folder(None) is None
    assert compile_cache.use(None, None)["compile_cache"] in (
        "PyTorch's default",
        os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
    )


def test_bad_compile_threads_is_one_line_naming_the_key():
    from attngym.errors import ConfigError
    from attngym.runner.config import from_config

    with pytest.raises(ConfigError, match="compile_threads.*positive integer or null"):
        from_config({"attention": {"name": "causal"}, "compile_threads": 0})
