"""`attngym report DIR`: one self-contained report.html for a sweep or a single run.

A report has to travel (attached to an issue, opened on a laptop without the cluster's
filesystem or any network), so everything is inline: the table as HTML, the sweep plot and every
job's heatmap and block-mask picture as base64 PNGs (a click enlarges one: pure CSS), no
scripts, no external styles. The table scrolls inside its frame under a sticky header, each
column headed by its metric name, with its label, unit and meaning (attngym.metrics) on hover.
It reads only files (summary rows are rebuilt from each job's metrics.json), so it works for any
launcher.

    attngym report multirun/2025-01-01/12-00-00
    python -m attngym.runner.report outputs/2025-01-01/12-00-00 --out my_report.html
"""

from __future__ import annotations

import argparse
import base64
import html
import logging
import os
import sys
from pathlib import Path
from typing import Any

from attngym.fileio import PNG_SIGNATURE, ReadRefused, atomic_write, read_inside, write_error

log = logging.getLogger(__name__)

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
.table-wrap { overflow: auto; max-height: 80vh; max-width: 100%; border: 1px solid #ccc; }
table { border-collapse: separate; border-spacing: 0; font-size: 13px; }
th, td { border-right: 1px solid #ddd; border-bottom: 1px solid #ddd; padding: 3px 6px;
         text-align: right; white-space: nowrap; }
th { background: #f0f0f0; position: sticky; top: 0; z-index: 1; text-align: center;
     white-space: normal; min-width: 4em; max-width: 9em; vertical-align: bottom; }
td.text { text-align: left; white-space: normal; min-width: 12em; }
td.error { text-align: left; white-space: normal; min-width: 30em; }
td.tie { color: #777; }
tr.failed td { background: #fde8e8; }
.failures { border: 2px solid #c0392b; background: #fde8e8; padding: 0.5em 1em;
            overflow-wrap: anywhere; }
.failures li { margin: 0.3em 0; }
.gallery { display: flex; flex-direction: column; gap: 1.5em; }
.card { border: 1px solid #ddd; padding: 0.5em; max-width: 1400px; }
.card.failed { border: 2px solid #c0392b; background: #fde8e8; }
.card .error { white-space: pre-wrap; overflow-wrap: anywhere; font-family: monospace; }
.pictures { display: flex; flex-wrap: wrap; gap: 0.5em; align-items: flex-start; }
.zoom { display: block; cursor: zoom-in; max-width: 100%; }
.zoom input { display: none; }
.zoom img { max-width: 100%; margin: 2px; }
.zoom img.heatmap { width: min(1100px, 100%); }
.zoom img.block_mask { width: min(520px, 100%); }
.zoom img.plot { max-width: min(900px, 100%); }
.zoom input:checked + img { position: fixed; inset: 0; margin: auto; max-width: 98vw;
                            max-height: 98vh; z-index: 10; cursor: zoom-out;
                            box-shadow: 0 0 0 100vmax rgba(0, 0, 0, 0.7); background: #fff; }
"""


# Far above a real picture (a heatmap is well under 1 MiB): a larger file is not embedded.
PICTURE_LIMIT = 32 << 20


def _picture(folder: Path, relative: str | Path) -> bytes | None:
    """A picture's bytes, read only as a regular file inside the report's folder that no other
    name links to and that is a PNG: a symlink or a hard link (either could be any file, and
    report.html is meant to be shared), a FIFO, an oversized file or one that is no PNG is
    skipped with a warning naming it. None when missing or skipped."""
    try:
        png = read_inside(folder, relative, PICTURE_LIMIT, one_link=True)
    except FileNotFoundError:
        return None
    except ReadRefused as err:
        log.warning("%s", err)
        return None
    if not png.startswith(PNG_SIGNATURE):
        log.warning("%s", ReadRefused(Path(folder) / relative, "not a PNG (no PNG signature)"))
        return None
    return png


def _img(png: bytes, alt: str, cls: str = "") -> str:
    """An inline picture that opens at full size on click (a CSS checkbox: no script)."""
    data = base64.b64encode(png).decode("ascii")
    return (
        f'<label class="zoom" title="click to enlarge"><input type="checkbox">'
        f'<img class="{cls}" alt="{html.escape(alt)}" src="data:image/png;base64,{data}"></label>'
    )


def _header(name: str) -> str:
    """A column's name that may wrap after its underscores (flex_over_best_sdpa_fwd), so the
    table fits a laptop's width."""
    return "_<wbr>".join(html.escape(part) for part in name.split("_"))


def _cell(key: str, row: dict[str, Any]) -> str:
    """A table cell: the value as format_cell reads it (a ratio whose interval holds 1 is a
    tie: "1.03 (tie)", in a cell of class tie)."""
    from attngym.metrics import format_cell

    text = format_cell(key, row)
    cls = {"overrides": "text", "variant": "text", "error": "error"}.get(key)
    cls = "tie" if text.endswith(" (tie)") else cls
    attr = f' class="{cls}"' if cls else ""
    return f"<td{attr}>{html.escape(text)}</td>"


def _rows(folder: Path) -> tuple[list[dict[str, Any]], list[Path], bool]:
    """(rows, job folders, is_sweep) for a sweep folder or a single run folder."""
    from attngym.runner.tracking.sweep import collect, job_dirs, job_row

    if _is_run(folder):
        return [job_row(folder, folder.name)], [folder], False
    return collect(folder), job_dirs(folder), True


def _outcome(row: dict[str, Any]) -> str:
    """`<status>: <error>` of a run that did not end ok."""
    return f"{row.get('status')}: {row.get('error') or 'no error recorded'}"


def _failures(rows: list[dict[str, Any]]) -> str:
    """The failed runs and their errors, first on the page (the table's error column is its
    last, off-screen on a laptop)."""
    failed = [row for row in rows if row.get("status") != "ok"]
    if not failed:
        return ""
    items = "".join(
        f"<li><b>{html.escape(str(row.get('job')))}</b> "
        f"<code>{html.escape(str(row.get('overrides') or ''))}</code>: "
        f"{html.escape(_outcome(row))}</li>"
        for row in failed
    )
    return f"<div class='failures'><b>{len(failed)} failed</b><ul>{items}</ul></div>"


def build_report(folder: str | Path) -> str:
    """The report's HTML for a sweep folder (job sub-folders) or a single run folder."""
    from attngym.metrics import CI_SUFFIX, describe, format_value
    from attngym.runner.pictures import PICTURES
    from attngym.runner.tracking.sweep import (
        headline,
        md_columns,
        plot_metric,
        plot_png,
        table_layout,
        without_shared_overrides,
        write_plot,
    )

    folder = Path(folder)
    rows, jobs, is_sweep = _rows(folder)
    if not rows:
        raise ValueError(f"{folder} holds no attngym run (no metrics.json, no job folders)")
    failed = sum(row.get("status") != "ok" for row in rows)
    rows, shared_overrides = without_shared_overrides(rows)
    title = f"attngym {'sweep' if is_sweep else 'run'} {folder.name}"

    extra = sorted(
        {
            k
            for row in rows
            for k in row
            if k.startswith("flex_over_") and not k.endswith(CI_SUFFIX) and row[k] is not None
        }
    )
    names = [c for c in md_columns() if c != "error"]  # errors: the failures box, the cards
    names += [c for c in extra if c not in names]  # every ratio
    columns, shared = table_layout(rows, names)
    columns.sort(key=lambda c: not headline(c))  # what a reader looks at first, on screen
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>{html.escape(title)}</title><style>{STYLE}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f"<p>{len(rows)} run(s), {failed} failed. Folder: <code>{html.escape(str(folder))}"
        "</code>. Errors are against the float64 dense reference on the validated rows.</p>",
        (
            f"<p>Overrides of every run: <code>{html.escape(shared_overrides)}</code></p>"
            if shared_overrides
            else ""
        ),
        (
            "<p>Every run: "
            + html.escape(", ".join(f"{k}={format_value(k, v)}" for k, v in shared.items()))
            + "</p>"
            if shared
            else ""
        ),
        _failures(rows),
        "<div class='table-wrap'><table><thead><tr>"
        + "".join(f'<th title="{html.escape(describe(c))}">{_header(c)}</th>' for c in columns)
        + "</tr></thead><tbody>",
    ]
    for row in rows:
        cls = "" if row.get("status") == "ok" else ' class="failed"'
        parts.append(f"<tr{cls}>" + "".join(_cell(c, row) for c in columns) + "</tr>")
    parts.append("</tbody></table></div>")

    if is_sweep:
        plot = _picture(folder, "summary.png")
        if plot is None and not os.path.lexists(folder / "summary.png"):
            write_plot(rows, folder / "summary.png", title)
            plot = _picture(folder, "summary.png")
        plot = plot or plot_png(rows, title)  # summary.png skipped: drawn for the page alone
        if plot is not None:
            _, label = plot_metric(rows)
            parts += [f"<h2>{html.escape(label)}</h2>", _img(plot, label, "plot")]

    parts.append("<h2>Pictures</h2><div class='gallery'>")
    for row, job in zip(rows, jobs, strict=True):
        where = job.relative_to(folder) if is_sweep else Path()
        pictures = {
            Path(name).stem: png
            for name in PICTURES.values()
            if (png := _picture(folder, where / name)) is not None
        }
        caption = html.escape(f"{row['job']}: {row.get('overrides') or row.get('variant')}")
        body = "".join(_img(png, stem, stem) for stem, png in pictures.items())
        body = f"<div class='pictures'>{body}</div>" if body else ""
        if row.get("status") == "ok":
            body = body or "<p>(no pictures: the run's attngym.log says why)</p>"
            parts.append(f"<div class='card'><p><b>{caption}</b></p>{body}</div>")
        else:
            error = f"<p class='error'>{html.escape(_outcome(row))}</p>"
            parts.append(f"<div class='card failed'><p><b>{caption}</b></p>{error}{body}</div>")
    parts.append("</div></body></html>")
    return "\n".join(parts)


def write_report(folder: str | Path, out: str | Path | None = None) -> Path:
    """Write report.html (default: inside `folder`) and return its path.

    Raises:
        ValueError: `out` is no .html file, or lies inside a run folder other than as its
            report.html (it would overwrite the run's metrics.json or a picture).
    """
    folder = Path(folder)
    path = Path(out) if out is not None else folder / "report.html"
    _check_out(path)
    return atomic_write(path, build_report(folder))  # never half a page, never through a link


def _check_out(path: Path) -> None:
    """ValueError for a report path that would overwrite a run's files (write_report)."""
    if path.suffix != ".html":
        raise ValueError(f"--out {path}: a report is HTML; name a .html file")
    for parent in path.absolute().parents:
        if _is_run(parent) and path.absolute() != parent / "report.html":
            raise ValueError(
                f"--out {path}: inside the run folder {parent}, whose files it could overwrite; "
                f"write it outside, or as {parent / 'report.html'}"
            )


def _is_run(folder: Path) -> bool:
    """Whether `folder` is a run's folder (Hydra's .hydra, or a metrics.json)."""
    return (folder / ".hydra").is_dir() or os.path.lexists(folder / "metrics.json")


def main(argv: list[str] | None = None) -> int:
    """`attngym report DIR [--out FILE | --wandb ENTITY/PROJECT]`; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="attngym report",
        description="Write a self-contained report.html (table, plots, pictures inline) for a "
        "sweep folder (multirun/...) or a run folder (outputs/...).",
    )
    parser.add_argument("folder", type=Path, help="a sweep folder or a single run folder")
    parser.add_argument("--out", type=Path, default=None, help="default: FOLDER/report.html")
    parser.add_argument(
        "--wandb",
        metavar="ENTITY/PROJECT",
        help="instead: a W&B Report of the synced sweep (needs the [report] extra)",
    )
    args = parser.parse_args(argv)
    if not args.folder.is_dir():
        parser.error(f"folder {str(args.folder)!r} does not exist")
    if args.wandb:
        from attngym.runner.tracking.wandb_report import NotPublished, publish

        try:
            print(f"W&B report: {publish(args.folder, args.wandb)}")
        except (ValueError, ImportError) as err:
            print(f"attngym report: error: {err}", file=sys.stderr)
            return 2
        except NotPublished as err:
            print(f"attngym report: error: {err}", file=sys.stderr)
            return 1
        return 0
    try:
        path = write_report(args.folder, args.out)
    except ValueError as err:
        print(f"attngym report: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a full disk, a symlink where report.html goes
        print(f"attngym report: error: {write_error(err)}", file=sys.stderr)
        return 1
    print(f"report: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
