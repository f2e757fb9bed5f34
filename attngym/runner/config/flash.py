"""FLASH and Triton rules: what flex's FLASH backend and its Triton kernels need of the dtype,
the device, the block sizes and the kernel options, refused in one line before anything compiles.

Apart because others ask them outside a config check: the single-device task and the tuner
(`flash_refusal`, `flash_refusal_of`: why a run could not take FLASH), the tuner's search space
(`backward_block_error`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from attngym.errors import ConfigError
from attngym.runner.config.settings import Settings, _flash_block_size


def _flash(kernel_options: Mapping[str, Any] | None) -> bool:
    """attngym.kernels.is_flash, imported when first needed: `import attngym.runner.config` pulls no
    torch."""
    from attngym.kernels import is_flash

    return is_flash(kernel_options)


def _flash_needs_16_bit(data: dict[str, Any]) -> None:
    """BACKEND=FLASH needs a 16-bit dtype."""
    dtype = data["dtype"]
    if _flash(data["kernel_options"]) and dtype in ("float32", "float64"):
        raise ConfigError(
            "kernel_options.BACKEND",
            f"FLASH needs a 16-bit dtype (bfloat16 or float16), but dtype={dtype}",
        )


def _flash_needs_compile(data: dict[str, Any]) -> None:
    """BACKEND=FLASH is an Inductor kernel: it exists only compiled."""
    if _flash(data["kernel_options"]) and not data["compile"]:
        raise ConfigError(
            "compile",
            "BACKEND=FLASH is a torch.compile (Inductor) kernel; compile=false would run flex's "
            "eager path without it; use compile=true or drop kernel_options.BACKEND",
        )


def _flash_on_this_device(data: dict[str, Any]) -> None:
    """BACKEND=FLASH on the resolved device: a CUDA device, and the block size its kernel has.

    The flash kernel is built for one block size per GPU generation
    (attngym.device.get_flash_block_size); any other block mask cannot run on it.
    """
    if not _flash(data["kernel_options"]):
        return
    device = data["device"]["name"]
    if device != "cuda":
        raise ConfigError(
            "kernel_options.BACKEND",
            f"FLASH is a CUDA backend, but device={device}; use device=cuda or drop BACKEND",
        )
    need = _flash_block_size(device)
    got = (data["block_size"]["q"], data["block_size"]["kv"])
    if got != need:
        raise ConfigError(
            "block_size",
            f"FLASH needs block_size (q, kv) = {need} on this GPU, got {got}; use block_size=flash",
        )


def _flash_is_installed(data: dict[str, Any]) -> None:
    """BACKEND=FLASH on a machine where flash-attn-4 and its CuTe DSL import: else Inductor
    fails while compiling the first call (`No module named 'cutlass'`)."""
    from attngym.tuning import flash_missing

    if _flash(data["kernel_options"]) and (why := flash_missing()):
        raise ConfigError(
            "kernel_options.BACKEND",
            f"FLASH runs flash-attn-4's kernels, but {why}; pip install --pre flash-attn-4 "
            '"nvidia-cutlass-dsl[cu13]" (or [cu12]), or drop BACKEND',
        )


# Triton flex's tiles and the block-mask side each one walks: forward (fwd_ or plain) and
# backward (bwd_ or plain; M1/N1 compute dK and dV, M2/N2 compute dQ).
TRITON_TILES = (
    ("fwd_", "BLOCK_M", "q"),
    ("fwd_", "BLOCK_N", "kv"),
    ("bwd_", "BLOCK_M1", "q"),
    ("bwd_", "BLOCK_N1", "kv"),
    ("bwd_", "BLOCK_M2", "q"),
    ("bwd_", "BLOCK_N2", "kv"),
)


def _triton_tiles_divide_blocks(data: dict[str, Any]) -> None:
    """On CUDA, Triton flex tiles each block of the block mask: every tile it is given (forward
    BLOCK_M/BLOCK_N, backward BLOCK_M1/N1/M2/N2, with or without their fwd_/bwd_ prefix) must
    divide the block size of its side, else Inductor refuses the kernel while compiling (a
    tuning trial that asks for it fails at once, not after a compile). FLASH picks its own
    tiles; a CPU runs eager flex, which has none."""
    options = data["kernel_options"]
    if _flash(options) or not str(data["device"]["name"]).startswith("cuda"):
        return
    for prefix, tile, side in TRITON_TILES:
        key = f"{prefix}{tile}" if f"{prefix}{tile}" in options else tile
        size, block = options.get(key), data["block_size"][side]
        if isinstance(size, int) and size > 0 and block % size:
            raise ConfigError(
                f"kernel_options.{key}",
                f"{size} must divide block_size.{side} ({block}): Triton flex tiles each block; "
                f"use a divisor of {block} or a larger block_size.{side}",
            )


# Inductor's backward kernel walks several inner tiles inside an outer one (static asserts in
# its template): (inner, outer), the outer tile a multiple of the inner one.
NESTED_BACKWARD_TILES = (("BLOCK_M1", "BLOCK_N1"), ("BLOCK_N2", "BLOCK_M2"))


def _triton_backward_tiles_nest(data: dict[str, Any]) -> None:
    """On CUDA, Triton flex's backward needs BLOCK_N1 a multiple of BLOCK_M1 (dK, dV) and
    BLOCK_M2 a multiple of BLOCK_N2 (dQ), else its template fails to compile (a CompilationError
    in bwd_dkdv_inner or bwd_dq_inner, after the compile has started): refused here at once."""
    options = data["kernel_options"]
    if (
        _flash(options)
        or "bwd" not in data["passes"]
        or not str(data["device"]["name"]).startswith("cuda")
    ):
        return
    for inner, outer in NESTED_BACKWARD_TILES:
        keys = [f"bwd_{t}" if f"bwd_{t}" in options else t for t in (inner, outer)]
        small, large = (options.get(k) for k in keys)
        if isinstance(small, int) and isinstance(large, int) and small > 0 and large % small:
            raise ConfigError(
                f"kernel_options.{keys[1]}",
                f"{large} must be a multiple of kernel_options.{keys[0]} ({small}): Triton "
                f"flex's backward walks {inner} tiles inside each {outer} one",
            )


def backward_block_error(
    blocks: Mapping[str, int], tiles: Sequence[tuple[int, int, int, int]]
) -> tuple[str, str] | None:
    """(key, why) where no backward tile set divides the block sizes (device.backward_tiles_fit,
    Inductor's own filter); None where one does."""
    from attngym.device import backward_tiles_fit

    if backward_tiles_fit(tiles, q=blocks["q"], kv=blocks["kv"]):
        return None
    side = "kv" if backward_tiles_fit(tiles, q=blocks["q"]) else "q"
    shown = ", ".join(f"M1 {m1} N1 {n1} M2 {m2} N2 {n2}" for m1, n1, m2, n2 in tiles)
    return f"block_size.{side}", (
        f"{blocks[side]} has no Triton backward kernel on this GPU: Inductor's backward tiles "
        f"({shown}) must divide the block sizes; use a larger block_size.{side} (e.g. 128), "
        "BACKEND=FLASH, or passes=[fwd]"
    )


def _triton_backward_has_a_kernel(data: dict[str, Any]) -> None:
    """On CUDA, compiled flex's Triton backward only exists for block sizes one of Inductor's
    backward tiles divides (attngym.device.triton_backward_tiles): refused here in one line, not
    after a compile with pages of Inductor's IR."""
    if (
        _flash(data["kernel_options"])
        or "bwd" not in data["passes"]
        or not data["compile"]
        or not str(data["device"]["name"]).startswith("cuda")
    ):
        return
    from attngym.device import triton_backward_tiles

    tiles = triton_backward_tiles(
        data["shape"]["head_dim"],
        data["dtype"],
        data["device"]["name"],
        autotune=str(data["compile_mode"]).startswith("max-autotune"),
    )
    refused = backward_block_error(data["block_size"], tiles) if tiles else None
    if refused:
        raise ConfigError(*refused)


FLASH_RULES = (
    _flash_needs_16_bit,
    _flash_needs_compile,
    _flash_on_this_device,
    _flash_is_installed,
)


def flash_refusal(settings: Settings) -> str | None:
    """Why this single-device run could not take FlexAttention's FLASH backend: the first FLASH
    rule its settings break with BACKEND=FLASH and block_size=flash, in one line; None where
    every rule passes (the kernel may still refuse what no rule here knows)."""
    return flash_refusal_of(
        settings.device, settings.dtype, settings.compile, settings.kernel_options,
        settings.block_size,
    )  # fmt: skip


def flash_refusal_of(
    device: str,
    dtype: str,
    compile: bool,
    kernel_options: Mapping[str, Any],
    block_size: tuple[int, int] | None = None,
) -> str | None:
    """flash_refusal from the values themselves (the tuner asks before any run has Settings);
    `block_size` only matters off CUDA, where FLASH's own is not known."""
    blocks = _flash_block_size(device) if device == "cuda" else (block_size or (128, 128))
    data = {
        "kernel_options": {**kernel_options, "BACKEND": "FLASH"},
        "dtype": dtype,
        "compile": compile,
        "device": {"name": device},
        "block_size": {"q": blocks[0], "kv": blocks[1]},
    }
    for rule in FLASH_RULES:
        try:
            rule(data)
        except ConfigError as err:  # its message, less the key and the advice after "; "
            return str(err).removeprefix(f"{err.key}: ").split("; ")[0]
    return None
