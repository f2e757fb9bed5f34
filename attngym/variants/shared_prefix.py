"""Shared prefix: several continuations of one prompt packed after it, the prompt stored once.

Sampling several responses to one prompt (best-of-n, GRPO-style RL fine-tuning, tree search)
packs the prompt once and its continuations after it; each continuation attends to the whole of
its prompt and causally to itself, never to a sibling, so the packed sequence trains as if each
`prompt + continuation` were its own sample. attention-gym's `generate_shared_prefix_mask_mod`
takes document offsets and a prefix-document table as tensors; here they are two lists, checked,
and the per-position tables are buffers that `.to(device)` moves.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from attngym.variants.base import Variant, positive_int, register


def _shared_prefix_mods(tables: Mapping[str, torch.Tensor], tag: str):
    doc_start, prefix_start, prefix_end = (
        tables["doc_start"], tables["prefix_start"], tables["prefix_end"]
    )  # fmt: skip

    def mask_mod(b, h, q_idx, kv_idx):
        own_document = (kv_idx >= doc_start[q_idx]) & (q_idx >= kv_idx)
        own_prefix = (kv_idx >= prefix_start[q_idx]) & (kv_idx < prefix_end[q_idx])
        return own_document | own_prefix

    mask_mod.__name__ = tag
    return mask_mod


def _int_list(name: str, values: Sequence[int], *, allow_zero: bool) -> list[int]:
    if isinstance(values, str | bytes) or not isinstance(values, Sequence) or len(values) == 0:
        raise ValueError(f"{name} must be a non-empty list of integers, got {values!r}")
    try:
        return [
            positive_int(f"{name}[{i}]", n, allow_zero=allow_zero) for i, n in enumerate(values)
        ]
    except ValueError as err:
        raise ValueError(f"{err} ({name}={list(values)!r})") from None


@register("shared_prefix")
def shared_prefix(doc_lengths: Sequence[int], prefix_of: Sequence[int]) -> Variant:
    """Packed documents, each a prefix (a prompt) or a continuation of an earlier prefix.

    Args:
        doc_lengths: the length of each packed document, in order; each a positive integer.
        prefix_of: for each document, the index of its prefix document: itself for a prefix, an
            earlier prefix document for a continuation (one that is its own prefix).

    Note:
        Document d covers `[sum(doc_lengths[:d]), sum(doc_lengths[:d + 1]))`. A query attends
        causally inside its own document and, in a continuation, to every token of its prefix
        document (which lies before it). A prefix alone is plain document-causal. The variant's
        `seq_len` is `sum(doc_lengths)`.
    """
    lengths = _int_list("doc_lengths", doc_lengths, allow_zero=False)
    prefixes = _int_list("prefix_of", prefix_of, allow_zero=True)
    if len(prefixes) != len(lengths):
        raise ValueError(
            f"prefix_of must give one prefix document per document ({len(lengths)}), got "
            f"{prefixes!r}"
        )
    for d, p in enumerate(prefixes):
        if p > d or prefixes[p] != p:
            raise ValueError(
                f"prefix_of[{d}] must be {d} (a prefix) or an earlier prefix document (one whose "
                f"prefix_of is itself), got {p!r} (prefix_of={prefixes!r})"
            )

    starts = torch.tensor([0, *lengths]).cumsum(0)
    doc_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    prefix_ids = torch.tensor(prefixes)[doc_ids]
    is_continuation = prefix_ids != doc_ids
    tables = {
        "doc_start": starts[doc_ids],
        # A prefix document's own prefix range is empty: [0, 0).
        "prefix_start": torch.where(is_continuation, starts[prefix_ids], 0),
        "prefix_end": torch.where(is_continuation, starts[prefix_ids + 1], 0),
    }
    continuations = int(sum(p != d for d, p in enumerate(prefixes)))
    tag = f"shared_prefix_{len(lengths) - continuations}prefix_{continuations}cont_{sum(lengths)}"

    def bind(buffers: Mapping[str, torch.Tensor]):
        return None, _shared_prefix_mods(buffers, tag)

    return Variant(
        name="shared_prefix",
        params={"doc_lengths": lengths, "prefix_of": prefixes},
        mask_mod=bind(tables)[1],
        buffers=tables,
        bind=bind,
        seq_len=sum(lengths),
        sdpa="causal" if len(lengths) == 1 else None,  # one document: plain causal
    )
