"""Pictures of attention: the seed's score heatmap and a block-level picture of a whole mask.

Two pictures answer two questions:

* The heatmap shows what a variant does. The seed's `plot_attention_scores` and
  `visualize_attention_scores` draw the post-score_mod scores of given q, k (dense, for small
  windows). `save_heatmap` draws a run's variant over the whole sequence, pooled to a few hundred
  cells a side (what the mask keeps, or what the score_mod adds), beside a zoom on the square
  where the mask is most telling and, for a score_mod, its output against its input score.
* The block picture (`block_mask_classes`, `save_block_mask_picture`) shows what FlexAttention
  will compute at full length: every (q block, kv block) pair is empty (skipped), partial (mask
  evaluated inside) or full (no mask needed). It never holds an S x S tensor: the mask_mod is
  evaluated tile by tile (one q block of rows by a few thousand keys) and each tile is reduced to
  its block classes at once, so a 64K x 64K mask needs a few MB and seconds on a laptop CPU.

matplotlib is imported inside the drawing functions only, and figures are drawn on the Agg canvas
of a `matplotlib.figure.Figure`, so importing this module and drawing change no global state
(no pyplot, no backend switch).
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import pathlib
import re
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from attngym.device import resolve_device
from attngym.metrics import shortened
from attngym.reference import index_grids
from attngym.variants.base import MaskMod, ScoreMod

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from attngym.variants.base import Variant

log = logging.getLogger(__name__)

EMPTY, PARTIAL, FULL = 0, 1, 2
CLASS_NAMES = ("empty (skipped)", "partial (mask evaluated)", "full (no mask needed)")
CLASS_COLOURS = ("#f2f2f2", "#f4a261", "#1d3557")
MASKED_COLOUR = "#d9d9d9"  # heatmap entries a mask removed
ZOOM_COLOUR = "#e63946"  # the zoom's outline on the overview
_TILE_ELEMENTS = 1 << 20  # mask entries evaluated per step: ~1 MB of bools, a few MB of indices


# --------------------------------------------------------------------------------------------
# The seed's score heatmap


def _check_index(name: str, value: Any, bound: int | None = None) -> None:
    ok = not isinstance(value, bool) and isinstance(value, int) and value >= 0
    if not ok or (bound is not None and value >= bound):
        allowed = f"in [0, {bound})" if bound is not None else ">= 0"
        raise ValueError(f"{name} must be an integer {allowed}, got {value!r}")


def _one_head(
    query: torch.Tensor, key: torch.Tensor, batch_idx: int, head_idx: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (M, D) query and (N, D) key of one head, from either form of `create_score_mod`.

    (M, D), (N, D): attention-gym's form, already one head; batch_idx and head_idx only say
    which b and h the mods see. (B, H, Sq, D), (B, G, Skv, D): the head is taken here, G
    dividing H (query head h reads key head h // (H / G)).
    """
    dims = tuple(t.dim() if isinstance(t, torch.Tensor) else None for t in (query, key))
    if dims == (2, 2):
        if key.shape[1] != query.shape[1]:
            raise ValueError(
                f"key shape {tuple(key.shape)} does not fit query shape {tuple(query.shape)}: "
                "need the same head_dim D in (M, D) and (N, D)"
            )
        _check_index("batch_idx", batch_idx)
        _check_index("head_idx", head_idx)
        return query, key
    if dims != (4, 4):
        shapes = [
            tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            for t in (query, key)
        ]
        raise ValueError(
            f"query and key must be one head's (M, D) and (N, D) or (B, H, Sq, D) and "
            f"(B, G, Skv, D) tensors, got {shapes[0]} and {shapes[1]}"
        )
    batch, heads, _, dim = query.shape
    if key.shape[0] != batch or key.shape[-1] != dim or heads % key.shape[1]:
        raise ValueError(
            f"key shape {tuple(key.shape)} does not fit query shape {tuple(query.shape)}: "
            "need the same batch and head_dim, and key heads dividing query heads"
        )
    _check_index("batch_idx", batch_idx, batch)
    _check_index("head_idx", head_idx, heads)
    return query[batch_idx, head_idx], key[batch_idx, head_idx // (heads // key.shape[1])]


def _grids(seq_q: int, seq_kv: int, batch_idx: int, head_idx: int, device: torch.device):
    """(b, h, q_idx, kv_idx) broadcasting to (1, 1, M, N): b and h hold the given indices."""
    b, h, q_idx, kv_idx = index_grids(
        1, 1, torch.arange(seq_q, device=device), torch.arange(seq_kv, device=device)
    )
    return b + batch_idx, h + head_idx, q_idx, kv_idx


def _modded_scores(q_MD, k_ND, score_mod, scale, batch_idx, head_idx) -> torch.Tensor:
    """(1, 1, M, N) scaled scores q k^T * scale (default 1 / sqrt(D)), through score_mod."""
    scale = 1.0 / math.sqrt(q_MD.shape[-1]) if scale is None else scale
    scores = ((q_MD @ k_ND.T) * scale)[None, None]
    if score_mod is None:
        return scores
    grids = _grids(q_MD.shape[0], k_ND.shape[0], batch_idx, head_idx, q_MD.device)
    return torch.broadcast_to(score_mod(scores, *grids), scores.shape).to(scores.dtype)


def _keep(mask_mod, seq_q, seq_kv, batch_idx, head_idx, device) -> torch.Tensor:
    """(1, 1, M, N) bool: True where mask_mod lets the query attend to the key."""
    keep = mask_mod(*_grids(seq_q, seq_kv, batch_idx, head_idx, device))
    return torch.broadcast_to(torch.as_tensor(keep, device=device), (1, 1, seq_q, seq_kv))


def _masked_scores(q_MD, k_ND, score_mod, mask_mod, scale, batch_idx, head_idx) -> torch.Tensor:
    """(1, 1, M, N): the scores after score_mod, -inf where mask_mod masks (what softmax sees)."""
    scores = _modded_scores(q_MD, k_ND, score_mod, scale, batch_idx, head_idx)
    if mask_mod is None:
        return scores
    keep = _keep(mask_mod, q_MD.shape[0], k_ND.shape[0], batch_idx, head_idx, q_MD.device)
    return scores.masked_fill(~keep, float("-inf"))


def _head_scores(query, key, score_mod, mask_mod, device, scale, batch_idx, head_idx):
    """(M, N) float32: one head's scores after score_mod, -inf where masked; either input form."""
    dev = resolve_device(device)
    q_MD, k_ND = _one_head(query, key, batch_idx, head_idx)
    q_MD, k_ND = q_MD.to(dev, torch.float32), k_ND.to(dev, torch.float32)
    return _masked_scores(q_MD, k_ND, score_mod, mask_mod, scale, batch_idx, head_idx)[0, 0]


def create_score_mod(
    query: torch.Tensor,
    key: torch.Tensor,
    score_mod: ScoreMod | None,
    mask_mod: MaskMod | None,
    device: str = "cuda",
    _compile: bool = False,
    scale: float | None = None,
    batch_idx: int = 0,
    head_idx: int = 0,
) -> torch.Tensor:
    """The dense scores or mask of a score_mod / mask_mod, as FlexAttention sees them.

    Two forms, told apart by the inputs' dimensions:

    * attention-gym's: `query` (M, D) and `key` (N, D) of one head. Returns (1, 1, M, N): with a
      score_mod, the scores `(query @ key^T) * scale` after score_mod, in the inputs' dtype
      (score_mod takes precedence: mask_mod is then not applied); with only a mask_mod, its
      boolean mask (True = attend). One of the two is required. The mods get b = batch_idx,
      h = head_idx and positions 0..M-1, 0..N-1.
    * attngym's extension: `query` (B, H, Sq, D) and `key` (B, G, Skv, D), G dividing H. The head
      (batch_idx, head_idx) is taken (query head h reads key head h // (H / G)), both mods
      apply, and the result is (Sq, Skv) float32 with -inf where mask_mod masks.

    Args:
        query: (M, D) or (B, H, Sq, D) queries.
        key: (N, D) or (B, G, Skv, D) keys.
        score_mod: `(score, b, h, q_idx, kv_idx) -> score`, or None.
        mask_mod: `(b, h, q_idx, kv_idx) -> bool`, or None.
        device: where to compute ("cuda", "cuda:N", "cpu", "auto"); CUDA must be available
            when asked for.
        _compile: wrap the callbacks in torch.compile.
        scale: score scale, default 1 / sqrt(D).
        batch_idx: the batch index (the batch row taken, for 4-D inputs) the mods see.
        head_idx: the query head index (the head taken, for 4-D inputs) the mods see.

    Returns:
        (1, 1, M, N) scores or bool mask for (M, D) inputs; (Sq, Skv) float32 scores for 4-D.
    """
    if _compile:
        score_mod = torch.compile(score_mod) if score_mod is not None else None
        mask_mod = torch.compile(mask_mod) if mask_mod is not None else None
    if not (isinstance(query, torch.Tensor) and query.dim() == 2):
        return _head_scores(query, key, score_mod, mask_mod, device, scale, batch_idx, head_idx)
    dev = resolve_device(device)
    q_MD, k_ND = _one_head(query, key, batch_idx, head_idx)
    if score_mod is None and mask_mod is None:
        raise ValueError("create_score_mod of (M, D) inputs needs a score_mod or a mask_mod")
    if score_mod is not None:
        out = _modded_scores(q_MD.to(dev), k_ND.to(dev), score_mod, scale, batch_idx, head_idx)
    else:
        out = _keep(mask_mod, q_MD.shape[0], k_ND.shape[0], batch_idx, head_idx, dev)
    return out.contiguous()  # a tensor of its own, not a broadcast view


IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")
# Characters of a picture's title before it is cut with "...": a figure's width holds about this
# many at its title's font size.
TITLE_WIDTH = 70


def short_title(name: str, params: Mapping[str, Any]) -> str:
    """`name(k=v, ...)` that fits a picture's title: a mapping's items (a custom variant's
    mask_args) inline, an import path by its last name, the whole cut to TITLE_WIDTH."""

    def shown(value: Any) -> str:
        if isinstance(value, Mapping):
            return ", ".join(f"{k}={shown(v)}" for k, v in value.items())
        text = str(value)
        text = text.rsplit(".", 1)[-1] if IMPORT_PATH.match(text) else text
        return text if len(text) <= 24 else f"{text[:20]}...{text[-1]}"  # [204, 51, 10...]

    parts = [shown(v) if isinstance(v, Mapping) else f"{k}={shown(v)}" for k, v in params.items()]
    inside = shortened(", ".join(p for p in parts if p), TITLE_WIDTH - len(name) - 2)
    return f"{name}({inside})" if inside else name


def _score_figure(
    query: torch.Tensor,
    key: torch.Tensor,
    score_mod: ScoreMod | None,
    mask_mod: MaskMod | None,
    device: str,
    batch_idx: int,
    head_idx: int,
    scale: float | None,
    title: str,
    figsize: tuple[float, float] = (7.0, 6.0),
) -> Figure:
    """The seed's heatmap: post-mod scores of the first positions, drawn by `_draw_scores`."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    scores = _head_scores(query, key, score_mod, mask_mod, device, scale, batch_idx, head_idx)
    fig = Figure(figsize=figsize, dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    _draw_scores(fig, ax, scores, (0, 0), modified=score_mod is not None)
    ax.set_title(title)
    return fig


def _draw_scores(
    fig: Figure, ax: Any, scores: torch.Tensor, origin: tuple[int, int], *, modified: bool
) -> None:
    """Draw (Sq, Skv) post-mod scores on `ax` (masked entries grey, with their share) and a
    colorbar; `origin` is the (query, key) position of the top-left entry."""
    import numpy as np
    from matplotlib.patches import Patch

    values = scores.detach().double().cpu().numpy()
    masked = ~np.isfinite(values)
    data = np.ma.masked_array(values, mask=masked)
    seq_q, seq_kv = values.shape
    q0, k0 = origin
    cmap = _colormap("viridis").with_extremes(bad=MASKED_COLOUR)
    image = ax.imshow(
        data,
        cmap=cmap,
        interpolation="nearest",
        aspect="auto",
        extent=(k0 - 0.5, k0 + seq_kv - 0.5, q0 + seq_q - 0.5, q0 - 0.5),
    )
    label = "score (after score_mod)" if modified else "score (q·k, scaled)"
    fig.colorbar(image, ax=ax, label=label, shrink=0.9)
    ax.set_xlabel("key position")
    ax.set_ylabel("query position")
    if masked.any():
        share = 100.0 * masked.mean()
        ax.legend(
            handles=[
                Patch(facecolor=MASKED_COLOUR, edgecolor="0.4", label=f"masked ({share:.0f}%)")
            ],
            loc="upper right",
            framealpha=0.9,
            fontsize="small",
        )


def _colormap(name: str):
    import matplotlib

    return matplotlib.colormaps[name]


def plot_attention_scores(
    query: torch.Tensor,
    key: torch.Tensor,
    score_mod: ScoreMod | None = None,
    mask_mod: MaskMod | None = None,
    device: str = "cuda",
    name: str = "attention_scores",
    batch_idx: int = 0,
    head_idx: int = 0,
    scale: float | None = None,
    figsize: tuple[float, float] = (12, 10),
) -> Figure:
    """A heatmap of the post-mod scores of one batch and head, as a matplotlib Figure.

    Args: as `visualize_attention_scores`, with attention-gym's order and `figsize`, the
        figure's (width, height) in inches; `name` is the title (underscores read as spaces).

    Returns:
        The Figure (Agg canvas; save it with `fig.savefig(...)`).
    """
    return _score_figure(
        query,
        key,
        score_mod,
        mask_mod,
        device,
        batch_idx,
        head_idx,
        scale,
        name.replace("_", " "),
        tuple(figsize),
    )


def visualize_attention_scores(
    query: torch.Tensor,
    key: torch.Tensor,
    score_mod: ScoreMod | None = None,
    mask_mod: MaskMod | None = None,
    device: str = "cuda",
    name: str = "attention_scores",
    path: str | pathlib.Path | None = None,
    batch_idx: int = 0,
    head_idx: int = 0,
    scale: float | None = None,
) -> pathlib.Path:
    """Draw the post-mod scores of one batch and head and save them as a PNG.

    Args:
        query: (B, H, Sq, D) queries, or one head's (M, D) as for `create_score_mod`.
        key: (B, G, Skv, D) keys, or one head's (N, D).
        score_mod: `(score, b, h, q_idx, kv_idx) -> score`, or None.
        mask_mod: `(b, h, q_idx, kv_idx) -> bool`, or None; masked entries are drawn grey.
        device: where to compute; "cuda" needs CUDA (use "cpu" otherwise).
        name: title of the picture, and its file name when `path` is None.
        path: where the PNG goes, as in attention-gym: its suffix becomes .png (`out` and
            `out.png` both write `out.png`, beside a folder `out` if one exists), its parent
            created; None saves `./<name>.png`.
        batch_idx: batch row to draw.
        head_idx: query head to draw.
        scale: score scale, default 1 / sqrt(D).

    Returns:
        The absolute path written (also logged at INFO), since `path=None` means the current
        folder.
    """
    fig = _score_figure(query, key, score_mod, mask_mod, device, batch_idx, head_idx, scale, name)
    out = pathlib.Path(f"{name}.png") if path is None else pathlib.Path(path).with_suffix(".png")
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    save_png(fig, out)
    log.info("attention scores saved to %s", out)
    return out


def save_png(fig: Any, out: pathlib.Path) -> pathlib.Path:
    """Render `fig` as PNG in memory, then write it with attngym.fileio.atomic_write: never half a
    picture, never through a symlink."""
    from attngym.fileio import atomic_write

    png = io.BytesIO()
    fig.savefig(png, format="png")
    return atomic_write(out, png.getvalue())


def png_path(path: str | pathlib.Path | None, name: str) -> pathlib.Path:
    """Where a picture goes: None → ./<name>.png; a folder → <path>/<name>.png; else <path>.png.

    The parent folder is created.
    """
    if path is None:
        out = pathlib.Path.cwd() / f"{name}.png"
    else:
        out = pathlib.Path(path)
        out = out / f"{name}.png" if out.is_dir() else out.with_suffix(".png")
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


def save_heatmap(
    variant: Variant,
    path: str | pathlib.Path,
    *,
    seq_len: int,
    window: int = 128,
    head_dim: int = 16,
    seed: int = 0,
    classes: torch.Tensor | None = None,
    block_size: tuple[int, int] = (128, 128),
    device: str | torch.device = "cpu",
) -> pathlib.Path:
    """Draw what a variant does over the whole sequence, beside a zoom where it is most telling.

    Panels, left to right:

    * the whole sequence, pooled to at most `OVERVIEW_CELLS` cells a side: the share of each cell
      the mask keeps (any kept entry colours the cell, so a one-token sink column or a thin
      window stays visible), or, for a variant with a score_mod, what the score_mod adds to a
      random score at the cell's centre; cells the mask removes entirely are grey;
    * the post-mod scores of random q, k on a `window` x `window` zoom, placed where the mask
      stops being a function of q - kv (a document boundary, the end of a prefix, a sink column,
      a chunk edge) and otherwise on the mask's edges; its place is outlined on the overview;
    * for a variant with a score_mod, the score_mod's output against its input score at a few
      distances q - kv (softcap's tanh, ALiBi's and relative position's offsets).

    Memory is bounded at any length: the mask is evaluated tile by tile, never as S x S.

    Args:
        variant: the attention variant (its buffers are moved to the CPU).
        path: the PNG file, or a folder (saves `<path>/<variant.name>.png`).
        seq_len: the run's sequence length (variants built for one length need it).
        window: side of the zoom in tokens (at most seq_len).
        head_dim: D of the random q, k.
        seed: seed of the random q, k.
        classes, block_size, device: the mask's block classes at `block_size` (block_classes
            of the run's BlockMask), so the overview evaluates only partial blocks, on `device`
            (pooled_keep); None: every entry, on the CPU.

    Returns:
        The path written.
    """
    for name, value in (("seq_len", seq_len), ("window", window), ("head_dim", head_dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    variant.check_seq_len(seq_len)
    cell = math.ceil(seq_len / OVERVIEW_CELLS)
    blocks = math.lcm(*block_size)
    if classes is not None and cell >= blocks:  # whole blocks: only partial ones are evaluated
        cell = blocks * math.ceil(cell / blocks)
    kept = pooled_keep(
        variant.to(device).mask_mod,
        seq_len,
        cell,
        classes=classes,
        block_size=block_size,
        device=device,
    )
    variant = variant.to("cpu")
    n = min(window, seq_len)
    q0, k0 = zoom_origin(kept, cell, n, seq_len)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 1, n, head_dim, generator=gen)
    k = torch.randn(1, 1, n, head_dim, generator=gen)
    zoom = create_score_mod(
        q, k, _shifted(variant.score_mod, q0, k0), _shifted(variant.mask_mod, q0, k0), "cpu"
    )

    has_score_mod = variant.score_mod is not None
    fig = Figure(figsize=(17.0 if has_score_mod else 12.5, 5.6), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3 if has_score_mod else 2, width_ratios=[1, 1, 0.8][: 2 + has_score_mod])
    _draw_overview(fig, axes[0], variant, kept, cell, seq_len, head_dim, gen)
    _outline(axes[0], q0, k0, n)
    _draw_scores(fig, axes[1], zoom, (q0, k0), modified=has_score_mod)
    axes[1].set_title(
        f"zoom (red square): queries {q0:,}-{q0 + n - 1:,}, keys {k0:,}-{k0 + n - 1:,}"
    )
    if has_score_mod:
        _draw_transfer(axes[2], variant.score_mod, seq_len)
    title = short_title(variant.name, variant.params)
    kept_share = float(kept.mean()) if variant.mask_mod is not None else 1.0
    fig.suptitle(
        f"{title}: {seq_len:,} tokens, mask keeps {100.0 * kept_share:.1f}% of query-key pairs",
        fontsize="large",
    )
    out = png_path(path, variant.name)
    save_png(fig, out)
    return out


OVERVIEW_CELLS = 256  # the overview's resolution: at most this many cells a side


def pooled_keep(
    mask_mod: MaskMod | None,
    seq_len: int,
    cell: int,
    *,
    classes: torch.Tensor | None = None,
    block_size: tuple[int, int] = (128, 128),
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """The share of each `cell` x `cell` square that the mask keeps, without an S x S tensor.

    With the mask's block classes (block_classes of the run's BlockMask, at `block_size`) and a
    cell a whole number of blocks, only the partial blocks are evaluated, on `device`: a window
    or a causal mask at 64K costs a few million evaluations instead of S x S.

    Returns:
        (ceil(S / cell), ceil(S / cell)) float32 in [0, 1] on the CPU; positions past the end
        count as masked, so a cell cut by the end of the sequence reads lower than it is.
    """
    cells = math.ceil(seq_len / cell)
    if mask_mod is None:
        return torch.ones((cells, cells))
    bq, bkv = block_size
    if classes is not None and cell % bq == 0 and cell % bkv == 0:
        share = _block_share(mask_mod, classes, bq, bkv, seq_len, resolve_device(device))
        rows, cols = cells * (cell // bq), cells * (cell // bkv)
        share = torch.nn.functional.pad(share, (0, cols - share.shape[1], 0, rows - share.shape[0]))
        return share.view(cells, cell // bq, cells, cell // bkv).mean(dim=(1, 3))
    dev = resolve_device(device)
    kept = torch.ones((cells, cells), device=dev)
    b = torch.zeros((), dtype=torch.int32, device=dev)
    cols = max(1, _TILE_ELEMENTS // (cell * cell)) * cell
    with _one_cpu_thread(dev):
        _walk_tiles(mask_mod, kept, b, b, seq_len, seq_len, cell, cell, cols, _tile_share)
    return kept.cpu()


def _block_share(mask_mod, classes, bq, bkv, seq_len, dev) -> torch.Tensor:
    """(nq, nkv) float32 on the CPU: the share of each block the mask keeps, 1 for full blocks,
    0 for empty ones, the partial ones evaluated on `dev` a batch of blocks at a time."""
    share = (classes == FULL).to(torch.float32)
    partial = (classes == PARTIAL).nonzero().to(dev)
    if partial.numel() == 0:
        return share
    b = torch.zeros((), dtype=torch.int32, device=dev)
    rows = torch.arange(bq, dtype=torch.int32, device=dev).view(1, -1, 1)
    cols = torch.arange(bkv, dtype=torch.int32, device=dev).view(1, 1, -1)
    batch = max(1, _TILE_ELEMENTS * 16 // (bq * bkv))
    values = []
    for start in range(0, partial.shape[0], batch):
        ij = partial[start : start + batch].to(torch.int32)
        q_idx = ij[:, 0].view(-1, 1, 1) * bq + rows
        kv_idx = ij[:, 1].view(-1, 1, 1) * bkv + cols
        # Positions past the end are masked; clamped, a table the mask reads is never overrun.
        last = seq_len - 1
        keep = torch.as_tensor(
            mask_mod(b, b, q_idx.clamp(max=last), kv_idx.clamp(max=last)), device=dev
        )
        keep = keep & (q_idx <= last) & (kv_idx <= last)
        values.append(keep.to(torch.float32).mean(dim=(1, 2)))
    share[tuple(partial.cpu().T)] = torch.cat(values).cpu()
    return share


def block_classes(block_mask: Any) -> torch.Tensor:
    """(nq, nkv) uint8 on the CPU of a FlexAttention BlockMask at batch 0, head 0: 0 empty,
    1 partial, 2 full, as block_mask_classes computes them from the mask_mod (create_block_mask
    counts a block full only when every entry in it is kept)."""

    def dense(num_blocks: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        num_blocks, indices = num_blocks[0, 0], indices[0, 0]
        listed = torch.arange(indices.shape[-1], device=indices.device) < num_blocks[:, None]
        out = torch.zeros(indices.shape, dtype=torch.uint8, device=indices.device)
        return out.scatter_reduce_(1, indices.long(), listed.to(torch.uint8), "amax")

    partial = dense(block_mask.kv_num_blocks, block_mask.kv_indices)
    classes = partial.clone()
    if block_mask.full_kv_num_blocks is not None:
        classes += 2 * dense(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
    nq, nkv = (
        math.ceil(n / b) for n, b in zip(block_mask.seq_lengths, block_mask.BLOCK_SIZE, strict=True)
    )
    return classes[:nq, :nkv].cpu()


def _tile_share(keep: torch.Tensor, bq: int, bkv: int) -> torch.Tensor:
    """(rows <= bq, cols) bool -> (ceil(cols / bkv),) share kept of each block; padding masked."""
    rows, cols = keep.shape
    keep_f = torch.nn.functional.pad(keep.to(torch.float32), (0, -cols % bkv, 0, bq - rows))
    return keep_f.view(bq, -1, bkv).mean(dim=(0, 2))


def zoom_origin(kept: torch.Tensor, cell: int, window: int, seq_len: int) -> tuple[int, int]:
    """(first query, first key) of the `window`-token square where the mask is most telling.

    Most telling: the most cells where the pooled mask differs from its neighbour one cell down
    the diagonal, i.e. where the mask stops being a function of q - kv (document boundaries, the
    end of a prefix, sink columns, chunk edges). A mask that is a function of q - kv everywhere
    (causal, a sliding window) scores by its partially kept cells, its edges; ties go to the
    earliest square. Squares on the diagonal weigh up to twice as much. Unmasked variants get
    the top-left corner.

    A mask that is neither causal nor full is zoomed only where the square shows both: a part
    that causal attention would draw otherwise and a part that is masked. Else a sliding window
    longer than the zoom would be shown at its start, where it looks exactly like causal.
    """
    side = max(1, min(kept.shape[0], window // cell))
    differs = (kept[:-1, :-1] - kept[1:, 1:]).abs()
    shift = torch.zeros_like(kept)
    shift[:-1, :-1] += differs  # both cells of a pair that differ: the square holding the
    shift[1:, 1:] += differs  # feature's two sides beats one that ends on it
    edges = (kept > 0) & (kept < 1)
    if cell == 1:  # one token a cell: no cell is kept in part; edges are where neighbours differ
        edges[:, :-1] |= kept[:, :-1] != kept[:, 1:]
        edges[:-1, :] |= kept[:-1, :] != kept[1:, :]
    edges = edges.float()
    # Edges count half: among squares on a document boundary, the one where it meets the
    # diagonal wins; a shift-invariant mask is zoomed on its first stretch of edges.
    causal, full = _pooled_causal_and_full(kept.shape[0], cell, seq_len)
    # An edge causal attention does not have (a window's far edge, a prefix's end) counts in
    # full: it is what the picture is for.
    own_edges = edges * ((kept - causal).abs() > 1e-6).float()
    score = shift + 0.5 * edges + own_edges
    pooled = torch.nn.functional.avg_pool2d(score[None, None], side, stride=1)[0, 0]
    # Up to twice the weight for squares centred on the diagonal, where queries meet their own
    # neighbourhood: a document boundary is shown where it cuts the diagonal, not along its edge.
    rows = torch.arange(pooled.shape[0]).view(-1, 1)
    cols = torch.arange(pooled.shape[1]).view(1, -1)
    pooled = pooled * (2.0 - ((rows - cols).abs() / side).clamp(max=1.0))
    telling = []
    for reference in (causal, full):
        apart = ((kept - reference).abs() > 1e-6).float()
        if not apart.any():  # the mask is this reference: any square shows it
            break
        telling.append(torch.nn.functional.avg_pool2d(apart[None, None], side, stride=1)[0, 0])
    else:
        shows_both = (telling[0] > 0) & (telling[1] > 0)
        if shows_both.any():
            pooled = pooled.masked_fill(~shows_both, -1.0)
    flat = int(torch.argmax(pooled))  # the first maximum: the earliest square
    i, j = divmod(flat, pooled.shape[1])
    limit = seq_len - window
    return min(i * cell, limit), min(j * cell, limit)


def _pooled_causal_and_full(cells: int, cell: int, seq_len: int) -> tuple[torch.Tensor, ...]:
    """pooled_keep of causal attention and of no mask, computed in closed form (cells on both
    axes are the same token ranges, so a diagonal cell keeps its lower triangle)."""
    sizes = (seq_len - torch.arange(cells) * cell).clamp(max=cell).to(torch.float32)
    full = sizes.view(-1, 1) * sizes.view(1, -1) / cell**2
    lower = torch.ones(cells, cells).tril(-1)
    causal = full * lower + torch.diag(sizes * (sizes + 1) / 2 / cell**2)
    return causal, full


def _shifted(fn: Any, q0: int, k0: int) -> Any:
    """`fn` (a score_mod or mask_mod) called with positions offset by (q0, k0), or None."""
    if fn is None:
        return None

    def at_offset(*args):
        *rest, q_idx, kv_idx = args
        return fn(*rest, q_idx + q0, kv_idx + k0)

    return at_offset


def _draw_overview(fig, ax, variant, kept, cell, seq_len, head_dim, gen) -> None:
    """The whole sequence: kept share per cell, or the score_mod's bias at each cell's centre."""
    import numpy as np

    cells = kept.shape[0]
    extent = (0, cells * cell, cells * cell, 0)
    if variant.score_mod is None:
        # Kept shares from 0+ to 1 on the upper three quarters of the colormap: a cell with one
        # kept entry in 256 still reads as kept, against the grey of fully masked cells.
        shown = np.ma.masked_array(0.25 + 0.75 * kept.numpy(), mask=(kept == 0).numpy())
        cmap = _colormap("Blues").with_extremes(bad=MASKED_COLOUR)
        image = ax.imshow(
            shown, cmap=cmap, vmin=0, vmax=1, interpolation="nearest", aspect="auto", extent=extent
        )
        bar = fig.colorbar(image, ax=ax, shrink=0.9, ticks=[0.25, 0.625, 1.0])
        bar.ax.set_yticklabels(["~0%", "50%", "100%"])
        bar.set_label(f"share of each {cell} x {cell} cell kept")
        ax.set_title("whole sequence: what the mask keeps")
    else:
        centres = torch.arange(cells, dtype=torch.int32) * cell + cell // 2
        centres = centres.clamp(max=seq_len - 1)
        raw = torch.randn(cells, cells, generator=gen)
        b = torch.zeros((), dtype=torch.int32)
        modded = variant.score_mod(raw, b, b, centres.view(-1, 1), centres.view(1, -1))
        bias = (torch.broadcast_to(modded, raw.shape) - raw).double().numpy()
        shown = np.ma.masked_array(bias, mask=(kept == 0).numpy())
        limit = float(np.abs(bias).max()) or 1.0
        cmap = _colormap("RdBu_r").with_extremes(bad=MASKED_COLOUR)
        image = ax.imshow(
            shown,
            cmap=cmap,
            vmin=-limit,
            vmax=limit,
            interpolation="nearest",
            aspect="auto",
            extent=extent,
        )
        fig.colorbar(image, ax=ax, shrink=0.9, label="score_mod(s) - s, s ~ N(0, 1)")
        ax.set_title("whole sequence: what the score_mod adds")
    ax.set_xlim(0, seq_len)
    ax.set_ylim(seq_len, 0)
    tokens = _token_formatter()
    ax.xaxis.set_major_formatter(tokens)
    ax.yaxis.set_major_formatter(tokens)
    ax.set_xlabel("key position")
    ax.set_ylabel("query position")


def _outline(ax, q0: int, k0: int, side: int) -> None:
    """The zoom's square on the overview, at least a few points wide so it shows at any S."""
    from matplotlib.patches import Rectangle

    ax.add_patch(Rectangle((k0, q0), side, side, fill=False, edgecolor=ZOOM_COLOUR, linewidth=1.5))


def _draw_transfer(ax, score_mod: ScoreMod, seq_len: int) -> None:
    """score_mod(s) against s at a few distances q - kv, beside the identity (no change)."""
    s = torch.linspace(-100.0, 100.0, 401)
    b = torch.zeros((), dtype=torch.int32)
    q = torch.tensor(seq_len - 1, dtype=torch.int32)
    ax.plot(s.numpy(), s.numpy(), color="0.6", linestyle=":", label="unchanged")
    distances = sorted({0, seq_len // 8, seq_len // 2})
    for d, style in zip(distances, ("-", "--", "-."), strict=False):
        out = torch.broadcast_to(score_mod(s, b, b, q, q - d), s.shape)
        ax.plot(s.numpy(), out.double().numpy(), linestyle=style, label=f"q - kv = {d:,}")
    ax.set_xlabel("score s before score_mod")
    ax.set_ylabel("score after score_mod")
    ax.set_title("score_mod at head 0")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")


def _token_formatter():
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(_token_label)


# --------------------------------------------------------------------------------------------
# Block-level picture of a whole mask


def block_mask_classes(
    mask_mod: MaskMod | None,
    seq_q: int,
    seq_kv: int,
    block_size: tuple[int, int] = (128, 128),
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """Classify every (q block, kv block) pair of a mask, without an S x S tensor.

    The mask is evaluated at batch 0, head 0, on int32 positions (as FlexAttention's kernels pass
    them), one tile of `block_size[0]` query rows by up to ~1M / block_size[0] keys at a time.
    Positions past the end of the sequence count as masked, as in FlexAttention's
    `create_block_mask`: a block cut by the end of the sequence is never full.

    Args:
        mask_mod: `(b, h, q_idx, kv_idx) -> bool`, or None (every block full).
        seq_q: query length Sq.
        seq_kv: key length Skv.
        block_size: (q block, kv block) sizes.
        device: where to evaluate the mask.

    Returns:
        (ceil(Sq / bq), ceil(Skv / bkv)) uint8 on the CPU: 0 empty, 1 partial, 2 full.
    """
    for name, value in (("seq_q", seq_q), ("seq_kv", seq_kv)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    bq, bkv = _check_block_size(block_size)
    dev = resolve_device(device)
    nq, nkv = math.ceil(seq_q / bq), math.ceil(seq_kv / bkv)
    classes = torch.full((nq, nkv), FULL, dtype=torch.uint8, device=dev)  # on dev: no sync a tile
    if mask_mod is None:
        return classes.cpu()

    tile_kv_blocks = max(1, _TILE_ELEMENTS // (bq * bkv))
    cols = tile_kv_blocks * bkv
    b = torch.zeros((), dtype=torch.int32, device=dev)
    h = torch.zeros((), dtype=torch.int32, device=dev)
    with _one_cpu_thread(dev):
        _walk_tiles(mask_mod, classes, b, h, seq_q, seq_kv, bq, bkv, cols, _tile_classes)
    return classes.cpu()


@contextlib.contextmanager
def _one_cpu_thread(dev: torch.device) -> Iterator[None]:
    """Run torch's CPU ops on one thread for the duration, then restore the thread count.

    The tiles are thousands of small ops. With several intra-op threads each op synchronises the
    pool, and on a busy machine a thread spinning for a descheduled peer makes the whole pass
    10x or more slower (measured on 2 loaded cores: 118 s with 2 threads, 8 s with 1). One
    thread gives a predictable time everywhere.
    """
    if dev.type != "cpu":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _walk_tiles(mask_mod, out, b, h, seq_q, seq_kv, bq, bkv, cols, reduce) -> None:
    """Fill `out` (nq, nkv) in place, one (bq rows x `cols` keys) tile of the mask at a time;
    `reduce(keep, bq, bkv)` turns a tile's (rows, cols) keep mask into its row of blocks."""
    dev = out.device
    for i in range(out.shape[0]):
        q0 = i * bq
        q_idx = torch.arange(q0, min(q0 + bq, seq_q), dtype=torch.int32, device=dev).view(-1, 1)
        for c0 in range(0, seq_kv, cols):
            kv_idx = torch.arange(c0, min(c0 + cols, seq_kv), dtype=torch.int32, device=dev)
            keep = torch.as_tensor(mask_mod(b, h, q_idx, kv_idx.view(1, -1)), device=dev)
            keep = torch.broadcast_to(keep, (q_idx.shape[0], kv_idx.shape[0]))
            out[i, c0 // bkv : c0 // bkv + math.ceil(kv_idx.shape[0] / bkv)] = reduce(keep, bq, bkv)


def _check_block_size(block_size: Any) -> tuple[int, int]:
    ok = isinstance(block_size, tuple | list) and len(block_size) == 2
    ok = ok and all(not isinstance(x, bool) and isinstance(x, int) and x > 0 for x in block_size)
    if not ok:
        raise ValueError(f"block_size must be two positive integers (q, kv), got {block_size!r}")
    return int(block_size[0]), int(block_size[1])


def _tile_classes(keep: torch.Tensor, bq: int, bkv: int) -> torch.Tensor:
    """(rows <= bq, cols) bool → (ceil(cols / bkv),) uint8 classes; padding counts as masked."""
    rows, cols = keep.shape
    pad_rows, pad_cols = bq - rows, -cols % bkv
    keep_u8 = keep.to(torch.bool).contiguous().view(torch.uint8)
    if pad_rows or pad_cols:
        keep_u8 = torch.nn.functional.pad(keep_u8, (0, pad_cols, 0, pad_rows))
    blocks = keep_u8.view(bq, -1, bkv)  # (bq, kv blocks, bkv)
    # max/min over the contiguous axis first: much faster than any/all over both axes at once.
    any_kept = blocks.amax(dim=2).amax(dim=0)
    all_kept = blocks.amin(dim=2).amin(dim=0)
    return (any_kept + all_kept).to(torch.uint8)  # 0 empty, 1 partial, 2 full


def classes_sparsity(classes: torch.Tensor) -> float:
    """Fraction of block pairs that are empty (what FlexAttention skips)."""
    return float((classes == EMPTY).double().mean())


def save_block_mask_picture(
    mask_mod: MaskMod | None,
    seq_q: int,
    seq_kv: int,
    path: str | pathlib.Path,
    *,
    block_size: tuple[int, int] = (128, 128),
    title: str | None = None,
    device: str | torch.device = "cpu",
    classes: torch.Tensor | None = None,
) -> pathlib.Path:
    """Draw the block classes of a mask at full length and save them as a PNG.

    Args:
        mask_mod: `(b, h, q_idx, kv_idx) -> bool`, or None.
        seq_q: query length Sq.
        seq_kv: key length Skv.
        path: the PNG file, or a folder (saves `<path>/block_mask.png`).
        block_size: (q block, kv block) sizes.
        title: first line of the title; default the mask_mod's name.
        device: where to evaluate the mask.
        classes: the block classes already known (block_classes of the run's BlockMask at
            `block_size`): nothing is evaluated.

    Returns:
        The path written.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import BoundaryNorm, ListedColormap
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch
    from matplotlib.ticker import FuncFormatter, MultipleLocator

    if classes is None:
        classes = block_mask_classes(mask_mod, seq_q, seq_kv, block_size, device)
    bq, bkv = _check_block_size(block_size)
    counts = [int((classes == c).sum()) for c in (EMPTY, PARTIAL, FULL)]
    total = classes.numel()
    if title is None:
        title = getattr(mask_mod, "__name__", "mask") if mask_mod is not None else "no mask"
    subtitle = (
        f"{seq_q:,} x {seq_kv:,} tokens, blocks {bq} x {bkv}: "
        f"sparsity {100.0 * counts[EMPTY] / total:.1f}% of blocks skipped"
    )

    # ~1 pixel per block or more for up to ~1000 blocks a side, so partial diagonals stay visible.
    nq, nkv = classes.shape
    dpi = 150 if max(nq, nkv) > 512 else 120
    fig = Figure(figsize=(8.0, 7.2), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.imshow(
        classes.numpy(),
        cmap=ListedColormap(CLASS_COLOURS),
        norm=BoundaryNorm([-0.5, 0.5, 1.5, 2.5], 3),
        interpolation="nearest",
        aspect="auto",
        extent=(0, nkv * bkv, nq * bq, 0),
    )
    ax.set_xlim(0, seq_kv)  # a block cut by the end of the sequence is drawn cut too
    ax.set_ylim(seq_q, 0)
    tokens = FuncFormatter(_token_label)
    for axis, extent in ((ax.xaxis, nkv * bkv), (ax.yaxis, nq * bq)):
        # Ticks at powers of two (8K, 16K, ...): the sizes people choose for sequences and blocks.
        axis.set_major_locator(MultipleLocator(2 ** max(0, math.ceil(math.log2(extent / 8)))))
        axis.set_major_formatter(tokens)
    ax.set_xlabel("key position (tokens)")
    ax.set_ylabel("query position (tokens)")
    ax.set_title(f"{title}\n{subtitle}", fontsize="medium")
    handles = [
        Patch(facecolor=CLASS_COLOURS[c], edgecolor="0.3", label=f"{CLASS_NAMES[c]}: {counts[c]:,}")
        for c in (FULL, PARTIAL, EMPTY)
    ]
    fig.legend(handles=handles, loc="outside lower center", ncols=3, fontsize="small")
    out = png_path(path, "block_mask")
    save_png(fig, out)
    return out


def _token_label(value: float, _pos: Any = None) -> str:
    """Token counts as 0, 512, 8K, 64K, 1M."""
    v = int(round(value))
    if v >= 1 << 20 and v % (1 << 20) == 0:
        return f"{v >> 20}M"
    if v >= 1024 and v % 1024 == 0:
        return f"{v >> 10}K"
    return f"{v:,}"


def save_batch_times(
    series: Mapping[str, list[tuple[float, float]]],
    path: str | pathlib.Path,
    *,
    title: str,
    time_label: str,
) -> pathlib.Path:
    """A workload's batches: each batch's time against its longest document, one line a series
    (a run's own call and its contenders, or a sweep's schemes), so a long tail's cost, and
    which handles it best, show at a glance. `series`: {label: [(longest document, ms)]}."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.0, 4.2), layout="constrained")
    ax = fig.add_subplot()
    for i, (name, points) in enumerate(series.items()):
        points = sorted(points)
        if points:
            ax.plot(*zip(*points, strict=True), marker="os^vD<>"[i % 7], linestyle="-",
                    linewidth=0.8, label=name)  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(_token_formatter())
    ax.set_xlabel("the batch's longest document (tokens)")
    ax.set_ylabel(time_label)
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # no series with a time: no legend to draw
        ax.legend(fontsize=8)
    return save_png(fig, pathlib.Path(path))
