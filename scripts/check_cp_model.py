"""The CP model against measurements, and its predicted scaling tables.

Check (default): every row of the measured CSVs in FOLDER (default glob study_*.csv: the sweep
summaries of experiments/multi_gpu_cp/study.sh) is rebuilt from its `overrides` column and
simulated at its world_size (topology.simulate=true, fabric h200_nvlink for its transport), and
the table gives measured and predicted fwd+bwd ms, the error, and per case (the row's overrides
without topology and layout) the measured-fastest topology/layout against the model's pick
(agree; "within 5 %" where the pick measured at most 5 % slower than the fastest; else differs).
Writes check_cp_model.md and .json to --out; rerun it when new CSVs arrive. With --predicted
FOLDER, each row's prediction is read from the summary.csv files under FOLDER (made before the
measurement by `PREDICT=1 study.sh`, matched by case, topology, layout and world size) instead
of simulated now.

Scaling (--scaling): the predicted scaling table (scaling.md, scaling.json): a 1024-token window
at 128K on 2 and 8 ranks, documents at 128K on 8 ranks on every scheme, causal 1M on 64 ranks of
8-GPU nodes (hgx_h200), each scheme with CUDA graphs, with its efficiency, bottleneck and bytes
moved and needed; the file records the date, commit, GPU and torch it was made with (the scaling
table of docs/results.md, which experiments/cp_model/README.md points to, is rendered from it:
scripts/render_tables.py).

    python scripts/check_cp_model.py experiments/multi_gpu_cp --out experiments/cp_model
    python scripts/check_cp_model.py experiments/multi_gpu_cp --dry-run        # the commands
    python scripts/check_cp_model.py MEASURED --predicted multirun/cp_study/predicted
    python scripts/check_cp_model.py --scaling --out experiments/cp_model

Each simulation is one attngym run (attngym.run, in this process), its run folder under
--out/runs. --override adds overrides to every run (device=cpu for a CPU check).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# Dropped from a measured row's overrides: the simulation sets its own.
DROPPED = ("topology.world_size=", "validate_rows=", "hydra.")
SIMULATE = ["topology.simulate=true", "validate=false", "baselines=[]", "logger=none"]
CLOSE = 0.05  # a pick measured this close to the fastest is a tie, not a miss
SCALING_SHAPE = ["shape.batch=1", "shape.heads=8", "shape.head_dim=128"]
# Each scaling case: its name, its overrides, the world sizes, and each scheme's (topology,
# layout, extra overrides); every run simulated with CUDA graphs (the host issues a rank's call in
# microseconds: what a training step that captures its graphs gets).
Scheme = tuple[str, str, list[str]]  # (topology, layout, extra overrides)
SCALING_CASES: tuple[tuple[str, list[str], tuple[int, ...], list[Scheme]], ...] = (
    (
        "window(1024) 128K",
        ["attention=sliding_window", "++attention.window_size=1024", "shape.seq_len=131072"],
        (2, 8),
        [("ring", "contiguous", []), ("allgather", "contiguous", []),
         ("ulysses", "contiguous", [])],
    ),
    (
        "documents 128K",
        ["attention=document", "shape.seq_len=131072", "topology.transport=nccl"],
        (8,),
        [("ring", "balanced", []), ("allgather", "balanced", []), ("ulysses", "contiguous", []),
         ("hybrid", "zigzag", ["topology.options.a2a_size=4"])],
    ),
    (
        "causal 1M",
        ["attention=causal", "shape.seq_len=1048576", "topology.fabric=hgx_h200"],
        (64,),
        [("ring", "zigzag", []), ("hybrid", "zigzag", [])],
    ),
)  # fmt: skip
LONG = 524288  # from here a scaling run times fewer calls (_timing)


def _rows(folder: Path, pattern: str) -> list[dict[str, str]]:
    rows = []
    for path in sorted(folder.glob(pattern)):
        with path.open(newline="") as f:
            for row in csv.DictReader(f):
                if row.get("status", "ok") == "ok" and row.get("overrides"):
                    rows.append({**row, "source": path.name})
    return rows


def _case(overrides: list[str]) -> str:
    """The row's case: its overrides without the topology and layout, in a fixed order, each
    without Hydra's + or ++ (a summary may write `++attention.window_size=1024` or, as typed,
    `attention.window_size=1024`)."""
    return " ".join(
        sorted(
            o.lstrip("+") for o in overrides
            if not o.startswith(("topology=", "topology.layout=", "+experiment"))
        )
    )  # fmt: skip


def _job(row: dict[str, str]) -> tuple[str, str, str, int]:
    """What identifies a job whether measured or simulated: its case (overrides without those a
    simulation adds), topology, layout and world size."""
    added = tuple(o.split("=")[0] + "=" for o in SIMULATE)  # summary.csv writes True, not true
    given = [o for o in shlex.split(row["overrides"]) if not o.startswith(DROPPED + added)]
    return _case(given), row["topology"], row["layout"], int(row["world_size"])


def _kept(folder: Path) -> dict[tuple[str, str, str, int], dict[str, Any]]:
    """Predictions made earlier: every summary.csv row under `folder`, by job."""
    kept = {}
    for row in _rows(folder, "**/summary.csv"):
        kept[_job(row)] = {
            key: _number(row.get(key))
            for key in ("predicted_fwd_ms", "predicted_fwd_bwd_ms", "sim_s")
        } | {"bottleneck": row.get("bottleneck") or None}
    return kept


def _simulated(overrides: list[str], out: Path, name: str, dry_run: bool) -> dict[str, Any]:
    if dry_run:
        print("python -m attngym " + " ".join(shlex.quote(o) for o in overrides))
        return {}
    import attngym

    try:
        return attngym.run(overrides=overrides, run_dir=out / "runs" / name)
    except Exception as error:  # one failed simulation leaves the others' rows
        print(f"{name} failed: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
        return {}


def _number(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def check(args: argparse.Namespace) -> int:
    rows = _rows(args.folder, args.glob)
    if not rows:
        print(f"no measured rows in {args.folder}/{args.glob}", file=sys.stderr)
        return 1
    kept = _kept(args.predicted) if args.predicted else None
    if kept == {}:
        print(f"no predictions in {args.predicted}/**/summary.csv", file=sys.stderr)
        return 1
    table = []
    for i, row in enumerate(rows):
        given = [o for o in shlex.split(row["overrides"]) if not o.startswith(DROPPED)]
        overrides = [*given, f"topology.world_size={row['world_size']}", *SIMULATE,
                     *args.override]  # fmt: skip
        start = time.perf_counter()
        if kept is not None:  # predicted before the measurement: nothing simulated now
            metrics = kept.get(_job(row), {})
        else:
            metrics = _simulated(overrides, args.out, f"check_{i:03d}", args.dry_run)
        measured = _number(row.get("fwd_bwd_ms"))
        predicted = metrics.get("predicted_fwd_bwd_ms")
        table.append(
            {
                "source": row["source"],
                "case": _case(given),
                "topology": row["topology"],
                "layout": row["layout"],
                "transport": row.get("transport"),
                "world_size": int(row["world_size"]),
                "measured_fwd_ms": _number(row.get("fwd_ms")),
                "measured_fwd_bwd_ms": measured,
                "predicted_fwd_ms": metrics.get("predicted_fwd_ms"),
                "predicted_fwd_bwd_ms": predicted,
                "error_pct": (
                    None
                    if not (measured and predicted)
                    else 100 * (predicted - measured) / measured
                ),
                "bottleneck": metrics.get("bottleneck"),
                "sim_s": metrics.get("sim_s"),
                "wall_s": time.perf_counter() - start,
            }
        )
        if not args.dry_run:  # written row by row: an interrupted run keeps its rows
            cases = _cases(table)
            _write(args.out, "check_cp_model", {"rows": table, "cases": cases},
                   _check_md(table, cases))  # fmt: skip
    if args.dry_run:
        return 0
    print(_check_md(table, _cases(table)))
    return 0


def _cases(table: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per case: the measured-fastest and the predicted-fastest topology/layout."""
    out = []
    for case in dict.fromkeys(r["case"] for r in table):
        rows = [r for r in table if r["case"] == case and r["measured_fwd_bwd_ms"]]
        if len(rows) < 2:
            continue
        best = min(rows, key=lambda r: r["measured_fwd_bwd_ms"])
        pick = min(rows, key=lambda r: r["predicted_fwd_bwd_ms"] or float("inf"))
        # How much slower the model's pick measured than the fastest: within CLOSE, a tie.
        margin = pick["measured_fwd_bwd_ms"] / best["measured_fwd_bwd_ms"] - 1
        name = f"{best['topology']}/{best['layout']}"
        picked = f"{pick['topology']}/{pick['layout']}"
        verdict = "agree" if pick is best else ("within 5 %" if margin <= CLOSE else "differs")
        out.append({"case": case, "measured_best": name, "predicted_best": picked,
                    "pick_slower": margin, "verdict": verdict})  # fmt: skip
    return out


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return ""
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _check_md(table, cases) -> str:
    label = _labels([r["case"] for r in table])
    lines = [
        "| case | topology | layout | P | measured fwd+bwd ms | predicted | error % | bottleneck |",
        "|---|---|---|--:|--:|--:|--:|---|",
    ]
    for r in table:
        lines.append(
            f"| {label[r['case']]} | {r['topology']} | {r['layout']} | {r['world_size']} | "
            f"{_fmt(r['measured_fwd_bwd_ms'])} | {_fmt(r['predicted_fwd_bwd_ms'])} | "
            f"{_fmt(r['error_pct'], 1)} | {r['bottleneck'] or ''} |"
        )
    errors = [abs(r["error_pct"]) for r in table if r["error_pct"] is not None]
    if errors:
        lines.append(
            f"\nmedian |error| {statistics.median(errors):.1f} %, largest {max(errors):.1f} %"
        )
    lines += [
        "",
        "| case | measured best | model's pick | pick measured slower by | verdict |",
        "|---|---|---|--:|---|",
    ]
    for c in cases:
        lines.append(
            f"| {label[c['case']]} | {c['measured_best']} | {c['predicted_best']} | "
            f"{100 * c['pick_slower']:.1f} % | {c['verdict']} |"
        )
    if common := _common(list(label)):
        lines.append(f"\nEvery case also has: `{' '.join(common)}`")
    return "\n".join(lines) + "\n"


