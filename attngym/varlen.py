"""FlashAttention's varlen kernels as contenders, on attngym's inputs packed as they take them.

What a user runs instead of flex for a window or packed documents is not SDPA over a dense mask
but a varlen kernel: PyTorch's `torch.nn.attention.varlen.varlen_attn` (`varlen`) or flash-attn's
`flash_attn_varlen_func` (`flash_varlen`: FlashAttention 3's `flash_attn_interface` where it
imports, else FlashAttention 2's `flash_attn`). Both take the B sequences of a batch packed into
T = B·S rows, split into documents by cumulative offsets (`cu_seqlens`), and a (left, right)
window inside each document; a Variant whose mask is that says so (`Variant.varlen`). Every other
mask, and any score_mod, is refused with the reason, as are a CPU and a 32/64-bit dtype.

The kernels are imported when a call is made, never with attngym.

Shape legend: B batch, H query heads, G key/value heads, S sequence, D head dim, T = B·S rows.
"""

from __future__ import annotations

import importlib
import inspect
import itertools
from collections.abc import Callable

import torch

from attngym.variants.base import Variant, Varlen

KERNELS = ("varlen", "flash_varlen")
DTYPES = (torch.bfloat16, torch.float16)  # what FlashAttention's kernels compute in


def refusal(kernel: str, variant: Variant, device: torch.device, dtype: torch.dtype,
            gqa: bool = False) -> str | None:  # fmt: skip
    """Why `kernel` cannot run this variant here, in words; None where it can."""
    if variant.varlen is None:
        if variant.score_mod is not None:
            return "no varlen form: a score_mod"
        return "no varlen form (documents and a window only)"
    if device.type != "cuda":
        return f"a CUDA kernel, device={device.type}"
    if dtype not in DTYPES:
        return f"takes bfloat16 or float16, not {_name(dtype)}"
    if kernel == "flash_varlen":
        return None if _flash_attn() is not None else "flash-attn is not installed"
    fn = _torch_varlen()
    if fn is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn"
    params = inspect.signature(fn).parameters
    form = variant.varlen
    if "window_size" not in params and (form.left >= 0 or form.right > 0):
        return f"torch {torch.__version__}'s varlen_attn takes no window_size"
    if gqa and "enable_gqa" not in params:
        return f"torch {torch.__version__}'s varlen_attn takes no enable_gqa (kv_heads < heads)"
    return None


def pack(t_BHSD: torch.Tensor) -> torch.Tensor:
    """(B, H, S, D) as the packed (T, H, D) rows a varlen kernel reads, a new tensor."""
    b, h, s, d = t_BHSD.shape
    return t_BHSD.transpose(1, 2).reshape(b * s, h, d)


def unpack(t_THD: torch.Tensor, batch: int) -> torch.Tensor:
    """Packed (T, H, D) rows back as (B, H, S, D)."""
    t, h, d = t_THD.shape
    return t_THD.reshape(batch, t // batch, h, d).transpose(1, 2)


def offsets(
    form: Varlen, batch: int, seq_len: int, device: torch.device
) -> tuple[torch.Tensor, int]:
    """(cu_seqlens, longest): the int32 offsets of every document of every batch element in the
    packed rows, (N + 1,), and the longest document."""
    lengths = list(form.documents or (seq_len,)) * batch
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
    return cu, max(lengths)


def call(
    kernel: str, variant: Variant, q_THD: torch.Tensor, k_TGD: torch.Tensor, v_TGD: torch.Tensor,
    batch: int,
) -> Callable[[], torch.Tensor]:  # fmt: skip
    """The kernel's call on packed q, k, v (their offsets made once, outside it); returns the
    packed output (T, H, D). Check `refusal` first."""
    form = variant.varlen
    seq_len = q_THD.shape[0] // batch
    cu, longest = offsets(form, batch, seq_len, q_THD.device)
    window = (form.left, form.right)
    if kernel == "flash_varlen":
        fn = _flash_attn()

        def flash() -> torch.Tensor:
            out = fn(q_THD, k_TGD, v_TGD, cu, cu, longest, longest, causal=form.right == 0,
                     window_size=window)  # fmt: skip
            return out[0] if isinstance(out, tuple) else out

        return flash
    fn = _torch_varlen()
    params = inspect.signature(fn).parameters
    extra: dict = {}
    if "window_size" in params:
        extra["window_size"] = window
    elif form.right == 0:  # an older varlen_attn: causal or full only (refusal says so)
        extra["is_causal"] = True
    if k_TGD.shape[1] != q_THD.shape[1]:
        extra["enable_gqa"] = True
    return lambda: fn(q_THD, k_TGD, v_TGD, cu, cu, longest, longest, **extra)


def _torch_varlen() -> Callable[..., torch.Tensor] | None:
    try:
        return importlib.import_module("torch.nn.attention.varlen").varlen_attn
    except (ImportError, AttributeError):
        return None


def _flash_attn() -> Callable[..., torch.Tensor] | None:
    """flash-attn's flash_attn_varlen_func: FlashAttention 3 where it imports, else 2."""
    for module in ("flash_attn_interface", "flash_attn"):
        try:
            return importlib.import_module(module).flash_attn_varlen_func
        except (ImportError, AttributeError):
            continue
    return None


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
