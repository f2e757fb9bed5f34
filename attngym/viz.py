"""Pictures of attention: the seed's score heatmap and a block-level picture of a whole mask.

Two pictures answer two questions:

* The heatmap (`plot_attention_scores`, `visualize_attention_scores`, `save_heatmap`) shows the
  post-score_mod scores of one batch and head on a small window, so a reader sees what the
  variant does token by token. It needs the dense (Sq, Skv) matrix, so it is for small windows.
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
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from attngym.device import resolve_device
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
) -> Figure:
    """The one heatmap body: every heatmap of the project is drawn here."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    scores = _head_scores(query, key, score_mod, mask_mod, device, scale, batch_idx, head_idx)
    values = scores.detach().double().cpu().numpy()
    masked = ~np.isfinite(values)
    data = np.ma.masked_array(values, mask=masked)
    seq_q, seq_kv = values.shape

    fig = Figure(figsize=(7.0, 6.0), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    cmap = _colormap("viridis").with_extremes(bad=MASKED_COLOUR)
    image = ax.imshow(
        data,
        cmap=cmap,
        interpolation="nearest",
        aspect="auto",
        extent=(-0.5, seq_kv - 0.5, seq_q - 0.5, -0.5),
    )
    fig.colorbar(image, ax=ax, label="score (after score_mod)", shrink=0.9)
    ax.set_xlabel("key position")
    ax.set_ylabel("query position")
    ax.set_title(title)
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
    return fig


def _colormap(name: str):
    import matplotlib

    return matplotlib.colormaps[name]


def plot_attention_scores(
    query: torch.Tensor,
    key: torch.Tensor,
    score_mod: ScoreMod | None = None,
    mask_mod: MaskMod | None = None,
    device: str = "cuda",
    batch_idx: int = 0,
    head_idx: int = 0,
    scale: float | None = None,
) -> Figure:
    """A heatmap of the post-mod scores of one batch and head, as a matplotlib Figure.

    Args: as `visualize_attention_scores`, without `name` and `path`.

    Returns:
        The Figure (Agg canvas; save it with `fig.savefig(...)`).
    """
    return _score_figure(
        query, key, score_mod, mask_mod, device, batch_idx, head_idx, scale, "attention scores"
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
        name: title of the picture and file name when `path` is a folder or None.
        path: a folder (saves `<path>/<name>.png`), a file (its suffix becomes .png), or None
            (saves `./<name>.png`).
        batch_idx: batch row to draw.
        head_idx: query head to draw.
        scale: score scale, default 1 / sqrt(D).

    Returns:
        The absolute path written (also logged at INFO), since `path=None` means the current
        folder.
    """
    fig = _score_figure(query, key, score_mod, mask_mod, device, batch_idx, head_idx, scale, name)
    out = png_path(path, name).resolve()
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
) -> pathlib.Path:
    """Draw a variant's scores on the first `min(window, seq_len)` positions of random q, k.

    Args:
        variant: the attention variant (its buffers are moved to the CPU).
        path: the PNG file, or a folder (saves `<path>/<variant.name>.png`).
        seq_len: the run's sequence length (variants built for one length need it).
        window: how many leading positions to draw.
        head_dim: D of the random q, k.
        seed: seed of the random q, k.

    Returns:
        The path written.
    """
    for name, value in (("seq_len", seq_len), ("window", window), ("head_dim", head_dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    variant.check_seq_len(seq_len)
    variant = variant.to("cpu")
    n = min(window, seq_len)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 1, n, head_dim, generator=gen)
    k = torch.randn(1, 1, n, head_dim, generator=gen)
    params = ", ".join(f"{k}={v}" for k, v in variant.params.items())
    title = f"{variant.name}({params})" if params else variant.name
    title += f"\nscores of the first {n} of {seq_len} tokens (random q, k)"
    fig = _score_figure(q, k, variant.score_mod, variant.mask_mod, "cpu", 0, 0, None, title)
    out = png_path(path, variant.name)
    save_png(fig, out)
    return out


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
        _classify_tiles(mask_mod, classes, b, h, seq_q, seq_kv, bq, bkv, cols, dev)
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


def _classify_tiles(mask_mod, classes, b, h, seq_q, seq_kv, bq, bkv, cols, dev) -> None:
    """Fill `classes` (nq, nkv) in place, one (bq rows x `cols` keys) tile at a time."""
    for i in range(classes.shape[0]):
        q0 = i * bq
        q_idx = torch.arange(q0, min(q0 + bq, seq_q), dtype=torch.int32, device=dev).view(-1, 1)
        for c0 in range(0, seq_kv, cols):
            kv_idx = torch.arange(c0, min(c0 + cols, seq_kv), dtype=torch.int32, device=dev)
            keep = torch.as_tensor(mask_mod(b, h, q_idx, kv_idx.view(1, -1)), device=dev)
            keep = torch.broadcast_to(keep, (q_idx.shape[0], kv_idx.shape[0]))
            classes[i, c0 // bkv : c0 // bkv + math.ceil(kv_idx.shape[0] / bkv)] = _tile_classes(
                keep, bq, bkv
            )


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

    Returns:
        The path written.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import BoundaryNorm, ListedColormap
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch
    from matplotlib.ticker import FuncFormatter, MultipleLocator

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
