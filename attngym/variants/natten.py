"""Neighbourhood attention (NATTEN) on a 2-D canvas of tokens.

Hassani et al., 2023, "Neighborhood Attention Transformer" (arXiv:2204.07143): every pixel attends
to the kernel_h x kernel_w pixels around it. Near the border the window is not cut short but shifted
inwards, so every query sees the same number of keys, which is what distinguishes it from a plain
2-D sliding window.
"""

from __future__ import annotations

from attngym.variants.base import Variant, positive_int, register


def _window_start(center, kernel: int, length: int):
    """First index of the kernel-wide window around `center`, shifted to lie inside [0, length)."""
    return (center - kernel // 2).clamp(0, length - kernel)


@register("natten")
def natten(canvas_w: int, canvas_h: int, kernel_w: int, kernel_h: int) -> Variant:
    """2-D neighbourhood attention on a row-major `canvas_h` x `canvas_w` canvas.

    Args:
        canvas_w: canvas width (columns), > 0.
        canvas_h: canvas height (rows), > 0.
        kernel_w: window width, 1 .. canvas_w.
        kernel_h: window height, 1 .. canvas_h.

    Note:
        Token t is the pixel at row `t // canvas_w`, column `t % canvas_w`; `seq_len` is
        `canvas_w * canvas_h`. Along each axis the window is `[s, s + kernel)` with
        `s = clamp(query - kernel // 2, 0, length - kernel)`: centred on the query, shifted inwards
        at the border (NATTEN's clamped centre). An even kernel leans towards earlier positions:
        `kernel // 2` pixels before the query and `kernel // 2 - 1` after it, away from the border.
    """
    canvas_w = positive_int("canvas_w", canvas_w)
    canvas_h = positive_int("canvas_h", canvas_h)
    kernel_w = positive_int("kernel_w", kernel_w)
    kernel_h = positive_int("kernel_h", kernel_h)
    if kernel_w > canvas_w:
        raise ValueError(f"kernel_w must be at most canvas_w={canvas_w}, got {kernel_w}")
    if kernel_h > canvas_h:
        raise ValueError(f"kernel_h must be at most canvas_h={canvas_h}, got {kernel_h}")

    def mask_mod(b, h, q_idx, kv_idx):
        q_row, q_col = q_idx // canvas_w, q_idx % canvas_w
        kv_row, kv_col = kv_idx // canvas_w, kv_idx % canvas_w
        row0 = _window_start(q_row, kernel_h, canvas_h)
        col0 = _window_start(q_col, kernel_w, canvas_w)
        rows = (kv_row >= row0) & (kv_row < row0 + kernel_h)
        cols = (kv_col >= col0) & (kv_col < col0 + kernel_w)
        return rows & cols

    mask_mod.__name__ = f"natten_{canvas_w}x{canvas_h}_kernel_{kernel_w}x{kernel_h}"
    whole_canvas = kernel_w == canvas_w and kernel_h == canvas_h
    return Variant(
        name="natten",
        params={
            "canvas_w": canvas_w,
            "canvas_h": canvas_h,
            "kernel_w": kernel_w,
            "kernel_h": kernel_h,
        },
        mask_mod=mask_mod,
        seq_len=canvas_w * canvas_h,
        sdpa="full" if whole_canvas else None,  # the window is the whole canvas
    )