def _common(cases: list[str]) -> list[str]:
    """The overrides every case has."""
    words = [c.split() for c in cases]
    return [w for w in words[0] if all(w in other for other in words[1:])] if words else []


def _labels(cases: list[str]) -> dict[str, str]:
    """Each case without the overrides every case has (the table's label)."""
    common = set(_common(list(dict.fromkeys(cases))))
    return {c: " ".join(w for w in c.split() if w not in common) for c in cases}


def _timing(overrides: list[str]) -> list[str]:
    """Warm-up and repeats: fewer from 512K tokens, where one call of the whole problem takes
    seconds (causal 1M on an H200: about 20 s fwd+bwd) and its spread is well under 1 %."""
    seq_len = next(int(o.split("=")[1]) for o in overrides if o.startswith("shape.seq_len="))
    if seq_len >= LONG:
        return ["benchmark.warmup=0", "benchmark.repeats=2"]
    return ["benchmark.warmup=1", "benchmark.repeats=5"]


def scaling(args: argparse.Namespace) -> int:
    done = {}
    if args.resume:  # rows of an earlier, interrupted run: kept
        if not args.resume.is_file():
            print(f"--resume: no such file {args.resume}", file=sys.stderr)
            return 2
        done = {_key(r): r for r in json.loads(args.resume.read_text())["rows"]}
    table: list[dict[str, Any]] = []
    cases = [name for name, *_ in SCALING_CASES]

    def save() -> None:  # every resumed row stays, also those of cases this run leaves out
        if args.dry_run:
            return
        rows = table + [r for k, r in done.items() if k not in {_key(t) for t in table}]
        rows.sort(key=lambda r: (cases.index(r["case"]) if r["case"] in cases else len(cases),
                                 r["world_size"]))  # fmt: skip
        _write(args.out, "scaling", {"rows": rows}, _scaling_md(rows))

    for name, overrides, world_sizes, topologies in SCALING_CASES:
        if args.cases and not any(c in name for c in args.cases):
            continue
        single = next(
            ({"fwd_bwd": r["single_fwd_bwd_ms"]} for r in done.values()
             if r["case"] == name and r.get("single_fwd_bwd_ms")), {}
        )  # fmt: skip
        for P in args.world_sizes or world_sizes:
            for topology, layout, extra in topologies:
                if args.topologies and topology not in args.topologies:
                    continue
                runs = [
                    "+experiment=ring_attention", *SCALING_SHAPE, *overrides,
                    f"topology={topology}", f"topology.layout={layout}", *extra,
                    f"topology.world_size={P}", *SIMULATE, "topology.cuda_graph=true",
                    *_timing(overrides),
                    # the one-device run does not depend on P: timed once per case
                    f"topology.compare_one_device={str(not (single or args.no_single)).lower()}",
                    *args.override,
                ]  # fmt: skip
                tag = f"scaling_{name.replace(' ', '_')}_{topology}_{P}"
                if (name, topology, P) in done:
                    table.append(done[name, topology, P])
                    save()
                    continue
                metrics = _simulated(runs, args.out, tag, args.dry_run)
                if metrics.get("single_fwd_bwd_ms"):
                    single = {"fwd_bwd": metrics["single_fwd_bwd_ms"]}
                predicted = metrics.get("predicted_fwd_bwd_ms")
                efficiency = single["fwd_bwd"] / P / predicted if single and predicted else None
                table.append(
                    {"case": name, "topology": topology, "layout": layout, "world_size": P,
                     "predicted_fwd_bwd_ms": predicted, "efficiency_fwd_bwd": efficiency,
                     "bottleneck": metrics.get("bottleneck"),
                     "time_imbalance": metrics.get("time_imbalance"),
                     "bytes_moved": metrics.get("bytes_moved"),
                     "bytes_needed": metrics.get("bytes_needed"), "sim_s": metrics.get("sim_s"),
                     "fabric": metrics.get("fabric"),
                     "single_fwd_bwd_ms": single.get("fwd_bwd"),
                     "measured": _provenance(metrics, args.commit)}
                )  # fmt: skip
                save()  # row by row: an interrupted run keeps its rows
    if args.dry_run:
        return 0
    save()
    print((args.out / "scaling.md").read_text())
    return 0


