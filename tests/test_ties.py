"""Ties said as ties: every speed ratio carries its 95 % interval (`<ratio>_ci95`), summary.md,
report.html and the printed results mark a ratio whose interval holds 1 as a tie, and the tuner
takes a configuration only where its interval over FlexAttention's defaults clears 1.

The intervals' samples are built so that the answer does not hang on chance: one side a
shuffle of the other (equal medians: the interval holds 1 whatever the draws), or every call of
one side slower than every call of the other (every resampled ratio above 1).
"""

from __future__ import annotations

import csv
import json

import pytest
import torch

from attngym import bench, tuning
from attngym.metrics import ci95_metric, format_cell, is_tie, metric_of
from attngym.runner import report
from attngym.runner.tasks import phases
from attngym.runner.tracking.sweep import summarize, write_csv


def _times(rng: torch.Generator, n: int = 40) -> list[float]:
    return (1.0 + 0.2 * torch.rand(n, generator=rng, dtype=torch.float64)).tolist()


def test_the_interval_of_two_shuffles_of_one_sample_holds_1(rng):
    under = _times(rng)
    over = [under[i] for i in torch.randperm(len(under), generator=rng).tolist()]
    lo, hi = bench.ratio_ci95(over, under)
    assert lo < 1.0 < hi and is_tie([lo, hi])
    assert bench.ratio_ci95(over, under) == (lo, hi)  # a fixed seed: the same interval again


def test_the_interval_of_separated_samples_excludes_1(rng):
    under = _times(rng)
    over = [t + 0.5 for t in _times(rng)]  # every call slower than every call of `under`
    lo, hi = bench.ratio_ci95(over, under)
    ratio = (sorted(over)[20] + sorted(over)[19]) / (sorted(under)[20] + sorted(under)[19])
    assert 1.0 < lo <= ratio <= hi and not is_tie([lo, hi])
    assert bench.ratio_ci95(under, over)[1] < 1.0  # the other way round: below 1


