"""report.html is self-contained: the table, the plot and every picture inline, nothing fetched."""

from __future__ import annotations

import base64
import re

import pytest

from attngym.runner import report
from attngym.runner.tracking import write_metrics


def _png(path, value):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(2, 2))
    ax.plot([0, 1], [0, value])
    fig.savefig(path)
    plt.close(fig)


@pytest.fixture
def sweep(tmp_path):
    """A sweep folder as Hydra leaves it: two ok jobs with pictures, one failed job."""
    rows = [
        {"status": "ok", "variant": "causal", "device": "cpu", "seq_len": 64, "fwd_ms": 1.5},
        {"status": "ok", "variant": "causal", "device": "cpu", "seq_len": 128, "fwd_ms": 2.5},
        {"status": "failed", "error": "shape.heads: must be a positive integer, got 0"},
    ]
    for i, metrics in enumerate(rows):
        job = tmp_path / str(i)
        (job / ".hydra").mkdir(parents=True)
        (job / ".hydra" / "overrides.yaml").write_text(f"- shape.seq_len={64 * (i + 1)}\n")
        write_metrics(job, metrics)
        if metrics["status"] == "ok":
            _png(job / "heatmap.png", i + 1)
            _png(job / "block_mask.png", i + 2)
    return tmp_path


def test_report_is_self_contained(sweep):
    assert report.main([str(sweep)]) == 0
    text = (sweep / "report.html").read_text()
    assert "3 run(s), 1 failed" in text
    assert "shape.heads: must be a positive integer, got 0" in text
    assert "<td>1.50</td>" in text and "<td>2.50</td>" in text  # ms to 3 significant figures
    assert "position: sticky" in text and "overflow: auto" in text  # header stays, table scrolls
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', text)
    assert len(images) == 5  # the plot + 2 pictures x 2 ok jobs
    assert all(base64.b64decode(i)[:4] == b"\x89PNG" for i in images)
    assert text.count('<label class="zoom"') == 5  # every picture enlarges on click
    assert not re.search(r"(src|href)=\"(https?:|/|\.)", text)  # nothing outside the file


def test_report_of_one_run(sweep):
    path = report.write_report(sweep / "0", sweep / "one.html")
    text = path.read_text()
    assert "attngym run 0" in text and text.count("data:image/png;base64,") == 2


def test_report_refuses_empty_folder(tmp_path, capsys):
    assert report.main([str(tmp_path)]) == 2
    assert "holds no attngym run" in capsys.readouterr().err


def test_report_columns_carry_the_metric_table_and_typed_overrides(sweep):
    from attngym.metrics import describe

    hydra_form = "- ++attention.window_size=16\n- block_size='64'\n- shape.seq_len=64\n"
    (sweep / "0" / ".hydra" / "overrides.yaml").write_text(hydra_form)
    text = report.build_report(sweep)
    assert f'<th title="{describe("fwd_ms")}">fwd_<wbr>ms</th>' in text  # wraps there
    assert "fwd (ms) [ms]: forward time" in describe("fwd_ms")
    assert "attention.window_size=16" in text and "block_size=64" in text
    assert "++attention" not in text and "&#x27;64&#x27;" not in text
