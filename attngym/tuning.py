"""The tuned block-size / kernel-option tables, and how a sweep's winners get into them.

Two tables: the shipped one (`tuned.json` beside this file) and yours (`user_table()`, in the
cache folder, written by the tuner `+experiment=tune` at the end of each study's sweep; an entry
already better stays). `block_size=tuned` looks in yours first.

`+experiment=block_size_sweep` times FlexAttention over block-mask block sizes and Triton kernel
options; `python -m attngym.tuning SWEEP_DIR` picks the fastest ok job per (GPU capability,
variant, head_dim) and writes it into `tuned.json` beside this file (checked in, small).
`block_size=tuned` reads it when a run starts: the entry's block size, and its kernel options
under the user's own `kernel_options` (an explicit option always wins). Where the table has no
entry the run keeps FlexAttention's defaults and logs that it did.

Lookup order within a capability ("sm90"): `<variant>/d<head_dim>`, `<variant>`,
`default/d<head_dim>`, `default`.

A row that ran the `flex_default` baseline (FlexAttention's defaults, same process, same inputs;
the tuner runs it in every trial) wins only if it beats it, and beyond doubt: the 95 % interval of
its speed-up over them (`flex_over_flex_default_<pass>_ci95`) must lie above 1 (an interval that
holds 1 is a tie). Where nothing does, the defaults stay.

FLASH: a sweep run with `kernel_options.BACKEND=FLASH` gives an entry a `"flash"` part: the FLASH
block size and options and `over_triton`, FLASH's metric over the Triton part the entry would
otherwise run (the rows' Triton winner, else the row's own `flex_default`: the defaults).
`block_size=tuned` takes it only where flash-attn-4
is importable and `over_triton` > 1 (FLASH measured 0.72x Triton on the 256-token window, so
Triton stays there); otherwise the Triton part (or FlexAttention's defaults). It logs which
backend it took and why the other was not taken. An explicit `kernel_options.BACKEND` decides.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import logging
import math
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from attngym.fileio import atomic_write

log = logging.getLogger(__name__)

TABLE = Path(__file__).with_name("tuned.json")
DEFAULT_BLOCK_SIZE = (128, 128)
# Columns of summary.csv that hold kernel options (`kernel_options.<NAME>`), see
# attngym.runner.tracking.
OPTION_PREFIX = "kernel_options."
# Kernel options that set Triton flex's tiles, warps and stages (FLASH ignores them).
TRITON_TILE_OPTIONS = ("fwd_", "bwd_", "BLOCK_", "num_warps", "num_stages")
FLASH = "FLASH"
# The baseline whose columns (`flex_default_<metric>`) are the Triton reference of a FLASH row.
TRITON_REFERENCE = "flex_default"


def flash_missing() -> str | None:
    """Why FlexAttention's FLASH backend cannot import its kernels here: flash-attn-4's
    `flash_attn.cute`, or the CuTe DSL (`cutlass`, from nvidia-cutlass-dsl) that Inductor's
    generated FLASH code imports; None when both are found."""
    for module, package in (("flash_attn.cute", "flash-attn-4"), ("cutlass", "nvidia-cutlass-dsl")):
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # no parent package at all, or a broken one
            found = False
        if not found:
            return f"{module} ({package}) is not importable"
    return None


def flash_importable() -> bool:
    """Whether flash-attn-4 and the CuTe DSL it runs on are installed (`flash_missing`)."""
    return flash_missing() is None


def capability_key(capability: str | None) -> str:
    """ "9.0" → "sm90"; None (a CPU) → "cpu"."""
    if not capability:
        return "cpu"
    major, minor = str(capability).split(".")[:2]
    return f"sm{major}{minor}"


def user_table() -> Path:
    """Your own tuned table, outside the package: <cache folder>/tuned.json, written by the
    tuner (+experiment=tune) and read before the shipped one."""
    from attngym import compile_cache

    return compile_cache.root() / "tuned.json"


def load(path: Path = TABLE) -> dict[str, Any]:
    """The table as a dict ({} when the file does not exist)."""
    return json.loads(path.read_text()) if path.exists() else {}


def lookup(
    variant: str, head_dim: int, capability: str | None, *, table: Mapping[str, Any] | None = None
) -> dict[str, Any] | None:
    """The tuned entry for this variant and head_dim on this GPU capability (or "cpu"), or None:
    from `table`, else from your table (user_table) and then the shipped one, in that order.

    Returns:
        {"block_size": [q, kv], "kernel_options": {...}, ...} as stored, with "table": the file
        it came from when no `table` was given; or None.
    """
    key = capability_key(capability)
    names = (f"{variant}/d{head_dim}", variant, f"default/d{head_dim}", "default")
    if table is not None:
        return next((table[key][n] for n in names if n in table.get(key, {})), None)
    for path in (user_table(), TABLE):
        found = lookup(variant, head_dim, capability, table=load(path))
        if found is not None:
            return {**found, "table": str(path)}
    return None


def resolve(
    variant: str,
    head_dim: int,
    capability: str | None,
    kernel_options: Mapping[str, Any],
    *,
    dtype: str | None = None,
    topology: str = "single",
) -> tuple[tuple[int, int], dict[str, Any]]:
    """(block_size, kernel_options) for `block_size=tuned`; defaults (logged) without an entry.

    dtype and topology, where the caller gives them, keep FLASH's part out of runs it cannot do
    (a 32/64-bit dtype; context parallelism, which differentiates through the lse).
    """
    where = f"{variant} (head_dim {head_dim}) on {capability_key(capability)}"
    entry = lookup(variant, head_dim, capability)
    if entry is None:
        log.warning(
            "block_size=tuned: no entry for %s in %s or %s; using the defaults %s",
            where,
            user_table(),
            TABLE.name,
            DEFAULT_BLOCK_SIZE,
        )
        return DEFAULT_BLOCK_SIZE, dict(kernel_options)
    if dtype in ("float32", "float64"):
        flash_here = f"FLASH needs a 16-bit dtype, dtype={dtype}"
    elif topology != "single":
        flash_here = f"FLASH cannot back topology={topology}"
    else:
        flash_here = None if flash_importable() else "flash-attn-4 is not importable"
    chosen, why = choose_backend(entry, kernel_options.get("BACKEND"), flash_here)
    if chosen is None:
        log.info("block_size=tuned: %s; no Triton entry for %s, using the defaults", why, where)
        return DEFAULT_BLOCK_SIZE, dict(kernel_options)
    block_size = (int(chosen["block_size"][0]), int(chosen["block_size"][1]))
    options = {**chosen.get("kernel_options", {}), **kernel_options}
    log.info(
        "block_size=tuned: %s for %s: %s, kernel_options %s (%s)",
        why,
        where,
        block_size,
        options,
        f"{chosen.get('source', 'no source')} in {entry.get('table', TABLE.name)}",
    )
    return block_size, options


def choose_backend(
    entry: Mapping[str, Any], asked: str | None, flash_unavailable: str | None
) -> tuple[Mapping[str, Any] | None, str]:
    """The part of a table entry to use (its FLASH part or its Triton part) and why, in words.

    Args:
        entry: a table entry: Triton's `block_size`/`kernel_options` (optional) and an optional
            `"flash"` part with `over_triton`.
        asked: the user's `kernel_options.BACKEND`, if any: it decides.
        flash_unavailable: why FLASH cannot run here (e.g. "flash-attn-4 is not importable"),
            or None where it can.

    Returns:
        (part, reason): part is None where Triton is chosen and the entry has no Triton part.
    """
    flash = entry.get("flash")
    triton = entry if "block_size" in entry else None
    if asked is not None:
        if asked == FLASH and flash is not None:
            return flash, "FLASH (kernel_options.BACKEND=FLASH)"
        if asked == FLASH:
            return triton, "FLASH (kernel_options.BACKEND=FLASH) with the Triton entry's blocks"
        return triton, f"Triton (kernel_options.BACKEND={asked})"
    if flash is None:
        return triton, "Triton (FLASH not taken: no FLASH entry)"
    speedup = flash.get("over_triton")
    if speedup is None or speedup <= 1.0:
        measured = "not measured against Triton" if speedup is None else f"{speedup:.2f}x Triton"
        return triton, f"Triton (FLASH not taken: measured slower, {measured})"
    if flash_unavailable:
        return triton, (
            f"Triton (FLASH not taken: {flash_unavailable}; it measured {speedup:.2f}x Triton)"
        )
    return flash, f"FLASH (Triton not taken: FLASH measured {speedup:.2f}x Triton)"


# The tuner's block sizes for Triton trials (attngym.runner.tune_search); FLASH takes
# block_size=flash.
TUNED_BLOCK_SIZES = (64, 128)


def triton_block_sizes(cfg: Any) -> dict[str, list[int]]:
    """{"q": [...], "kv": [...]}: TUNED_BLOCK_SIZES less those no Triton backward tile divides
    on this GPU at this head_dim and dtype (an H200 at head_dim 128 has none for 64), where the
    run has a backward; constant for a study (its name holds the device), as Optuna needs."""
    from attngym.device import (
        auto_dtype,
        backward_tiles_fit,
        resolve_device,
        triton_backward_tiles,
    )

    sizes = {"q": list(TUNED_BLOCK_SIZES), "kv": list(TUNED_BLOCK_SIZES)}
    if "bwd" not in cfg.passes:
        return sizes
    device = resolve_device(cfg.device.name)
    dtype = auto_dtype(device.type) if cfg.dtype == "auto" else cfg.dtype
    autotune = str(cfg.compile_mode).startswith("max-autotune")
    tiles = triton_backward_tiles(cfg.shape.head_dim, dtype, device, autotune=autotune)
    if not tiles:
        return sizes
    return {
        side: [s for s in every if backward_tiles_fit(tiles, **{side: s})] or every
        for side, every in sizes.items()
    }


def _number(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"True": True, "False": False}.get(text, text)


def higher_is_better(metric: str) -> bool:
    """TFLOP/s and fractions: higher wins; times and energy (`_ms`, `_s`, joules): lower."""
    return not metric.endswith(("_ms", "_s", "_joules", "_joules_per_token"))


def _better(value: float, than: float, metric: str) -> bool:
    return value > than if higher_is_better(metric) else value < than


def interval_column(metric: str) -> str | None:
    """The summary.csv column of the interval a row's `metric` is judged by against the
    defaults of its run: `flex_over_flex_default_<pass>_ci95` of the metric's pass (None for a
    metric of no pass, such as first_call_s)."""
    part = next((p for p in ("fwd_bwd", "bwd", "fwd") if metric.startswith(f"{p}_")), None)
    return None if part is None else f"flex_over_{TRITON_REFERENCE}_{part}_ci95"


def _lower_bound(row: Mapping[str, str], metric: str) -> float | None:
    """The lower bound of the row's speed-up over the defaults of its run (interval_column);
    0.0 where the row has the column but no interval (too few timed calls: nothing is shown);
    None where it has no such column (a summary written before intervals, or no defaults)."""
    import json

    column = interval_column(metric)
    if column is None or column not in row or not row.get(f"{TRITON_REFERENCE}_{metric}"):
        return None
    try:
        lo, _ = json.loads(row[column] or "null") or (0.0, 0.0)
    except (ValueError, TypeError):
        return 0.0
    return float(lo)


def winners(
    rows: Sequence[Mapping[str, str]], metric: str, *, skip_defaults: bool = False
) -> dict[str, dict[str, Any]]:
    """The fastest ok, validated configuration per (capability or "cpu", variant, head_dim) by
    `metric` (higher_is_better says which way); rows of one configuration count by their median.

    A Triton row no better than its own `flex_default_<metric>` (FlexAttention's defaults in the
    same process) is no candidate: the table never holds what runs slower than the defaults. Nor
    is one whose speed-up over them is a tie: the median of its runs' interval lower bounds
    (`_lower_bound`) must be above 1 (rows without the interval column are judged by the
    medians alone).
    Rows run with `kernel_options.BACKEND=FLASH` compete apart and go under the entry's "flash"
    key, with `over_triton`: their metric over the Triton part the entry gets (the rows' Triton
    winner), else over the same row's `flex_default_<metric>` (what runs without a Triton part);
    a FLASH row with neither is skipped with a warning.

    Args:
        rows: summary.csv rows (strings), with columns capability, variant, head_dim, block_q,
            block_kv, status, `metric` and `kernel_options.<NAME>` ones.
        metric: e.g. "fwd_bwd_tflops" or "fwd_tflops".
        skip_defaults: rows of FlexAttention's defaults (is_default) are no candidates (the
            tuner, which asks what beats them; a block-size sweep may find them fastest).

    Returns:
        {"sm90": {"causal/d128": {"block_size": [...], "kernel_options": {...}, metric: x,
        "flash": {...}}}}; an entry holds only "flash" where the rows had no Triton winner.
    """
    # Rows of one configuration pool (a study repeats FLASH, whose tiles mean nothing): the
    # median of their metric against the median of their own defaults, so that one lucky
    # timing wins nothing (a FLASH window trial read 1.30 ms, its twin 2.32, the defaults 1.48).
    runs: dict[tuple[str, str, str, str], list[tuple[float, float | None, float | None]]] = {}
    entries: dict[tuple[str, str, str, str], dict[str, Any]] = {}
    for row in rows:
        value = row.get(metric)
        validated = str(row.get("validation") or "ok").startswith("ok")
        if row.get("status") != "ok" or not value or not validated or math.isnan(float(value)):
            continue
        options = {
            col[len(OPTION_PREFIX) :]: _number(v)
            for col, v in row.items()
            if col.startswith(OPTION_PREFIX) and v not in ("", None)
        }
        part = "flash" if options.get("BACKEND") == FLASH else "triton"
        if skip_defaults and part == "triton" and is_default(row, options):
            continue  # FlexAttention's defaults themselves: what the others must beat
        if part == "flash":  # FLASH picks its own tiles: a trial's Triton options meant nothing
            options = {k: v for k, v in options.items() if not k.startswith(TRITON_TILE_OPTIONS)}
        entry = {
            "block_size": [int(row["block_q"]), int(row["block_kv"])],
            "kernel_options": options,
            "seq_len": int(row["seq_len"]),
        }
        name = f"{row['variant']}/d{row['head_dim']}"
        key = (capability_key(row.get("capability")), name, part, json.dumps(entry, sort_keys=True))
        entries[key] = entry
        cell = row.get(f"{TRITON_REFERENCE}_{metric}")  # the defaults, same process
        lo = _lower_bound(row, metric)
        runs.setdefault(key, []).append((float(value), float(cell) if cell else None, lo))
    best: dict[tuple[str, str, str], tuple[float, dict[str, Any]]] = {}
    beaten: Counter[str] = Counter()  # Triton configurations no better than the defaults
    tied: Counter[str] = Counter()  # better by their medians, but within the interval
    for (gpu, name, part, config), measured_runs in runs.items():
        measured = statistics.median(m for m, _, _ in measured_runs)
        own = [d for _, d, _ in measured_runs if d is not None]
        lows = [lo for _, _, lo in measured_runs if lo is not None]
        defaults = statistics.median(own) if own else None
        entry = {**entries[(gpu, name, part, config)], metric: round(measured, 4)}
        if len(measured_runs) > 1:
            entry["runs"] = len(measured_runs)
        if part == "flash":
            entry["reference"] = defaults
        elif defaults is not None and not _better(measured, defaults, metric):
            beaten[name] += 1
            continue
        elif lows and not statistics.median(lows) > 1.0:
            tied[name] += 1
            continue
        score = measured if higher_is_better(metric) else -measured
        if (gpu, name, part) not in best or score > best[(gpu, name, part)][0]:
            best[(gpu, name, part)] = (score, entry)
    for (gpu, name, part), (_, entry) in list(best.items()):
        if part != "flash":
            continue
        # the Triton part this entry gets, else the defaults (flex_default, same process)
        reference = entry.pop("reference")
        if (gpu, name, "triton") in best:
            reference = best[(gpu, name, "triton")][1][metric]
        if reference is None:
            log.warning("FLASH row for %s has no Triton to compare with: skipped", name)
            del best[(gpu, name, part)]
            continue
        ratio = entry[metric] / reference
        entry["over_triton"] = round(ratio if higher_is_better(metric) else 1 / ratio, 3)
    for name, count in sorted(beaten.items()):
        log.info(
            "tuning: %d Triton row(s) of %s no faster than %s in their own run: not candidates",
            count,
            name,
            TRITON_REFERENCE,
        )
    for name, count in sorted(tied.items()):
        log.info(
            "tuning: %d Triton row(s) of %s faster than %s by their medians, but a tie within "
            "the 95 %% interval: not candidates",
            count,
            name,
            TRITON_REFERENCE,
        )
    table: dict[str, dict[str, Any]] = {}
    for (gpu, name, part), (_, entry) in sorted(best.items()):
        slot = table.setdefault(gpu, {}).setdefault(name, {})
        if part == "flash":
            slot["flash"] = entry
        else:
            slot.update(entry)
    return table


def is_default(row: Mapping[str, str], options: Mapping[str, Any]) -> bool:
    """Whether a Triton row ran FlexAttention's defaults: the default block size, no option."""
    blocks = (int(row["block_q"]), int(row["block_kv"]))
    return blocks == DEFAULT_BLOCK_SIZE and not {k for k in options if k != "BACKEND"}


