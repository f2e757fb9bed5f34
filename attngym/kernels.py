"""Attend one (q chunk, kv chunk) pair: the unit context parallelism and the tasks build on.

The variant is evaluated at *global* positions: query row i of the chunk is token q_offset + i, key
j is token kv_offset + j. Offsets are captured as 0-d tensors (under FLASH, position tables:
`offsets_as_tables`), so a compiled kernel is reused across chunks instead of being recompiled for
every offset.

Backends:
    flex      torch.compile(flex_attention) on CUDA with a block mask at `block_size` and
              `kernel_options` passed through; eager flex_attention on CPU (forward only).
    reference the dense float64/float32 oracle (attngym.reference); differentiable everywhere,
              so it is the CPU kernel when gradients are needed.
    auto      flex on CUDA, reference elsewhere.

Both return `(out_BHSD, lse_BHS)`: out in the input dtype; lse in float32 (float64 for float64
inputs), natural base (e), of the scaled, modified scores, -inf where a row has no key.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import logging
import math
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from attngym import reference
from attngym.errors import choice_error
from attngym.variants.base import MaskMod, ScoreMod, Variant

log = logging.getLogger(__name__)

BACKENDS = ("auto", "flex", "reference")


def resolve_backend(backend: str, device: torch.device) -> str:
    """`auto` → flex on CUDA, reference elsewhere; explicit choices are kept as given."""
    if backend not in BACKENDS:
        raise ValueError(choice_error("kernel backend", backend, BACKENDS))
    if backend == "auto":
        return "flex" if device.type == "cuda" else "reference"
    return backend


# One compiled graph per (variant callbacks' code, their constants, shapes, kernel options):
# a sweep of many variants and sequence lengths in one process needs far more than Dynamo's
# default of 8, and past the limit Dynamo silently runs flex eagerly (materialising S x S).
RECOMPILE_LIMIT = 256


# Block masks over more entries than this are built by a compiled create_block_mask on CUDA.
COMPILED_MASK_ENTRIES = 2**28

COMPILE_MODES = ("default", "max-autotune", "max-autotune-no-cudagraphs")


def is_flash(kernel_options: Mapping[str, Any] | None) -> bool:
    """Whether these kernel options pick the FLASH backend (flash-attn-4's CuTe DSL kernels)."""
    backend = (kernel_options or {}).get("BACKEND")
    return isinstance(backend, str) and backend.upper() == "FLASH"


def _flex_attention_constant_lse(*args, **kwargs):
    """flex_attention called with return_aux=AuxRequest(lse=True); returns (out, lse), the lse
    carrying no gradient.

    The FLASH backend's backward cannot differentiate through the log-sum-exp, and a compiled
    graph that returns a differentiable lse asks for exactly that, even when no loss uses it.
    """
    from torch.nn.attention.flex_attention import flex_attention

    out, aux = flex_attention(*args, **kwargs)
    return out, aux.lse.detach()


@functools.cache
def flash_lse_scaled_by_ln2() -> bool:
    """Whether this PyTorch returns FLASH's lse multiplied by ln 2 (a PyTorch bug, since fixed).

    flex_attention converts its Triton kernels' base-2 lse to base e by multiplying by ln 2, and
    older releases did so for FLASH too, whose lse is already base e. Measured on torch 2.11 with
    flash-attn-4 4.0.0b36: the returned lse was ln 2 x the reference lse to 5 digits in every
    variant; torch 2.13 skips the conversion for FLASH (`stats_are_log2`). Judged from the
    source, so a backport is recognised too; where the source is not installed, from the version.
    """
    import inspect

    import torch.nn.attention.flex_attention as flex_module

    try:
        return "stats_are_log2" not in inspect.getsource(flex_module)
    except (OSError, TypeError):
        scaled = torch.torch_version.TorchVersion(torch.__version__) < (2, 13)
        log.warning(
            "no source for flex_attention: taking FLASH's lse as %sscaled by ln 2 (torch %s)",
            "" if scaled else "not ",
            torch.__version__,
        )
        return scaled


def raise_recompile_limits() -> None:
    """Raise torch._dynamo's recompile limits for the whole process (to RECOMPILE_LIMIT), and
    make hitting one an error: past it Dynamo would run flex eagerly, materialising the whole
    score matrix, and a run would time that fallback as flex."""
    import torch._dynamo

    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
    config.accumulated_recompile_limit = max(
        config.accumulated_recompile_limit, 4 * RECOMPILE_LIMIT
    )
    config.fail_on_recompile_limit_hit = True


@functools.cache
def compiled_flex_attention(mode: str = "default", lse_grad: bool = True):
    """flex_attention compiled once per process, mode and lse_grad, with room for one graph per
    sweep job.

    `mode="max-autotune-no-cudagraphs"` lets Inductor time FlexAttention's candidate Triton
    configs at compile time (slow to compile, sometimes faster kernels). `lse_grad=False`
    compiles a flex_attention whose lse is detached inside the graph (see
    `_flex_attention_constant_lse`), for the FLASH backend.

    Dynamo guards closures by their code object and the constants they read, so rebuilding the
    same variant (or shifting it by tensor offsets) reuses the compiled kernel. The first call
    raises torch._dynamo's recompile limits for the whole process (to RECOMPILE_LIMIT).
    """
    from torch.nn.attention.flex_attention import flex_attention

    raise_recompile_limits()
    if mode not in COMPILE_MODES:
        raise ValueError(choice_error("compile mode", mode, COMPILE_MODES))
    fn = flex_attention if lse_grad else _flex_attention_constant_lse
    return torch.compile(fn, dynamic=False, mode=None if mode == "default" else mode)


def _named_gpu(device: torch.device) -> torch.device:
    """`device` with its GPU index: a cache key of "cuda" alone would not name the GPU."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


@functools.lru_cache(maxsize=4096)
def _offset_tensor(offset: int, device: torch.device, role: str) -> torch.Tensor:
    return torch.tensor(offset, device=device)


def position(offset: int | torch.Tensor, device: torch.device, role: str = "q") -> torch.Tensor:
    """A 0-d tensor of the offset on `device`, made once per (offset, device, role): making it
    per chunk call copies from pageable host memory, which synchronises the stream each time and
    leaves the GPU idle while the host queues the next chunk. The q and kv offsets of one call
    are distinct tensors (role "q" / "kv") even when equal: Dynamo compiles aliased inputs into
    a graph of their own, so a diagonal chunk pair would otherwise cost a second compile."""
    if isinstance(offset, torch.Tensor):
        return offset.to(device)
    return _offset_tensor(int(offset), _named_gpu(device), role)


def offsets_as_tables(kernel_options: Mapping[str, Any] | None) -> bool:
    """Whether shifted callbacks read global positions from tables (`position_table`) instead
    of adding 0-d offsets: under FLASH. torch 2.11's CuteDSL code generation loads a 0-d tensor
    through a constant index it cannot take (`ssa_to_indexable(0, cutlass.Int32)`: "Expected
    TensorSSA, but got <class 'int'>"); a table indexed by q_idx or kv_idx loads as the
    document variant's lookups do. Triton keeps the offsets: one scalar add per score."""
    return is_flash(kernel_options)


@functools.lru_cache(maxsize=4096)
def _table(offset: int, length: int, device: torch.device, role: str) -> torch.Tensor:
    return torch.arange(offset, offset + length, device=device, dtype=torch.int32)


def position_table(
    offset: int | torch.Tensor, length: int, device: torch.device, role: str = "q"
) -> torch.Tensor:
    """Global positions offset .. offset + length - 1 as a table, made once per (offset,
    length, device, role) as `position`'s offsets are. int32, as the kernels' indices are: a
    position the callbacks use to index a buffer (a document id) is stored in an int32
    index in FLASH's CuteDSL code, which refuses an int64."""
    if isinstance(offset, torch.Tensor):
        return (torch.arange(length, device=device) + offset.to(device)).to(torch.int32)
    return _table(int(offset), length, _named_gpu(device), role)


def with_mask_mod(block_mask, mask_mod):
    """The block mask's blocks with another mask_mod (the same mask, read another way)."""
    out = copy.copy(block_mask)
    out.mask_mod = mask_mod
    return out


def at_origin(q_offset: int | torch.Tensor, kv_offset: int | torch.Tensor) -> bool:
    """Whether a chunk pair sits at offset 0 on both sides, where the variant's own callbacks
    serve (an added 0 would still cost a load and an add per score)."""
    return isinstance(q_offset, int) and isinstance(kv_offset, int) and q_offset == kv_offset == 0


def shifted_mods(
    variant: Variant,
    q_offset: int | torch.Tensor,
    kv_offset: int | torch.Tensor,
    device,
    *,
    lengths: tuple[int, int] | None = None,
) -> tuple[ScoreMod | None, MaskMod | None]:
    """The variant's callbacks with chunk-local indices moved to global positions: by added 0-d
    offsets, or with `lengths` (the chunks' (Sq, Skv)) through position tables
    (`offsets_as_tables`)."""
    if at_origin(q_offset, kv_offset):
        return variant.score_mod, variant.mask_mod
    device = torch.device(device)
    if lengths is None:
        q_off, kv_off = position(q_offset, device, "q"), position(kv_offset, device, "kv")

        def q_at(idx):
            return idx + q_off

        def kv_at(idx):
            return idx + kv_off

    else:
        q_tab = position_table(q_offset, lengths[0], device, "q")
        kv_tab = position_table(kv_offset, lengths[1], device, "kv")

        def q_at(idx):
            return q_tab[idx]

        def kv_at(idx):
            return kv_tab[idx]

    return mapped_mods(variant, q_at, kv_at)


def mapped_mods(
    variant: Variant, q_at: Callable, kv_at: Callable
) -> tuple[ScoreMod | None, MaskMod | None]:
    """The variant's callbacks reading query row i at q_at(i) and key j at kv_at(j) (tensor-only
    index maps: offsets or table lookups), the one wrapper every index map goes through."""
    score_mod = mask_mod = None
    if variant.score_mod is not None:
        inner_score = variant.score_mod

        def score_mod(score, b, h, q_idx, kv_idx):
            return inner_score(score, b, h, q_at(q_idx), kv_at(kv_idx))

    if variant.mask_mod is not None:
        inner_mask = variant.mask_mod

        def mask_mod(b, h, q_idx, kv_idx):
            return inner_mask(b, h, q_at(q_idx), kv_at(kv_idx))

    return score_mod, mask_mod


def shifted_heads(
    variant: Variant, head_offset: int, device, *, heads: int | None = None
) -> Variant:
    """The variant with local head h read as global head `head_offset + h` (a head slice).

    A head-parallel rank attends heads head_offset .. head_offset + H/P - 1 as local heads
    0 .. H/P - 1; head-dependent callbacks (ALiBi's slopes) must see the global index. The offset
    is a 0-d tensor, as in `shifted_mods`, or with `heads` (H/P) a table of the global heads
    (`offsets_as_tables`). The result is pinned to `device`: it carries no buffers (its callbacks
    already read the variant's, on `device`).
    """
    if head_offset == 0:
        return variant
    device = torch.device(device)
    if heads is None:
        off = position(head_offset, device, "h")

        def h_at(idx):
            return idx + off

    else:
        table = position_table(head_offset, heads, device, "h")

        def h_at(idx):
            return table[idx]

    score_mod = mask_mod = None
    if variant.score_mod is not None:
        inner_score = variant.score_mod

        def score_mod(score, b, h, q_idx, kv_idx):
            return inner_score(score, b, h_at(h), q_idx, kv_idx)

    if variant.mask_mod is not None:
        inner_mask = variant.mask_mod

        def mask_mod(b, h, q_idx, kv_idx):
            return inner_mask(b, h_at(h), q_idx, kv_idx)

    return dataclasses.replace(
        variant, score_mod=score_mod, mask_mod=mask_mod, buffers={}, bind=None
    )


def make_block_mask(
    variant: Variant,
    seq_q: int,
    seq_kv: int,
    *,
    q_offset: int | torch.Tensor = 0,
    kv_offset: int | torch.Tensor = 0,
    block_size: tuple[int, int] = (128, 128),
    device: torch.device | str = "cpu",
    full_when_unmasked: bool = False,
):
    """The BlockMask of the variant's mask on this chunk pair.

    A variant without a mask gives None, or with `full_when_unmasked` a BlockMask keeping every
    block (flex's backward op takes a block mask in every case). Inside `kept_block_masks()` (a
    run: attngym.runner.job, a context-parallel rank) the last BLOCK_MASKS_KEPT masks are kept
    (keyed by the variant's mask_mod, lengths, integer offsets, block size and device), so the
    validation, the contenders, the pictures and context parallelism reuse the run's mask
    instead of building it again.
    """
    if variant.device is not None and variant.device != torch.device(device):
        variant = variant.to(device)  # its lookup tables where the mask is evaluated
    key = None
    tensor_offset = isinstance(q_offset, torch.Tensor) or isinstance(kv_offset, torch.Tensor)
    if _keeping and not tensor_offset:
        key = (
            variant.mask_mod,
            seq_q,
            seq_kv,
            q_offset,
            kv_offset,
            tuple(block_size),
            str(torch.device(device)),
            full_when_unmasked,
        )
        for kept_key, mask in _BLOCK_MASKS:
            if _same_key(kept_key, key):
                return mask
    mask = _create_block_mask(
        variant, seq_q, seq_kv, q_offset, kv_offset, block_size, device, full_when_unmasked
    )
    if key is not None and variant.mask_mod is not None:
        _BLOCK_MASKS.insert(0, (key, mask))
        del _BLOCK_MASKS[BLOCK_MASKS_KEPT:]
    return mask


# The block masks make_block_mask keeps inside kept_block_masks(), newest first: (key,
# BlockMask). A mask at 1M tokens holds ~1 GiB of block indices, so only a few are kept.
BLOCK_MASKS_KEPT = 8
_BLOCK_MASKS: list[tuple[tuple, Any]] = []
_keeping = False


def _same_key(a: tuple, b: tuple) -> bool:
    return a[0] is b[0] and a[1:] == b[1:]


@contextlib.contextmanager
def kept_block_masks() -> Iterator[None]:
    """Within it, make_block_mask keeps the masks it builds; on leaving the outermost one they
    are freed (the next job of a sweep builds its own). Outside, nothing is kept."""
    global _keeping
    outer = _keeping
    _keeping = True
    try:
        yield
    finally:
        _keeping = outer
        if not outer:
            _BLOCK_MASKS.clear()


def _create_block_mask(
    variant, seq_q, seq_kv, q_offset, kv_offset, block_size, device, full_when_unmasked
):
    from torch.nn.attention.flex_attention import create_block_mask, noop_mask

    _, mask_mod = shifted_mods(variant, q_offset, kv_offset, device)
    if mask_mod is None:
        if not full_when_unmasked:
            return None
        mask_mod = noop_mask
    if variant.block_rule is not None and not isinstance(q_offset + kv_offset, torch.Tensor):
        return _block_mask_from_rule(
            variant.block_rule, mask_mod, seq_q, seq_kv, q_offset, kv_offset, block_size, device
        )
    # no_grad whatever the caller's grad mode: a compiled creation is then compiled once, not
    # once per grad mode (the validation and the timed passes differ).
    with torch.no_grad():
        return create_block_mask(
            mask_mod,
            None,
            None,
            seq_q,
            seq_kv,
            device=device,
            BLOCK_SIZE=tuple(block_size),
            # Eager creation materialises seq_q x seq_kv mask values (128 GiB at 128K x 128K);
            # compiled, it works block by block. Small masks stay eager (no compile time).
            _compile=torch.device(device).type == "cuda" and seq_q * seq_kv > COMPILED_MASK_ENTRIES,
        )


def _block_mask_from_rule(rule, mask_mod, seq_q, seq_kv, q_offset, kv_offset, block_size, device):
    """The BlockMask create_block_mask would build, from the variant's block rule: a few
    operations per block pair instead of the mask_mod on every (query, key) pair (documents at
    1M tokens: milliseconds, where evaluating 10^12 pairs takes seconds)."""
    classes = rule_classes(rule, seq_q, seq_kv, q_offset, kv_offset, block_size, device)
    return block_mask_of_grid(
        classes == 1, classes == 2, block_size=tuple(block_size), mask_mod=mask_mod,
        seq_lengths=(seq_q, seq_kv),
    )  # fmt: skip


def rule_classes(rule, seq_q, seq_kv, q_offset, kv_offset, block_size, device) -> torch.Tensor:
    """(q blocks, kv blocks) classes of a block rule's blocks, as create_block_mask would class
    them: 0 empty, 1 partial (evaluated per entry), 2 full; a block cut by the end of the
    sequence holds masked padding, so it is never full."""
    dev = torch.device(device)
    bq, bkv = block_size

    def ranges(length: int, block: int, offset: int) -> tuple[torch.Tensor, torch.Tensor, Any]:
        first = torch.arange(0, length, block, device=dev, dtype=torch.int64)
        last = torch.clamp(first + block - 1, max=length - 1)
        return first + offset, last + offset, first + block > length  # cut by the end

    q_lo, q_hi, q_cut = ranges(seq_q, bq, q_offset)
    kv_lo, kv_hi, kv_cut = ranges(seq_kv, bkv, kv_offset)
    classes = rule(q_lo[:, None], q_hi[:, None], kv_lo[None, :], kv_hi[None, :])
    cut = q_cut[:, None] | kv_cut[None, :]
    return torch.where(cut & (classes == 2), 1, classes)


def block_mask_of_grid(partial: torch.Tensor, full: torch.Tensor, *, block_size, mask_mod,
                       seq_lengths):  # fmt: skip
    """The BlockMask of a (q blocks, kv blocks) grid of partial and full blocks: what
    create_block_mask would build for a mask with those classes (its block rule, or a sub-grid
    of a whole-sequence mask cut for a chunk pair), with no mask evaluated."""
    from torch.nn.attention.flex_attention import BlockMask

    return BlockMask.from_kv_blocks(
        *_ordered_blocks(partial), *_ordered_blocks(full), BLOCK_SIZE=tuple(block_size),
        mask_mod=mask_mod, seq_lengths=tuple(seq_lengths),
    )  # fmt: skip


def _ordered_blocks(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's kept blocks first, in column order (what create_block_mask's stable sort gives;
    the kernels read the first `num` entries), by a prefix sum, not a sort; shaped (1, 1, ...)."""
    num = dense.sum(dim=-1, dtype=torch.int32)
    slot = torch.where(dense, dense.cumsum(dim=-1) - 1, dense.shape[-1])  # the rest: a spare
    columns = torch.arange(dense.shape[-1], device=dense.device, dtype=torch.int32)
    indices = torch.zeros(dense.shape[0], dense.shape[1] + 1, dtype=torch.int32,
                          device=dense.device)  # fmt: skip
    indices.scatter_(1, slot, columns.expand_as(dense))
    return num[None, None], indices[:, :-1][None, None]


def block_mask_is_empty(block_mask) -> bool:
    """True when no (q block, kv block) pair is kept: the chunk pair can be skipped."""
    if block_mask is None:
        return False
    total = block_mask.kv_num_blocks.sum()
    if block_mask.full_kv_num_blocks is not None:
        total = total + block_mask.full_kv_num_blocks.sum()
    return int(total) == 0


def attend_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    variant: Variant,
    *,
    q_offset: int | torch.Tensor = 0,
    kv_offset: int | torch.Tensor = 0,
    backend: str = "auto",
    block_size: tuple[int, int] = (128, 128),
    block_mask=None,
    kernel_options: Mapping[str, Any] | None = None,
    scale: float | None = None,
    compile: bool = True,
    compile_mode: str = "default",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of a q chunk over a kv chunk, the variant taken at global positions.

    Args:
        q: (B, H, Sq, D) query chunk, tokens q_offset .. q_offset + Sq - 1.
        k, v: (B, G, Skv, D) key/value chunk, tokens kv_offset .. kv_offset + Skv - 1; G divides H.
        variant: the attention variant (its buffers on q's device).
        backend: "auto", "flex" or "reference" (see the module docstring).
        block_size: (q, kv) block size of the block mask built when `block_mask` is None.
        block_mask: a prebuilt BlockMask for exactly this chunk pair (reused across calls).
        kernel_options: passed to flex_attention unchanged. With BACKEND=FLASH (compiled) the
            returned lse carries no gradient: FLASH's backward has none for it; on a PyTorch
            that scales FLASH's lse by ln 2 it is scaled back (`flash_lse_scaled_by_ln2`).
        scale: score scale, default 1 / sqrt(D).
        compile: compile flex_attention (CUDA); False runs it eagerly.
        compile_mode: torch.compile mode when compiling (see COMPILE_MODES).

    Returns:
        out: (B, H, Sq, D) in q.dtype; lse: (B, H, Sq), float32 (float64 inputs: float64).
    """
    backend = resolve_backend(backend, q.device)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    if backend == "reference":
        q_pos = torch.arange(q.shape[2], device=q.device) + q_offset
        kv_pos = torch.arange(k.shape[2], device=q.device) + kv_offset
        out, lse = reference.attention(
            q,
            k,
            v,
            variant.score_mod,
            variant.mask_mod,
            scale=scale,
            q_positions=q_pos,
            kv_positions=kv_pos,
            dtype=lse_dtype,
        )
        return out.to(q.dtype), lse

    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    lengths = (q.shape[2], k.shape[2]) if offsets_as_tables(kernel_options) else None
    score_mod, mask_mod = shifted_mods(variant, q_offset, kv_offset, q.device, lengths=lengths)
    if block_mask is None:
        block_mask = make_block_mask(
            variant,
            q.shape[2],
            k.shape[2],
            q_offset=q_offset,
            kv_offset=kv_offset,
            block_size=block_size,
            device=q.device,
        )
    if lengths is not None and mask_mod is not None and not at_origin(q_offset, kv_offset):
        block_mask = with_mask_mod(block_mask, mask_mod)  # the kernel reads the tables too
    from torch._dynamo.exc import FailOnRecompileLimitHit

    if compile and q.device.type == "cuda":
        fn = compiled_flex_attention(compile_mode, lse_grad=not is_flash(kernel_options))
    else:
        fn = flex_attention
    with warnings.catch_warnings():
        # Eager flex (the CPU path, or compile=False) is chosen on purpose here; torch's advice
        # to compile it is noise for every first call. Only that one message is silenced.
        warnings.filterwarnings(
            "ignore", message="flex_attention called without torch.compile", category=UserWarning
        )
        try:
            out, aux = fn(
                q,
                k,
                v,
                score_mod=score_mod,
                block_mask=block_mask,
                scale=scale,
                enable_gqa=k.shape[1] != q.shape[1],
                kernel_options=dict(kernel_options) if kernel_options else None,
                return_aux=AuxRequest(lse=True),
            )
        except FailOnRecompileLimitHit as exc:
            raise RuntimeError(
                "compiled flex_attention hit torch._dynamo's recompile limit: past it flex "
                "would run eagerly, materialising every score, and be timed as flex; run fewer "
                "distinct variants or shapes per process (TORCH_LOGS=recompiles says why each "
                "compiled again)"
            ) from exc
    lse = aux if isinstance(aux, torch.Tensor) else aux.lse  # the FLASH wrapper returns lse
    if is_flash(kernel_options) and flash_lse_scaled_by_ln2():
        lse = lse / math.log(2)
    return out, lse.to(lse_dtype)
