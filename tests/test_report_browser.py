"""report.html in a real headless browser: it renders, every picture loads, nothing overflows the
window, failures show first and in their card, and the heatmaps are drawn large enough to read.

The page itself has no script; the test injects one into a copy, which records what the browser
laid out into the DOM that `--dump-dom` prints. Skipped where no Chromium is installed (CI
installs it: .ci/run).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from attngym import variants, viz
from attngym.runner import report
from attngym.runner.tracking import write_metrics

BROWSER = next(
    (p for name in ("chromium", "chromium-browser", "google-chrome") if (p := shutil.which(name))),
    None,
)
pytestmark = pytest.mark.skipif(BROWSER is None, reason="no Chromium on this machine")

WIDTH = 1400  # a laptop's browser window, the width the issue was seen at
PROBE = """<script>
window.addEventListener("load", () => {
  const view = document.documentElement.clientWidth;
  const right = (e) => e.getBoundingClientRect().right;
  const images = [...document.images];
  const heatmaps = [...document.querySelectorAll("img.heatmap")];
  const failures = document.querySelector(".failures");
  const table = document.querySelector(".table-wrap");
  document.body.dataset.probe = JSON.stringify({
    images: images.length,
    broken: images.filter((i) => !(i.complete && i.naturalWidth > 0)).length,
    page_overflows: document.documentElement.scrollWidth > view + 1,
    sticking_out: [...document.querySelectorAll("body > *, .card, .card *")]
      .filter((e) => right(e) > view + 1).map((e) => e.className || e.tagName),
    failures_above_table: !!failures && failures.getBoundingClientRect().bottom
      <= table.getBoundingClientRect().top,
    failed_card: [...document.querySelectorAll(".card.failed .error")].map((e) => e.textContent),
    heatmap_px: heatmaps.map((i) => i.getBoundingClientRect().width),
  });
});
</script>"""


@pytest.fixture
def sweep(tmp_path):
    """Two ok jobs with the pictures a run draws, one failed job with a long error."""
    error = "validation failed: err_out_rel=0.31 > 0.016 (bfloat16) " + "x" * 300
    jobs = [("sliding_window", {"window_size": 64}), ("document", {"doc_lengths": [100, 156]})]
    for i, (name, params) in enumerate([*jobs, ("causal", {})]):
        job = tmp_path / str(i)
        (job / ".hydra").mkdir(parents=True)
        (job / ".hydra" / "overrides.yaml").write_text(f"- attention={name}\n")
        ok = i < len(jobs)
        metrics = {"status": "ok" if ok else "failed", "variant": name, "seq_len": 256}
        metrics.update(device="cpu", fwd_ms=1.0 + i)
        write_metrics(job, metrics if ok else {**metrics, "error": error})
        if ok:
            variant = variants.get(name, **params)
            viz.save_heatmap(variant, job / "heatmap.png", seq_len=256, window=64)
            viz.save_block_mask_picture(
                variant.mask_mod, 256, 256, job / "block_mask.png", block_size=(16, 16)
            )
    return tmp_path


def _laid_out(page, tmp_path) -> dict:
    probed = tmp_path / "probed.html"
    probed.write_text(page.read_text().replace("</body>", PROBE + "</body>"))
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}",
        f"--window-size={WIDTH},900",
        "--virtual-time-budget=5000",
        "--dump-dom",
    ]
    dom = subprocess.run(
        [BROWSER, *flags, probed.as_uri()], capture_output=True, text=True, timeout=120
    ).stdout
    found = re.search(r'data-probe="([^"]*)"', dom)
    assert found, f"the page did not finish loading in the browser: {dom[:500]!r}"
    return json.loads(found.group(1).replace("&quot;", '"').replace("&amp;", "&"))


def test_report_renders_in_a_browser(sweep, tmp_path):
    assert report.main([str(sweep)]) == 0
    seen = _laid_out(sweep / "report.html", tmp_path)
    assert seen["images"] == 5 and seen["broken"] == 0  # the plot and 2 pictures x 2 jobs
    assert not seen["page_overflows"] and seen["sticking_out"] == []
    assert seen["failures_above_table"]
    assert len(seen["failed_card"]) == 1 and "err_out_rel=0.31" in seen["failed_card"][0]
    assert all(width >= 900 for width in seen["heatmap_px"]), seen["heatmap_px"]