def nothing_won(rows: Sequence[Mapping[str, str]], metric: str) -> str:
    """Why `winners` found nothing, in words: no trial ran, none validated, or none beat the
    defaults beyond the 95 % interval of its speed-up (with the best trial's and the defaults'
    medians, and how many were ties)."""
    ok = [r for r in rows if r.get("status") == "ok" and r.get(metric)]
    if not ok:
        return f"none of the {len(rows)} trials ran ok with {metric}"
    valid = [r for r in ok if str(r.get("validation") or "ok").startswith("ok")]
    if not valid:
        return f"none of the {len(ok)} trials that ran validated"
    best = min(valid, key=lambda r: float(r[metric]) * (-1 if higher_is_better(metric) else 1))
    defaults = [float(r[c]) for r in valid if (c := f"{TRITON_REFERENCE}_{metric}") and r.get(c)]
    against = f", FlexAttention's defaults {statistics.median(defaults):.4g}" if defaults else ""
    ties = sum(
        (lo := _lower_bound(r, metric)) is not None
        and lo <= 1.0
        and _better(float(r[metric]), float(r[f"{TRITON_REFERENCE}_{metric}"]), metric)
        for r in valid
    )
    tie = f"; {ties} faster by the median but not beyond the 95 % interval (a tie)" if ties else ""
    return (
        f"no configuration of {len(valid)} validated trials beat FlexAttention's defaults in "
        f"its own run beyond the 95 % interval (best {metric} {float(best[metric]):.4g}"
        f"{against}{tie}): the defaults stay"
    )


