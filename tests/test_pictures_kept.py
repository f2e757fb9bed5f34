"""Pictures drawn once for a mask, shape and block size are kept in the cache folder and copied
by a run asked again (attngym.runner.pictures): the same bytes, no drawing; anything the
pictures depend on changed draws them anew."""

from __future__ import annotations

import pytest

from attngym.runner import pictures
from attngym.runner.config import Settings, Shape


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "attngym" / pictures.KEPT_FOLDER


def _settings(window: int = 32, seq_len: int = 256) -> Settings:
    return Settings(
        attention={"name": "sliding_window", "window_size": window},
        device="cpu",
        shape=Shape(seq_len=seq_len, heads=2, head_dim=16),
        block_size=(64, 64),
    )


def _draws(monkeypatch) -> list[str]:
    """The pictures viz draws from here on, by name."""
    from attngym import viz

    drawn: list[str] = []
    for name in ("save_heatmap", "save_block_mask_picture"):
        real = getattr(viz, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            drawn.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(viz, name, counted)
    return drawn


def test_a_run_asked_again_copies_the_pictures_it_drew(tmp_path, cache, monkeypatch):
    first, again = tmp_path / "first", tmp_path / "again"
    first.mkdir(), again.mkdir()
    metrics: dict = {}
    drawn = _draws(monkeypatch)
    pictures.draw_pictures(_settings(), first, code="abc", metrics=metrics)
    assert metrics["pictures_kept"] is False and len(drawn) == 2
    assert len(list(cache.iterdir())) == 1

    def no_block_mask(settings):
        raise AssertionError("a kept picture needs no block mask")

    monkeypatch.setattr(pictures, "_block_classes", no_block_mask)
    out = pictures.draw_pictures(_settings(), again, code="abc", metrics=metrics)
    assert metrics["pictures_kept"] is True and len(drawn) == 2  # nothing drawn
    for name, file in pictures.PICTURES.items():
        assert out[name] == again / file
        assert (again / file).read_bytes() == (first / file).read_bytes()


@pytest.mark.parametrize(
    "changed",
    [
        {"settings": _settings(window=48)},  # another mask
        {"settings": _settings(seq_len=512)},  # another length
        {"code": "def"},  # the user's mask code edited
    ],
    ids=["mask", "seq_len", "code"],
)
def test_anything_the_pictures_depend_on_draws_them_anew(tmp_path, cache, monkeypatch, changed):
    pictures.draw_pictures(_settings(), tmp_path, code="abc")
    drawn = _draws(monkeypatch)
    metrics: dict = {}
    again = tmp_path / "again"
    again.mkdir()
    pictures.draw_pictures(
        changed.get("settings", _settings()), again, code=changed.get("code", "abc"),
        metrics=metrics,
    )  # fmt: skip
    assert metrics["pictures_kept"] is False and len(drawn) == 2
    assert len(list(cache.iterdir())) == 2


def test_a_damaged_kept_picture_is_drawn_again_and_the_newest_are_kept(tmp_path, cache,
                                                                      monkeypatch):  # fmt: skip
    monkeypatch.setattr(pictures, "KEPT_PICTURES", 2)
    pictures.draw_pictures(_settings(), tmp_path, code="abc")
    (kept,) = cache.iterdir()
    (kept / pictures.PICTURES["heatmap"]).write_bytes(b"not a png")
    metrics: dict = {}
    pictures.draw_pictures(_settings(), tmp_path, code="abc", metrics=metrics)
    assert metrics["pictures_kept"] is False
    assert (kept / pictures.PICTURES["heatmap"]).read_bytes().startswith(b"\x89PNG")

    for window in (40, 48):  # two more questions: the oldest goes
        pictures.draw_pictures(_settings(window=window), tmp_path, code="abc")
    assert len(list(cache.iterdir())) == 2 and not kept.exists()
