"""The metric tables of the docs, rendered from attngym.metrics.METRICS.

    python scripts/render_metrics.py           # rewrite the pages' metric tables from the table
    python scripts/render_metrics.py --check   # exit 1, naming the page, where they differ

METRICS is the one home of a metric's name, label, unit and meaning; its rows are grouped by the
comments written over them in attngym/metrics.py, and each group becomes a section of a page
between `<!-- metrics -->` and `<!-- /metrics -->` (the text around the markers is the page's
own). A group goes to the page of PAGES whose prefixes its comment starts with, else to
docs/metrics.md; tests/test_metrics.py runs --check, so a row added to METRICS without rendering
fails the suite.
"""

from __future__ import annotations

import argparse
import io
import re
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "attngym" / "metrics.py"
DOCS = ROOT / "docs"
MAIN = DOCS / "metrics.md"
# Pages other than MAIN, and the groups (by the start of their comment) each holds.
PAGES = {
    DOCS / "metrics-cp.md": (
        "Context parallelism",
        "Simulated ranks",
        "PyTorch's own flex context parallelism",
    ),
    DOCS / "metrics-limits.md": ("How near the device's limit",),
    DOCS / "workloads.md": ("A workload",),
}
_BLOCK = re.compile(r"(<!-- metrics -->\n)(.*?)(<!-- /metrics -->)", re.DOTALL)


def groups() -> list[tuple[str, list]]:
    """(the comment over a run of rows, the rows) in METRICS' order: each row found by the name
    its `M(` call gives first, so every row of the table lands in exactly one group."""
    if str(ROOT) not in sys.path:  # run as a script: the repository's attngym
        sys.path.insert(0, str(ROOT))
    from attngym.metrics import METRICS

    text = SOURCE.read_text()
    start = text.index("METRICS: tuple[Metric, ...] = (")
    body = text[start : text.index("\ndel M\n", start)]
    found: list[tuple[str, list[str]]] = []
    tokens = list(tokenize.generate_tokens(io.StringIO(body).readline))
    for i, tok in enumerate(tokens):
        if tok.type == tokenize.COMMENT and tok.start[1] == 4:
            line = tok.string[1:].strip()
            if found and not found[-1][1]:  # a comment of several lines
                found[-1] = (f"{found[-1][0]} {line}", [])
            else:
                found.append((line, []))
        elif tok.type == tokenize.NAME and tok.string == "M" and tokens[i + 1].string == "(":
            name = next(t for t in tokens[i + 2 :] if t.type == tokenize.STRING)
            found[-1][1].append(eval(name.string))  # a string literal
    rows = {m.name: m for m in METRICS}
    grouped = [(title, [rows[n] for n in names]) for title, names in found]
    listed = [m.name for _, ms in grouped for m in ms]
    assert listed == [m.name for m in METRICS], "a row of METRICS outside the groups"
    return grouped


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def section(title: str, rows: list) -> str:
    """A group as a heading (its comment up to the first `(`, `:` or `.`), the rest of the
    comment where there is more, and a table of its rows."""
    head = re.split(r" \(|:|\.", title, maxsplit=1)[0]
    lines = [f"### {head}", ""]
    if title.rstrip(".") != head:
        lines += [title, ""]
    lines += ["| name | label | unit | meaning |", "|---|---|---|---|"]
    for m in rows:
        lines.append(f"| `{m.name}` | {_cell(m.label)} | {m.unit} | {_cell(m.meaning)} |")
    return "\n".join(lines)


def page_of(title: str) -> Path:
    return next((page for page, starts in PAGES.items() if title.startswith(starts)), MAIN)


def rendered() -> dict[Path, str]:
    """Each page's block of sections, rendered from METRICS."""
    blocks: dict[Path, list[str]] = {page: [] for page in (MAIN, *PAGES)}
    for title, rows in groups():
        blocks[page_of(title)].append(section(title, rows))
    return {page: "\n\n".join(parts) + "\n" for page, parts in blocks.items()}


def render(text: str, block: str) -> str:
    if not _BLOCK.search(text):
        raise ValueError("the page has no <!-- metrics --> block")
    return _BLOCK.sub(lambda m: f"{m[1]}{block}{m[3]}", text)


def stale() -> list[str]:
    """The pages whose metric block differs from METRICS."""
    return [
        str(page.relative_to(ROOT))
        for page, block in rendered().items()
        if render(text := page.read_text(), block) != text
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 where a page is stale")
    args = parser.parse_args(argv)
    if args.check:
        if pages := stale():
            names = ", ".join(pages)
            print(f"stale: {names}: run python scripts/render_metrics.py", file=sys.stderr)
            return 1
        return 0
    for page, block in rendered().items():
        page.write_text(render(page.read_text(), block))
    return 0


if __name__ == "__main__":
    sys.exit(main())