@pytest.mark.parametrize("n", [5, 6, 41, 300])
def test_the_interval_is_the_bootstraps_percentiles_of_resampled_medians(rng, n):
    """ratio_ci95 counts order statistics instead of sorting each resample, and keeps a
    sample's resampled medians: it must draw the very interval the plain bootstrap does
    (quantile of each resample; the same seeded draws, a seed a side), ties among the calls
    included, and the same again when a side comes back in another ratio."""
    over, under = _times(rng, n), _times(rng, n)
    over[1] = over[0]

    def medians(sample, seed):
        gen = torch.Generator().manual_seed(seed)
        picks = torch.randint(n, (bench.CI_RESAMPLES, n), generator=gen)
        return torch.tensor(sample, dtype=torch.float64)[picks].quantile(0.5, dim=1)

    def plain(over, under):
        ratios = medians(over, bench.CI_SEED) / medians(under, bench.CI_SEED + 1)
        return torch.quantile(ratios, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()

    assert list(bench.ratio_ci95(over, under)) == plain(over, under)
    other = _times(rng, n)
    assert list(bench.ratio_ci95(other, under)) == plain(other, under)  # under's kept medians
    assert list(bench.ratio_ci95(under, over)) == plain(under, over)  # each side its own seed


def test_too_few_timed_calls_give_no_interval(rng):
    few = _times(rng, bench.MIN_CI_REPEATS - 1)
    assert bench.ratio_ci95(few, _times(rng)) is None
    assert bench.ratio_ci95(_times(rng), few) is None
    assert bench.ratio_ci95(_times(rng, bench.MIN_CI_REPEATS), _times(rng)) is not None


def test_phases_ratio_writes_the_ratio_and_its_interval(rng):
    under = bench.Timing.from_times(_times(rng))
    over = bench.Timing.from_times([t * 2 for t in _times(rng)])
    out = phases.ratio("flex_over_sdpa_fwd", over, under)
    assert set(out) == {"flex_over_sdpa_fwd", "flex_over_sdpa_fwd_ci95"}
    assert out["flex_over_sdpa_fwd"] == over.median_ms / under.median_ms
    lo, hi = out["flex_over_sdpa_fwd_ci95"]
    assert lo <= out["flex_over_sdpa_fwd"] <= hi and json.dumps(out)  # JSON as it is
    one = bench.Timing.from_times([1.0])
    assert phases.ratio("flex_over_sdpa_fwd", one, under)["flex_over_sdpa_fwd_ci95"] is None


def test_every_ratio_family_has_its_interval_documented():
    for ratio in ("flex_over_sdpa_fwd", "flex_over_best_fwd_bwd", "flex_over_flex_default_fwd",
                  "attngym_over_torch_cp_fwd_bwd"):  # fmt: skip
        row = metric_of(ci95_metric(ratio))
        assert row is not None and row.name.endswith("_ci95") and "95 %" in row.meaning


@pytest.mark.parametrize(
    ("interval", "tie"),
    [([0.97, 1.08], True), ([1.0, 1.2], True), ([1.01, 1.2], False), ([0.5, 0.9], False),
     ("[0.97, 1.08]", True), (None, False), ("", False), ([1.1], False)],
)  # fmt: skip
def test_a_tie_is_an_interval_that_holds_1(interval, tie):
    assert is_tie(interval) is tie
    row = {"flex_over_best_fwd": 1.03, "flex_over_best_fwd_ci95": interval}
    assert format_cell("flex_over_best_fwd", row) == ("1.03 (tie)" if tie else "1.03")


def test_an_efficiency_holding_1_is_no_tie():
    row = {"efficiency": 0.99, "efficiency_ci95": [0.97, 1.01]}
    assert metric_of("efficiency_ci95") is not None
    assert format_cell("efficiency", row) == "0.990"


def _sweep(tmp_path):
    """A sweep folder of two finished jobs, their metrics.json as runs write them: one ratio a
    tie, one a clear win, one with no interval (too few calls)."""
    sweep = tmp_path / "sweep"
    jobs = [
        {"flex_over_best_fwd": 1.03, "flex_over_best_fwd_ci95": [0.97, 1.09]},
        {"flex_over_best_fwd": 1.62, "flex_over_best_fwd_ci95": [1.51, 1.70]},
        {"flex_over_best_fwd": 0.81, "flex_over_best_fwd_ci95": None},
    ]
    for i, ratios in enumerate(jobs):
        job = sweep / str(i)
        (job / ".hydra").mkdir(parents=True)
        (job / ".hydra" / "overrides.yaml").write_text(f"- shape.seq_len={256 * (i + 1)}\n")
        metrics = {"status": "ok", "error": None, "variant": "causal", "validation": "ok",
                   "seq_len": 256 * (i + 1), "fwd_ms": 1.0 + i, **ratios}  # fmt: skip
        (job / "metrics.json").write_text(json.dumps(metrics))
    return sweep


def test_the_sweep_summary_marks_a_tie(tmp_path):
    sweep = _sweep(tmp_path)
    summarize(sweep)
    lines = (sweep / "summary.md").read_text().splitlines()
    header = next(i for i, line in enumerate(lines) if "flex_over_best_fwd" in line)
    column = [c.strip() for c in lines[header].strip("|").split("|")].index("flex_over_best_fwd")
    cells = [[c.strip() for c in line.strip("|").split("|")][column] for line in lines[header + 2:]
             if line.startswith("|")]  # fmt: skip
    assert cells == ["1.03 (tie)", "1.62", "0.810"]
    with (sweep / "summary.csv").open(newline="") as f:
        intervals = [row["flex_over_best_fwd_ci95"] for row in csv.DictReader(f)]
    assert json.loads(intervals[0]) == [0.97, 1.09] and intervals[2] == ""


def test_report_html_marks_a_tie(tmp_path):
    sweep = _sweep(tmp_path)
    page = report.write_report(sweep, tmp_path / "report.html").read_text()
    assert '<td class="tie">1.03 (tie)</td>' in page
    assert "<td>1.62</td>" in page and "1.62 (tie)" not in page
    assert "flex_over_best_fwd_ci95" not in page  # the interval is no column of its own


def _row(ms: str, interval: str | None, **over: str) -> dict[str, str]:
    row = {"capability": "9.0", "variant": "mine", "head_dim": "128", "seq_len": "8192",
           "status": "ok", "validation": "ok", "block_q": "64", "block_kv": "64",
           "fwd_bwd_ms": ms, "flex_default_fwd_bwd_ms": "2.0"}  # fmt: skip
    if interval is not None:
        row["flex_over_flex_default_fwd_bwd_ci95"] = interval
    return row | over


def test_the_tuner_takes_a_configuration_only_where_its_interval_clears_the_defaults(tmp_path):
    tied = _row("1.8", "[0.96, 1.25]")  # faster by the medians, but within the interval
    clear = _row("1.6", "[1.15, 1.4]", **{"kernel_options.fwd_num_warps": "8"})
    unknown = _row("1.5", "", **{"kernel_options.fwd_num_warps": "4"})  # too few calls
    entry = tuning.winners([tied, clear, unknown], "fwd_bwd_ms")["sm90"]["mine/d128"]
    assert entry["fwd_bwd_ms"] == 1.6 and entry["kernel_options"] == {"fwd_num_warps": 8}
    assert tuning.winners([tied, unknown], "fwd_bwd_ms") == {}
    assert tuning.winners([_row("1.8", None)], "fwd_bwd_ms") != {}  # a summary before intervals
    sweep = tmp_path / "study"
    sweep.mkdir()
    rows = [tied, unknown]
    write_csv(rows, sweep / "summary.csv")
    with pytest.raises(ValueError) as info:
        tuning.update(sweep, "fwd_bwd_ms", tmp_path / "t.json", skip_defaults=True)
    assert "\n" not in str(info.value)
    assert "2 faster by the median but not beyond the 95 % interval (a tie)" in str(info.value)


def test_the_printed_results_say_a_tie_and_not_how_much_slower(tmp_path):
    from attngym.results import format_results

    tie = {"status": "ok", "best_fwd": "sdpa", "flex_over_best_fwd": 0.98,
           "flex_over_best_fwd_ci95": [0.91, 1.04]}  # fmt: skip
    line = next(ln for ln in format_results(tie, tmp_path).splitlines() if "best (sdpa)" in ln)
    assert line.endswith("0.980 (tie)")
    slower = {**tie, "flex_over_best_fwd_ci95": [0.95, 0.99]}
    line = next(ln for ln in format_results(slower, tmp_path).splitlines() if "best (sdpa)" in ln)
    assert line.endswith("0.980 (1.02x slower)")
