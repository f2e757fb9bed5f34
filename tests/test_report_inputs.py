"""What `attngym report` reads and where it writes: it embeds only pictures that are what their
name says and belong to the folder, and never writes its page over a run's files."""

from __future__ import annotations

import json
import os
import re

from test_report import _png

from attngym.runner import report
from attngym.runner.tracking import write_metrics


def _run(folder, with_pictures=True):
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "overrides.yaml").write_text("- shape.seq_len=64\n")
    write_metrics(folder, {"status": "ok", "variant": "causal", "seq_len": 64, "fwd_ms": 1.5})
    if with_pictures:
        _png(folder / "heatmap.png", 1)
        _png(folder / "block_mask.png", 2)
    return folder


def _embedded(page: str) -> int:
    return len(re.findall(r'src="data:image/png;base64,', page))


def test_a_hard_link_to_a_file_elsewhere_is_not_embedded(tmp_path, caplog):
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"\x89PNG\r\n\x1a\n" + b"the password is hunter2")  # even one signed PNG
    run = _run(tmp_path / "sw" / "0", with_pictures=False)
    _png(run / "block_mask.png", 2)
    os.link(secret, run / "heatmap.png")
    assert report.main([str(run)]) == 0
    page = (run / "report.html").read_text()
    assert _embedded(page) == 1  # the block mask alone
    assert "hunter2" not in page and "aHVudGVyMg" not in page  # nor its base64
    assert "heatmap.png: 2 names link to it (a hard link)" in caplog.text


def test_a_picture_that_is_no_png_is_not_embedded(tmp_path, caplog):
    run = _run(tmp_path / "0")
    (run / "heatmap.png").write_bytes(b"<svg onload=alert(1)>not a picture</svg>")
    assert report.main([str(run)]) == 0
    assert _embedded((run / "report.html").read_text()) == 1
    assert "heatmap.png: not a PNG (no PNG signature)" in caplog.text


def test_out_inside_a_run_folder_is_refused_and_nothing_is_overwritten(tmp_path, capsys):
    sweep = tmp_path / "sw"
    run = _run(sweep / "0")
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    for out in ("0/metrics.json", "0/heatmap.png", "0/mine.html", "0/.hydra/x.html"):
        assert report.main([str(sweep), "--out", str(sweep / out)]) == 2, out
        err = capsys.readouterr().err.strip()
        assert err.startswith("attngym report: error: --out ") and "\n" not in err, err
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before
    assert json.loads((run / "metrics.json").read_text())["status"] == "ok"
    # Where a report goes: the folder's report.html, a run's own report.html, elsewhere.
    assert report.main([str(sweep)]) == 0
    assert report.main([str(run), "--out", str(run / "report.html")]) == 0
    assert report.main([str(sweep), "--out", str(tmp_path / "mine.html")]) == 0
    assert report.main([str(sweep), "--out", str(sweep / "summary.csv")]) == 2  # the sweep's
