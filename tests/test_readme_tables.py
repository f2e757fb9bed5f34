"""The result tables of docs/results.md are the data's: rendered by scripts/render_tables.py,
never edited by hand, each with the date, commit and device of its measurement."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import render_tables  # noqa: E402


def test_every_table_of_the_results_page_is_rendered_from_its_data():
    text = render_tables.PAGE.read_text()
    names = [m[2] for m in render_tables._BLOCK.finditer(text)]
    assert sorted(names) == sorted(render_tables.TABLES)  # each table once
    assert render_tables.stale(text) == [], "run: python scripts/render_tables.py"


def test_a_table_edited_by_hand_or_data_changed_is_stale():
    text = render_tables.PAGE.read_text()
    edited = text.replace("| causal 128K | 160.2 (0.95)", "| causal 128K | 150.2 (0.99)")
    assert edited != text
    assert render_tables.stale(edited) == ["two_gpu_cp"]
    assert render_tables.main(["--check"]) == 0


def test_every_caption_names_its_date_and_commit():
    for name, render in render_tables.TABLES.items():
        caption = " ".join(render().split("\n\n")[-1].split())
        assert "2026-" in caption and "commit" in caption, (name, caption)
