"""The tuned block-size / kernel-option table, and how a sweep's winners get into it.

`+experiment=block_size_sweep` times FlexAttention over block-mask block sizes and Triton kernel
options; `python -m attngym.tuning SWEEP_DIR` picks the fastest ok job per (GPU capability,
variant, head_dim) and writes it into `tuned.json` beside this file (checked in, small).
`block_size=tuned` reads it when a run starts: the entry's block size, and its kernel options
under the user's own `kernel_options` (an explicit option always wins). Where the table has no
entry the run keeps FlexAttention's defaults and logs that it did.

Lookup order within a capability ("sm90"): `<variant>/d<head_dim>`, `<variant>`,
`default/d<head_dim>`, `default`.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from attngym.fileio import atomic_write

log = logging.getLogger(__name__)

TABLE = Path(__file__).with_name("tuned.json")
DEFAULT_BLOCK_SIZE = (128, 128)
# Columns of summary.csv that hold kernel options (`kernel_options.<NAME>`), see attngym.tracking.
OPTION_PREFIX = "kernel_options."


def capability_key(capability: str | None) -> str | None:
    """ "9.0" → "sm90"; None (CPU) → None."""
    if not capability:
        return None
    major, minor = str(capability).split(".")[:2]
    return f"sm{major}{minor}"


def load(path: Path = TABLE) -> dict[str, Any]:
    """The table as a dict ({} when the file does not exist)."""
    return json.loads(path.read_text()) if path.exists() else {}


def lookup(
    variant: str, head_dim: int, capability: str | None, *, table: Mapping[str, Any] | None = None
) -> dict[str, Any] | None:
    """The tuned entry for this variant and head_dim on this GPU capability, or None.

    Returns:
        {"block_size": [q, kv], "kernel_options": {...}, ...} as stored, or None.
    """
    key = capability_key(capability)
    per_gpu = (load() if table is None else table).get(key or "", {})
    for name in (f"{variant}/d{head_dim}", variant, f"default/d{head_dim}", "default"):
        if name in per_gpu:
            return per_gpu[name]
    return None


def resolve(
    variant: str, head_dim: int, capability: str | None, kernel_options: Mapping[str, Any]
) -> tuple[tuple[int, int], dict[str, Any]]:
    """(block_size, kernel_options) for `block_size=tuned`; defaults (logged) without an entry."""
    entry = lookup(variant, head_dim, capability)
    if entry is None:
        log.warning(
            "block_size=tuned: no entry for %s (head_dim %d) on %s in %s; using the defaults %s",
            variant,
            head_dim,
            capability_key(capability) or "cpu",
            TABLE.name,
            DEFAULT_BLOCK_SIZE,
        )
        return DEFAULT_BLOCK_SIZE, dict(kernel_options)
    block_size = (int(entry["block_size"][0]), int(entry["block_size"][1]))
    options = {**entry.get("kernel_options", {}), **kernel_options}
    log.info("block_size=tuned: %s, kernel_options %s (%s)", block_size, options, entry["source"])
    return block_size, options


def _number(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"True": True, "False": False}.get(text, text)


def winners(rows: Sequence[Mapping[str, str]], metric: str) -> dict[str, dict[str, Any]]:
    """The fastest ok row per (capability, variant, head_dim) by `metric` (higher is better).

    Args:
        rows: summary.csv rows (strings), with columns capability, variant, head_dim, block_q,
            block_kv, status, `metric` and `kernel_options.<NAME>` ones.
        metric: e.g. "fwd_bwd_tflops" or "fwd_tflops".

    Returns:
        {"sm90": {"causal/d128": {"block_size": [...], "kernel_options": {...}, metric: x}}}.
    """
    best: dict[tuple[str, str], tuple[float, dict[str, Any]]] = {}
    for row in rows:
        value = row.get(metric)
        gpu = capability_key(row.get("capability"))
        if row.get("status") != "ok" or not value or not gpu:
            continue
        score = float(value)
        if math.isnan(score):
            continue
        options = {
            col[len(OPTION_PREFIX) :]: _number(v)
            for col, v in row.items()
            if col.startswith(OPTION_PREFIX) and v not in ("", None)
        }
        name = f"{row['variant']}/d{row['head_dim']}"
        entry = {
            "block_size": [int(row["block_q"]), int(row["block_kv"])],
            "kernel_options": options,
            metric: round(score, 2),
            "seq_len": int(row["seq_len"]),
        }
        if (gpu, name) not in best or score > best[(gpu, name)][0]:
            best[(gpu, name)] = (score, entry)
    table: dict[str, dict[str, Any]] = {}
    for (gpu, name), (_, entry) in sorted(best.items()):
        table.setdefault(gpu, {})[name] = entry
    return table


def update(sweep_dir: Path, metric: str, path: Path = TABLE) -> dict[str, Any]:
    """Merge the sweep's winners into the table at `path`; return the merged table."""
    summary = Path(sweep_dir) / "summary.csv"
    if not summary.exists():
        raise FileNotFoundError(f"{summary} not found: run the sweep (it writes summary.csv)")
    with summary.open(newline="") as f:
        found = winners(list(csv.DictReader(f)), metric)
    if not found:
        raise ValueError(f"no ok row with {metric!r} and a GPU capability in {summary}")
    table = load(path)
    for gpu, entries in found.items():
        for name, entry in entries.items():
            entry["source"] = f"{Path(sweep_dir).name}, best {metric}"
            table.setdefault(gpu, {})[name] = entry
    atomic_write(path, json.dumps(table, indent=2, sort_keys=True) + "\n")
    return table


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m attngym.tuning",
        description="Write a block-size sweep's winners into the tuned table (block_size=tuned).",
    )
    parser.add_argument("sweep_dir", type=Path, help="a multirun folder holding summary.csv")
    parser.add_argument("--metric", default="fwd_bwd_tflops", help="higher is better")
    parser.add_argument("--table", type=Path, default=TABLE, help="the table to update")
    args = parser.parse_args(argv)
    table = update(args.sweep_dir, args.metric, args.table)
    for gpu, entries in table.items():
        for name, entry in entries.items():
            print(f"{gpu} {name}: block_size {entry['block_size']} {entry['kernel_options']}")
    print(f"written: {args.table}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
