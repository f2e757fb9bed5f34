"""Which pictures a run draws, and when it draws none: the run layer's policy over attngym.viz.

Every run, whatever its topology, gets heatmap.png (the variant's attention pattern: the whole
sequence pooled and a zoom of HEATMAP_WINDOW tokens) and block_mask.png (the block mask at the
run's block size). attngym.viz draws them; this module decides what to draw, where, and what
to skip: a picture of a sequence too long to evaluate in seconds is skipped with the reason, one
that fails to draw is a warning, and one that cannot be written fails the run.

The same mask at the same shape and block size gives the same pictures, and drawing them costs
a run 1.5-2.5 s (matplotlib's import and two PNGs): drawn once, they are kept in the cache folder
(`picture_key` names what they depend on) and a run asked again copies them (`pictures_kept`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
from pathlib import Path
from typing import Any

from attngym.runner.config import Settings
from attngym.workload import ROWS_FILE

log = logging.getLogger(__name__)

# Picture name → its file in the run folder (a resumed sweep checks both: attngym.runner.job).
PICTURES = {"heatmap": "heatmap.png", "block_mask": "block_mask.png"}
# A workload run's picture: each batch's time against its longest document (batches.csv's rows).
BATCH_PICTURE = "batches.png"
HEATMAP_WINDOW = 128  # tokens of heatmap.png's zoom
# Without a block mask (a CPU run past kernels.COMPILED_MASK_ENTRIES) the pictures evaluate the
# mask over all S x S (query, key) pairs, tile by tile: ~8 s at S=64K on one CPU thread, growing
# with S^2. Above these many pairs on the run's device the pictures are skipped with the reason,
# so a long run is not followed by minutes of drawing.
PICTURE_MAX_PAIRS = {"cpu": 2**34, "cuda": 2**40}  # S = 128K on a CPU, 1M on a GPU
# The kept pictures' folder under attngym.compile_cache.root(), and how many questions it keeps
# (the newest; a pair of pictures is 50-300 KB).
KEPT_FOLDER = "pictures"
KEPT_PICTURES = 256


def draw_pictures(
    settings: Settings,
    run_dir: Path,
    ran: str | None = None,
    *,
    code: str | None = None,
    metrics: dict[str, Any] | None = None,
) -> dict[str, Path]:
    """heatmap.png and block_mask.png for any topology: {picture name: path} of those drawn;
    with a workload, batches.png, its line named by the topology that `ran` (auto's pick).

    The two are copied from the cache folder where an earlier run drew them for the same
    `picture_key` (`code`: the run's code_fingerprint, the user's mask code it ran), and kept
    there once drawn; `metrics` gets pictures_kept (whether they were copied).

    Both start from the run's BlockMask on its device (attngym.kernels.make_block_mask keeps the
    one the task attended with): the block picture draws its classes, the heatmap evaluates the
    mask only in its partial blocks, so a long sequence costs what its mask's edges need.

    Raises:
        OSError: a picture could not be written (the run fails: attngym.runner.job).
    """
    from attngym import viz

    variant = settings.variant
    seq_len = settings.shape.seq_len
    device = settings.device
    if seq_len * seq_len > PICTURE_MAX_PAIRS.get(device, PICTURE_MAX_PAIRS["cpu"]):
        log.info(
            "%s not drawn: S x S = %.3g mask pairs to classify on %s, above %.3g",
            " and ".join(PICTURES.values()),
            float(seq_len) ** 2,
            device,
            PICTURE_MAX_PAIRS.get(device, PICTURE_MAX_PAIRS["cpu"]),
        )
        return {}
    drawn = {}
    if (run_dir / ROWS_FILE).is_file():  # a workload: its batches too
        drawn.update(_batch_picture(settings, run_dir, ran or settings.topology.kind, metrics))
    key = picture_key(settings, code)
    copied = _copy_kept(key, run_dir)
    if metrics is not None:
        metrics["pictures_kept"] = bool(copied)
    if copied:
        return {**drawn, **copied}
    classes = _block_classes(settings)

    def heatmap(path: Path) -> None:
        window = min(HEATMAP_WINDOW, seq_len)
        viz.save_heatmap(
            variant,
            path,
            seq_len=seq_len,
            window=window,
            seed=settings.seed,
            classes=classes,
            block_size=settings.block_size,
            device=device,
        )

    def block_mask(path: Path) -> None:
        viz.save_block_mask_picture(
            variant.to(device).mask_mod,
            seq_len,
            seq_len,
            path,
            block_size=settings.block_size,
            title=f"{variant.name}: block mask at {settings.block_size}",
            device=device,
            classes=classes,
        )

    for name, draw in (("heatmap", heatmap), ("block_mask", block_mask)):
        path = run_dir / PICTURES[name]
        try:
            draw(path)
            drawn[name] = path
        except OSError:
            raise  # a write error fails the run
        except Exception as err:
            log.warning("%s not drawn: %s: %s", PICTURES[name], type(err).__name__, err)
    if all(name in drawn for name in PICTURES):
        _keep(key, drawn)
    return drawn


def picture_key(settings: Settings, code: str | None) -> str:
    """What the pictures depend on, hashed: the variant's config entry and the user's code it
    names (`code`), the workload, shape, block size, seed and device, attngym's own sources and
    the versions of torch and matplotlib."""
    from dataclasses import asdict
    from importlib.metadata import version

    import torch

    asked = {
        "attention": settings.attention,
        "workload": asdict(settings.workload),
        "code": code,
        "shape": asdict(settings.shape),
        "block_size": list(settings.block_size),
        "seed": settings.seed,
        "device": settings.device,
        "attngym": _own_sources(),
        "versions": [torch.__version__, version("matplotlib")],
    }
    return hashlib.sha256(json.dumps(asked, sort_keys=True, default=str).encode()).hexdigest()[:16]


@functools.cache
def _own_sources() -> str:
    """One digest of attngym's Python files: a picture drawn by other code is not this one."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for file in sorted(root.rglob("*.py")):
        digest.update(file.relative_to(root).as_posix().encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()[:16]


def _kept_root() -> Path:
    from attngym import compile_cache

    return compile_cache.root() / KEPT_FOLDER


def _copy_kept(key: str, run_dir: Path) -> dict[str, Path]:
    """The kept pictures of `key` written into the run folder ({} where none are kept or one
    cannot be read); a write into the run folder that fails raises, as a drawn one's would."""
    from attngym.fileio import PNG_SIGNATURE, atomic_write

    folder = _kept_root() / key
    try:
        found = {name: (folder / file).read_bytes() for name, file in PICTURES.items()}
        folder.touch()  # the newest kept
    except OSError:
        return {}
    if not all(data.startswith(PNG_SIGNATURE) for data in found.values()):
        return {}
    copied = {name: atomic_write(run_dir / PICTURES[name], data) for name, data in found.items()}
    log.info("%s copied from %s (drawn by an earlier run of the same mask, shape and block size)",
             " and ".join(PICTURES.values()), folder)  # fmt: skip
    return copied


def _keep(key: str, drawn: dict[str, Path]) -> None:
    """Keep this run's pictures for `key`, then only the newest KEPT_PICTURES; a cache that
    cannot be written is logged and left (the run has its pictures)."""
    import shutil

    from attngym.fileio import atomic_write

    root = _kept_root()
    try:
        (root / key).mkdir(parents=True, exist_ok=True)
        for name, file in PICTURES.items():
            atomic_write(root / key / file, drawn[name].read_bytes())
        kept = sorted(root.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)
        for old in kept[KEPT_PICTURES:]:
            shutil.rmtree(old, ignore_errors=True)
    except OSError as err:
        log.info("pictures not kept in %s: %s", root, err)


def _batch_picture(
    settings: Settings, run_dir: Path, ran: str, metrics: dict[str, Any] | None
) -> dict[str, Path]:
    """batches.png from the run's batches.csv: the run's own call (a scheme named with the
    layout it ran and its rounds, from `metrics`) and every contender that timed its batches;
    a failure to draw is a warning, as above."""
    import csv

    from attngym import viz

    with (run_dir / ROWS_FILE).open(newline="") as f:
        rows = list(csv.DictReader(f))
    got = metrics or {}
    layout = f", {got['layout']}" if got.get("layout") else ""
    how = layout + ", in rounds" * bool(got.get("pipeline"))
    label = "flex" if ran == "single" else f"{ran}{how} ({settings.topology.world_size} ranks)"
    title = f"{settings.variant.name}: {len(rows)} batches of {settings.shape.seq_len} tokens"
    path = run_dir / BATCH_PICTURE
    try:
        viz.save_batch_times(**batch_series(rows, label), path=path, title=title)
    except OSError:
        raise
    except Exception as err:
        log.warning("%s not drawn: %s: %s", BATCH_PICTURE, type(err).__name__, err)
        return {}
    return {"batches": path}


def batch_series(rows: list[dict[str, Any]], label: str, *, contenders: bool = True
                 ) -> dict[str, Any]:  # fmt: skip
    """The keywords of viz.save_batch_times for a run's batch rows: its own time (`label`) and,
    with `contenders`, every contender's (`<contender>_<pass>_ms`), the pass fwd+bwd where the
    rows have it, else fwd. A simulated run's rows hold predictions (`predicted_<pass>_ms`, and
    PyTorch's CP with each balancer as `predicted_torch_cp_<balancer>_<pass>_ms`): those are
    drawn, named as predicted."""
    simulated = not any(_number(r.get(k)) for r in rows for k in ("fwd_ms", "fwd_bwd_ms"))
    prefix = "predicted_" if simulated else ""
    pass_name = "fwd_bwd" if any(_number(r.get(f"{prefix}fwd_bwd_ms")) for r in rows) else "fwd"
    suffix = f"_{pass_name}_ms"
    columns = {label + ", predicted" * simulated: f"{prefix}{pass_name}_ms"}
    for column in dict.fromkeys(k for r in rows for k in r) if contenders else ():
        own = column.removesuffix(suffix)
        if not column.endswith(suffix) or not own:
            continue
        if simulated and own.startswith(PREDICTED_TORCH_CP):  # one line a balancer
            columns[f"torch_cp {own.removeprefix(PREDICTED_TORCH_CP)}, predicted"] = column
        elif not simulated and own not in NOT_CONTENDERS and not own.startswith("predicted"):
            columns[own] = column
    series = {
        name: [(x, y) for r in rows
               if (x := _number(r.get("doc_len_max"))) and (y := _number(r.get(column)))]
        for name, column in columns.items()
    }  # fmt: skip
    return {"series": series, "time_label": f"{pass_name.replace('_', '+')} time (ms)"}


# A simulated run's PyTorch CP predictions, one column a balancer (`predicted_torch_cp_<pass>_ms`
# is the best of them, drawn as that balancer's line).
PREDICTED_TORCH_CP = "predicted_torch_cp_"
# `<name>_<pass>_ms` columns of a batch row that are no contender's time.
NOT_CONTENDERS = ("single", "best", "best_sdpa", "torch_cp_head_tail",
                  "torch_cp_per_document_head_tail", "torch_cp_ptrr")  # fmt: skip


def _number(value: Any) -> float | None:
    """A CSV cell as a float; None for an empty or non-numeric one."""
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None


def _block_classes(settings: Settings):
    """The block classes of the run's BlockMask (None without a mask, or where building one
    would materialise S x S on a CPU: then the pictures evaluate the mask tile by tile)."""
    from attngym import kernels, viz

    seq_len, device = settings.shape.seq_len, settings.device
    if device != "cuda" and seq_len * seq_len > kernels.COMPILED_MASK_ENTRIES:
        return None
    block_mask = kernels.make_block_mask(
        settings.variant, seq_len, seq_len, block_size=settings.block_size, device=device
    )
    return None if block_mask is None else viz.block_classes(block_mask)
