"""A W&B Report for a sweep synced to W&B: `attngym report DIR --wandb ENTITY/PROJECT`.

Built with the wandb-workspaces library (`pip install "attngym[report]"`), imported only here. The
report reads the runs of one sweep, selected by their W&B group (attngym's group is the sweep
folder's `<date>_<time>` name, see attngym.runner.tracking.wandb_logger): TFLOP/s against seq_len
per variant, the speed-ups against the best SDPA, a runs table and the heatmap and block-mask media.

Saving needs network and `wandb login`. Without them (or when saving fails) the report's
definition, the model the library serialises, is written to `<DIR>/wandb_report.json` instead and
`NotPublished` says so and how to publish it later: the same command, once online.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from attngym.fileio import atomic_write

DEFINITION = "wandb_report.json"
# Config keys of the resolved config (nested in W&B: attention.name is the variant).
VARIANT = "attention.name"
SEQ_LEN = "seq_len"
PASSES = ("fwd", "fwd_bwd")
MEDIA = ("heatmap", "block_mask")


def sweep_group(folder: Path) -> str:
    """The W&B group of a sweep (or run) folder `.../<date>/<time>`: "<date>_<time>"."""
    folder = Path(folder).resolve()
    return f"{folder.parent.name}_{folder.name}"


def _library() -> Any:
    try:
        import wandb_workspaces.reports.v2 as wr
    except ImportError as err:
        raise ImportError(
            f"--wandb needs wandb-workspaces ({err}); install it: pip install 'attngym[report]'"
            " (in a clone of attngym: pip install -e '.[report]')"
        ) from err
    return wr


def build_report(folder: Path, entity: str, project: str) -> Any:
    """The Report (wandb_workspaces.reports.v2.Report) for the sweep in `folder`; no network."""
    wr = _library()

    group = sweep_group(folder)
    runset = wr.Runset(name=f"sweep {group}", filters=f"Group == '{group}'")
    variant = wr.Config(VARIANT)
    throughput = [
        wr.LinePlot(
            title=f"{p} TFLOP/s against seq_len, per variant",
            x=SEQ_LEN,
            y=[f"{p}_tflops"],
            groupby=variant,
            groupby_aggfunc="mean",
            groupby_rangefunc="minmax",
            title_x="seq_len",
            title_y=f"{p} TFLOP/s",
        )
        for p in PASSES
    ]
    speedups = wr.BarPlot(
        title="flex over the best SDPA (time ratio, above 1: flex faster)",
        metrics=[wr.SummaryMetric(f"flex_over_best_sdpa_{p}") for p in PASSES],
        groupby=variant,
        groupby_aggfunc="mean",
    )
    media = [wr.MediaBrowser(title=name, media_keys=[name], num_columns=4) for name in MEDIA]
    return wr.Report(
        project=project,
        entity=entity,
        title=f"attngym sweep {group}",
        description=f"FlexAttention runs of W&B group {group} (attngym report --wandb).",
        width="fluid",
        blocks=[
            wr.H1(f"attngym sweep {group}"),
            wr.P(
                "TFLOP/s use one FLOP count for flex and every contender; speed-ups are "
                "contender time / flex time."
            ),
            wr.H2("Throughput and speed-ups"),
            wr.PanelGrid(runsets=[runset], panels=[*throughput, speedups]),
            wr.H2("Runs"),
            wr.PanelGrid(runsets=[runset], panels=[wr.RunComparer(diff_only="split")]),
            wr.H2("Pictures: heatmap and block mask"),
            wr.PanelGrid(runsets=[runset], panels=media),
        ],
    )


def runsets(report: Any) -> list[Any]:
    """Every run set of the report's panel grids."""
    return [rs for block in report.blocks for rs in getattr(block, "runsets", [])]


def definition(report: Any) -> str:
    """The report as the JSON the library serialises (run sets not bound: no network)."""
    for rs in runsets(report):
        rs.entity, rs.project = "", ""
    return report._to_model().model_dump_json(by_alias=True, exclude_none=True, indent=2)


class NotPublished(RuntimeError):
    """The report could not be saved to W&B; its definition was written to `path`."""

    def __init__(self, path: Path, message: str):
        self.path = path
        super().__init__(message)


def publish(folder: Path, target: str) -> str:
    """Save the report of `folder` to W&B `ENTITY/PROJECT` and return its URL.

    Raises:
        ValueError: `target` is not ENTITY/PROJECT.
        NotPublished: it could not be saved (no network, not logged in, no such project); the
            report's definition is written to the sweep folder and the message says how to
            publish it.
    """
    entity, _, project = target.partition("/")
    if not entity or not project or "/" in project:
        raise ValueError(f"--wandb takes ENTITY/PROJECT, got {target!r}")
    report = build_report(folder, entity, project)
    try:
        for rs in runsets(report):  # the library looks the project up while saving
            rs.entity, rs.project = entity, project
        report.save()
        return str(report.url)
    except Exception as err:  # no network, not logged in, no such project: keep it locally
        why = f"{type(err).__name__}: {err}"
    path = atomic_write(Path(folder) / DEFINITION, definition(report) + "\n")
    raise NotPublished(
        path,
        f"nothing was published to W&B ({why}); the report's definition is in {path}. To "
        f"publish it: sync the runs (wandb sync {folder}/*/wandb/offline-run-*), `wandb login`, "
        f"then run `attngym report {folder} --wandb {target}` again.",
    )