def update(
    source: Path,
    metric: str,
    path: Path = TABLE,
    *,
    keep_better: bool = False,
    skip_defaults: bool = False,
) -> dict[str, Any]:
    """Merge the winners of `source` (a sweep folder holding summary.csv, or a CSV file) into
    the table at `path`; return the merged table. Each part (Triton, FLASH) replaces only its own
    kind: a FLASH measurement keeps an entry's Triton winner and the other way round.
    `keep_better`: an entry already holding a better `metric` stays (the tuner's study goes on
    over several sweeps). `skip_defaults`: as in `winners`; where nothing wins, the ValueError
    says why (nothing_won)."""
    source = Path(source)
    summary = source if source.suffix == ".csv" else source / "summary.csv"
    if not summary.exists():
        raise FileNotFoundError(f"{summary} not found: run the sweep (it writes summary.csv)")
    with summary.open(newline="") as f:
        rows = list(csv.DictReader(f))
    found = winners(rows, metric, skip_defaults=skip_defaults)
    if not found:
        raise ValueError(nothing_won(rows, metric))
    label = source.stem if source.suffix == ".csv" else source.name
    table = load(path)
    for gpu, entries in found.items():
        for name, entry in entries.items():
            slot = table.setdefault(gpu, {}).setdefault(name, {})
            if "flash" in entry:
                entry["flash"]["source"] = f"{label}, best {metric}, over {TRITON_REFERENCE}"
                slot["flash"] = entry.pop("flash")
            held = slot.get(metric)
            if keep_better and held is not None and "block_size" in entry:
                new = entry[metric]
                if not _better(new, held, metric):
                    log.info("tuning: %s %s keeps %s %s over %s", gpu, name, metric, held, new)
                    continue
            if "block_size" in entry:
                entry["source"] = f"{label}, best {metric}"
                kept = {"flash": slot["flash"]} if "flash" in slot else {}
                slot.clear()
                slot.update(entry, **kept)
    atomic_write(path, json.dumps(table, indent=2, sort_keys=True) + "\n")
    return table


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m attngym.tuning",
        description="Write a block-size sweep's winners into the tuned table (block_size=tuned).",
    )
    parser.add_argument(
        "sweep_dir", type=Path, help="a multirun folder holding summary.csv, or a summary CSV"
    )
    parser.add_argument("--metric", default="fwd_bwd_tflops", help="higher is better")
    parser.add_argument("--table", type=Path, default=TABLE, help="the table to update")
    args = parser.parse_args(argv)
    table = update(args.sweep_dir, args.metric, args.table)
    for gpu, entries in table.items():
        for name, entry in entries.items():
            if "block_size" in entry:
                print(f"{gpu} {name}: Triton {entry['block_size']} {entry['kernel_options']}")
            if "flash" in entry:
                flash = entry["flash"]
                print(f"{gpu} {name}: FLASH {flash['block_size']}, {flash['over_triton']}x Triton")
    print(f"written: {args.table}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