def _key(row: dict[str, Any]) -> tuple[str, str, int]:
    return row["case"], row["topology"], row["world_size"]


def _provenance(metrics: dict[str, Any], commit: str | None) -> dict[str, Any] | None:
    """When, on what code and on which device a row was made (the commit given, else the
    checkout's: a machine the tree was copied to without its history has none)."""
    if not metrics:
        return None
    if commit is None:
        try:
            commit = subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                check=True, cwd=Path(__file__).parent,
            ).stdout.strip()  # fmt: skip
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    return {"date": datetime.date.today().isoformat(), "commit": commit,
            "device_name": metrics.get("device_name"), "torch": metrics.get("torch")}  # fmt: skip


def _scaling_md(table: list[dict[str, Any]]) -> str:
    lines = [
        "| case | topology | layout | P | fabric | predicted fwd+bwd ms | efficiency | "
        "bottleneck | time imbalance | MiB moved | MiB needed | simulation s |",
        "|---|---|---|--:|---|--:|--:|---|--:|--:|--:|--:|",
    ]
    for r in table:
        mib = [None if r.get(k) is None else r[k] / 2**20 for k in ("bytes_moved", "bytes_needed")]
        lines.append(
            f"| {r['case']} | {r['topology']} | {r['layout']} | {r['world_size']} | "
            f"{r.get('fabric') or ''} | {_fmt(r['predicted_fwd_bwd_ms'])} | "
            f"{_fmt(r['efficiency_fwd_bwd'])} | {r['bottleneck'] or ''} | "
            f"{_fmt(r['time_imbalance'], 3)} | {_fmt(mib[0], 1)} | {_fmt(mib[1], 1)} | "
            f"{_fmt(r['sim_s'], 1)} |"
        )
    made = sorted({(m["date"], m["commit"], m["device_name"], m["torch"]) for r in table
                   if (m := r.get("measured")) and m.get("date")})  # fmt: skip
    for date, commit, gpu, torch in made:
        lines.append(f"\nMade on {date} at commit {commit}, {gpu}, torch {torch}.")
    return "\n".join(lines) + "\n"


