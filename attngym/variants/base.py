"""The `Variant` record and the catalogue every variant family registers into.

A variant is a pair of FlexAttention callbacks (score_mod, mask_mod) plus what the rest of attngym
needs to know about them: the parameters it was built from (for configs, logs and file names), the
tensors its callbacks read (so `.to(device)` can move them), the sequence length it was built for
(document lengths, a 2-D canvas) and whether plain SDPA can run it (`sdpa`: "full" or "causal").

Index convention for every callback: `b, h` are batch and query-head indices, `q_idx, kv_idx` are
*global* token positions. Callbacks use tensor ops only, so they work both inside FlexAttention and
on broadcast index grids (the dense reference).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from attngym import registry

ScoreMod = Callable[..., torch.Tensor]  # (score, b, h, q_idx, kv_idx) -> score
MaskMod = Callable[..., torch.Tensor]  # (b, h, q_idx, kv_idx) -> bool
Bind = Callable[[Mapping[str, torch.Tensor]], "tuple[ScoreMod | None, MaskMod | None]"]
# (q_lo, q_hi, kv_lo, kv_hi) -> (nq, nkv) uint8 block classes: 0 empty, 1 partial, 2 full.
BlockRule = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Varlen:
    """A mask as FlashAttention's varlen kernels take it: packed sequences (documents) and a
    window inside each, what `torch.nn.attention.varlen.varlen_attn` and flash-attn's
    `flash_attn_varlen_func` express with `cu_seqlens` and `window_size` (attngym.varlen).

    Attributes:
        documents: the lengths of the packed documents, in order (None: one, the whole sequence).
        left, right: how many keys before and after the query it may see, inside its document,
            -1 for no bound (FlashAttention's `window_size`): (-1, -1) full, (-1, 0) causal,
            (w, 0) a causal window of look-back w, (w, w) a band.
    """

    documents: tuple[int, ...] | None = None
    left: int = -1
    right: int = -1

    def both(self, other: Varlen) -> Varlen | None:
        """The mask both keep (a composed variant's), or None where no varlen form has it:
        two different splits into documents."""
        if None not in (self.documents, other.documents) and self.documents != other.documents:
            return None

        def tighter(a: int, b: int) -> int:
            return b if a < 0 else a if b < 0 else min(a, b)

        return Varlen(
            documents=self.documents if self.documents is not None else other.documents,
            left=tighter(self.left, other.left),
            right=tighter(self.right, other.right),
        )


@dataclasses.dataclass(frozen=True, eq=False)
class Variant:
    """An attention variant: FlexAttention callbacks plus the facts attngym needs about them.

    Attributes:
        name: catalogue name, e.g. "sliding_window"; composed variants join names with "+".
        params: the factory arguments it was built from.
        score_mod: `(score, b, h, q_idx, kv_idx) -> score`, or None.
        mask_mod: `(b, h, q_idx, kv_idx) -> bool`, or None (attend everywhere).
        buffers: tensors the callbacks read; `.to(device)` moves them and rebinds the callbacks.
        bind: rebuilds `(score_mod, mask_mod)` from moved buffers; required when buffers exist.
        seq_len: the only sequence length the variant is defined for, or None for any.
        sdpa: "full" or "causal" when SDPA computes the same thing (is_causal), else None.
        varlen: the mask as FlashAttention's varlen kernels take it (Varlen), or None where they
            cannot (a score_mod, any mask that is not documents and windows).
        block_rule: the mask's block classes in closed form, so a block mask at long sequences
            needs no evaluation of every (query, key) pair (attngym.kernels.make_block_mask);
            None: create_block_mask evaluates the mask_mod. Called with each q block's and each
            kv block's first and last global position (int64, shapes (nq, 1) and (1, nkv)), it
            returns (nq, nkv) uint8: 0 no pair kept, 2 every pair kept, 1 otherwise. Only for a
            mask that does not depend on b or h.
    """

    name: str
    params: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    score_mod: ScoreMod | None = None
    mask_mod: MaskMod | None = None
    buffers: Mapping[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    bind: Bind | None = None
    seq_len: int | None = None
    sdpa: str | None = None
    varlen: Varlen | None = None
    block_rule: BlockRule | None = None

    def __post_init__(self):
        if self.buffers and self.bind is None:
            raise ValueError(
                f"variant {self.name!r} has buffers {sorted(self.buffers)} but no bind: "
                "`.to(device)` could not rebuild its callbacks"
            )
        # device -> this variant moved there: the same callbacks each time, so what is built from
        # them (block masks, compiled kernels) is found again (attngym.kernels.make_block_mask).
        object.__setattr__(self, "_moved", {})

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_moved"}  # never its copies

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _moved={})

    @property
    def device(self) -> torch.device | None:
        """Where the buffers live (None when the variant has none)."""
        for t in self.buffers.values():
            return t.device
        return None

    def to(self, device: torch.device | str) -> Variant:
        """The same variant with its buffers on `device` (self when there is nothing to move)."""
        if not self.buffers:
            return self
        where = torch.device(device)
        if where == self.device:
            return self
        if where not in self._moved:
            buffers = {k: t.to(where) for k, t in self.buffers.items()}
            score_mod, mask_mod = self.bind(buffers)
            self._moved[where] = dataclasses.replace(
                self, buffers=buffers, score_mod=score_mod, mask_mod=mask_mod
            )
        return self._moved[where]

    def check_seq_len(self, seq_len: int) -> None:
        """Raise ValueError when the variant is not defined at `seq_len`."""
        if self.seq_len is not None and seq_len != self.seq_len:
            raise ValueError(
                f"variant {self.name!r} is built for seq_len={self.seq_len} "
                f"(from {dict(self.params)}), got seq_len={seq_len}"
            )

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"Variant({self.name}({args}))"


# The catalogue is attngym.registry's kind "variant": one table and one signature check for
# every component; these functions are the catalogue's names for them.


def register(name: str) -> Callable[[Callable[..., Variant]], Callable[..., Variant]]:
    """Add a factory to the catalogue under `name` (explicit, one call per variant)."""
    return registry.register("variant", name)


def names() -> list[str]:
    """Every registered variant name, sorted."""
    return registry.names("variant")


def factory(name: str) -> Callable[..., Variant]:
    """The factory behind `name`; unknown names list the catalogue and suggest the closest."""
    return registry.get("variant", name)


def check_params(name: str, params: Mapping[str, Any]) -> None:
    """ValueError (attngym.registry.ParamError) for parameters the factory does not take or
    required ones missing."""
    registry.check_params("variant", name, params)


def get(name: str, **params: Any) -> Variant:
    """Build the variant `name` with `params` (checked against its factory's signature)."""
    return registry.build("variant", name, **params)


def compose(*variants: Variant) -> Variant:
    """One variant from several: masks AND-ed, score_mods applied left to right."""
    if not variants:
        raise ValueError("compose needs at least one variant")
    if len(variants) == 1:
        return variants[0]
    seq_lens = {v.seq_len for v in variants if v.seq_len is not None}
    if len(seq_lens) > 1:
        raise ValueError(f"cannot compose variants built for different seq_len: {sorted(seq_lens)}")
    prefixed = {f"{i}.{k}": t for i, v in enumerate(variants) for k, t in v.buffers.items()}

    def bind(buffers: Mapping[str, torch.Tensor]):
        parts = []
        for i, v in enumerate(variants):
            mine = {k.split(".", 1)[1]: t for k, t in buffers.items() if k.startswith(f"{i}.")}
            parts.append(v.bind(mine) if v.buffers else (v.score_mod, v.mask_mod))
        return _chain([s for s, _ in parts]), _all([m for _, m in parts])

    score_mod, mask_mod = bind(prefixed)
    sdpas = [v.sdpa for v in variants]
    sdpa = None
    if all(s in ("full", "causal") for s in sdpas):
        sdpa = "causal" if "causal" in sdpas else "full"
    varlen = variants[0].varlen
    for v in variants[1:]:
        varlen = varlen.both(v.varlen) if None not in (varlen, v.varlen) else None
    if score_mod is not None:  # FlashAttention's varlen kernels take no score_mod
        varlen = None
    return Variant(
        name="+".join(v.name for v in variants),
        params={v.name: dict(v.params) for v in variants},
        score_mod=score_mod,
        mask_mod=mask_mod,
        buffers=prefixed,
        bind=bind if prefixed else None,
        seq_len=seq_lens.pop() if seq_lens else None,
        sdpa=sdpa,
        varlen=varlen,
    )


def _chain(mods: list[ScoreMod | None]) -> ScoreMod | None:
    mods = [m for m in mods if m is not None]
    if not mods:
        return None
    if len(mods) == 1:
        return mods[0]

    def score_mod(score, b, h, q_idx, kv_idx):
        for m in mods:
            score = m(score, b, h, q_idx, kv_idx)
        return score

    score_mod.__name__ = "_then_".join(m.__name__ for m in mods)
    return score_mod


def _all(mods: list[MaskMod | None]) -> MaskMod | None:
    mods = [m for m in mods if m is not None]
    if not mods:
        return None
    if len(mods) == 1:
        return mods[0]

    def mask_mod(b, h, q_idx, kv_idx):
        keep = mods[0](b, h, q_idx, kv_idx)
        for m in mods[1:]:
            keep = keep & m(b, h, q_idx, kv_idx)
        return keep

    mask_mod.__name__ = "_and_".join(m.__name__ for m in mods)
    return mask_mod


def positive_int(name: str, value: Any, *, allow_zero: bool = False) -> int:
    """Check a size parameter: an int > 0 (or >= 0), else ValueError naming it."""
    low = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        need = "an integer >= 0" if allow_zero else "a positive integer"
        raise ValueError(f"{name} must be {need}, got {value!r}")
    return value


def positive_float(name: str, value: Any) -> float:
    """Check a scale parameter: a finite number > 0, else ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a finite positive number, got {value!r}")
    return float(value)
