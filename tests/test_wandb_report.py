"""The W&B Report of a sweep: its blocks and panels as the library builds them, offline."""

from __future__ import annotations

import json

import pytest

wr = pytest.importorskip("wandb_workspaces.reports.v2")

from attngym.runner import report  # noqa: E402
from attngym.runner.tracking import wandb_report  # noqa: E402


@pytest.fixture
def sweep(tmp_path):
    folder = tmp_path / "multirun" / "2026-11-30" / "12-00-00"
    folder.mkdir(parents=True)
    return folder


def _panels(built, kind):
    return [p for b in built.blocks if isinstance(b, wr.PanelGrid) for p in b.panels
            if isinstance(p, kind)]  # fmt: skip


def test_the_report_reads_the_sweeps_group_and_holds_every_panel(sweep):
    built = wandb_report.build_report(sweep, "team", "attngym")
    assert (built.entity, built.project) == ("team", "attngym")
    grids = [b for b in built.blocks if isinstance(b, wr.PanelGrid)]
    assert len(grids) == 3
    for grid in grids:  # every grid shows only this sweep's runs
        assert [rs.filters for rs in grid.runsets] == ["Group == '2026-11-30_12-00-00'"]
    lines = _panels(built, wr.LinePlot)
    assert [(p.x, p.y) for p in lines] == [
        ("seq_len", ["fwd_tflops"]),
        ("seq_len", ["fwd_bwd_tflops"]),
    ]
    assert all(p.groupby == wr.Config("attention.name") for p in lines)
    (bars,) = _panels(built, wr.BarPlot)
    assert bars.metrics == [
        wr.SummaryMetric("flex_over_best_sdpa_fwd"),
        wr.SummaryMetric("flex_over_best_sdpa_fwd_bwd"),
    ]
    assert len(_panels(built, wr.RunComparer)) == 1
    assert [p.media_keys for p in _panels(built, wr.MediaBrowser)] == [["heatmap"], ["block_mask"]]


def test_without_wandb_login_the_definition_is_written_and_publishing_explained(
    sweep, monkeypatch, capsys
):
    def offline(self, *args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr(wr.Report, "save", offline)
    with pytest.raises(wandb_report.NotPublished) as caught:
        wandb_report.publish(sweep, "team/attngym")
    assert caught.value.path == sweep / "wandb_report.json"
    assert "nothing was published" in str(caught.value)
    assert "--wandb team/attngym" in str(caught.value)
    written = json.loads((sweep / "wandb_report.json").read_text())
    assert written["project"] == {"name": "attngym", "entityName": "team"}
    grids = [b for b in written["spec"]["blocks"] if b["type"] == "panel-grid"]
    (run_filter,) = grids[0]["metadata"]["runSets"][0]["filters"]["filters"]
    assert run_filter["value"] == "2026-11-30_12-00-00"
    # The command says plainly that nothing was published, and exits non-zero.
    assert report.main([str(sweep), "--wandb", "team/attngym"]) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]  # an error, on stderr
    assert last.startswith("attngym report: error: nothing was published to W&B")


def test_report_cli_refuses_a_target_without_project(sweep, capsys):
    assert report.main([str(sweep), "--wandb", "team"]) == 2
    assert "ENTITY/PROJECT" in capsys.readouterr().err