def _write(out: Path, stem: str, data: dict[str, Any], text: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(data, indent=1) + "\n")
    (out / f"{stem}.md").write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, nargs="?", default=Path("experiments/multi_gpu_cp"))
    parser.add_argument("--glob", default="study_*.csv", help="measured CSVs in FOLDER")
    parser.add_argument("--out", type=Path, default=Path("outputs/check_cp_model"))
    parser.add_argument("--override", action="append", default=[], help="added to every run")
    parser.add_argument(
        "--predicted",
        type=Path,
        help="check: predictions kept from PREDICT=1 study.sh (its folder)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the runs, run nothing")
    parser.add_argument("--scaling", action="store_true", help="the predicted scaling tables")
    parser.add_argument(
        "--world-sizes", type=int, nargs="+", default=[], help="scaling: instead of each case's"
    )
    parser.add_argument("--cases", nargs="+", default=[], help="scaling: cases containing these")
    parser.add_argument("--topologies", nargs="+", default=[], help="scaling: only these")
    parser.add_argument(
        "--no-single", action="store_true", help="scaling: no one-device run (no efficiency)"
    )
    parser.add_argument(
        "--resume", type=Path, help="scaling: a scaling.json whose rows are kept, not rerun"
    )
    parser.add_argument("--commit", help="scaling: the commit the runs are made on (else git's)")
    args = parser.parse_args(argv)
    return scaling(args) if args.scaling else check(args)


if __name__ == "__main__":
    sys.exit(main())
