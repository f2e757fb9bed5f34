"""Document masking for packed sequences: tokens attend only within their own document.

Packing several documents into one sequence removes padding; the mask keeps them independent, as in
sequence packing for LLM pre-training (Krell et al., 2021, "Efficient Sequence Packing without
Cross-contamination", arXiv:2107.02027) and the FlexAttention announcement's document masking.

The document id of every position is a buffer (a lookup table indexed by `q_idx` / `kv_idx`), so
the variant is defined for exactly `sum(doc_lengths)` tokens and `.to(device)` moves the table.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Mapping, Sequence

import torch

from attngym.variants.base import Variant, Varlen, positive_int, register
from attngym.variants.causal import classes


def _document_mods(doc_ids: torch.Tensor, causal: bool, tag: str):
    def mask_mod(b, h, q_idx, kv_idx):
        same_doc = doc_ids[q_idx] == doc_ids[kv_idx]
        return same_doc & (q_idx >= kv_idx) if causal else same_doc

    mask_mod.__name__ = tag
    return mask_mod


@register("document")
def document(doc_lengths: Sequence[int], causal: bool = True) -> Variant:
    """Block-diagonal attention over packed documents, causal inside each one by default.

    Args:
        doc_lengths: the length of each packed document, in order; each a positive integer.
        causal: also require `q_idx >= kv_idx` inside a document.

    Note:
        Document d covers positions `[sum(doc_lengths[:d]), sum(doc_lengths[:d + 1]))`; a query
        attends to a key when both fall in the same document (and, if causal, `q_idx >= kv_idx`).
        The variant's `seq_len` is `sum(doc_lengths)`.
    """
    if isinstance(doc_lengths, str | bytes) or not isinstance(doc_lengths, Sequence):
        raise ValueError(f"doc_lengths must be a list of positive integers, got {doc_lengths!r}")
    if len(doc_lengths) == 0:
        raise ValueError("doc_lengths must name at least one document, got []")
    try:
        lengths = [positive_int(f"doc_lengths[{i}]", n) for i, n in enumerate(doc_lengths)]
    except ValueError as err:
        raise ValueError(f"{err} (doc_lengths={list(doc_lengths)!r})") from None
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be true or false, got {causal!r}")

    tag = f"document_{len(lengths)}docs_{sum(lengths)}" + ("_causal" if causal else "")
    doc_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))

    def bind(buffers: Mapping[str, torch.Tensor]):
        return None, _document_mods(buffers["doc_ids"], causal, tag)

    _, mask_mod = bind({"doc_ids": doc_ids})
    starts = torch.tensor([0, *itertools.accumulate(lengths)][:-1])
    ends = starts + torch.tensor(lengths) - 1  # each document's last position
    sdpa = None
    if len(lengths) == 1:  # one document: the mask is plain causal / full
        sdpa = "causal" if causal else "full"
    return Variant(
        name="document",
        params={"doc_lengths": lengths, "causal": causal},
        mask_mod=mask_mod,
        buffers={"doc_ids": doc_ids},
        bind=bind,
        seq_len=sum(lengths),
        sdpa=sdpa,
        varlen=Varlen(documents=tuple(lengths), right=0 if causal else -1),
        block_rule=functools.partial(_document_blocks, doc_ids, starts, ends, causal),
    )


def _document_blocks(doc_ids, starts, ends, causal, q_lo, q_hi, kv_lo, kv_hi):
    """Block classes of the document mask (Variant.block_rule), from the documents of each
    block's first and last position: ids are increasing, so a block pair shares the documents
    from max(first ids) to min(last ids)."""
    dev = q_lo.device
    doc_ids, starts, ends = doc_ids.to(dev), starts.to(dev), ends.to(dev)
    q_first, q_last, kv_first, kv_last = (doc_ids[x] for x in (q_lo, q_hi, kv_lo, kv_hi))
    lo, hi = torch.maximum(q_first, kv_first), torch.minimum(q_last, kv_last)
    shared = lo <= hi
    one_doc = (q_first == q_last) & (kv_first == kv_last) & (q_first == kv_first)
    if not causal:
        return classes(shared, one_doc)

    # Causal: a shared document d keeps a pair when the block's last query in d is at or after
    # its first key in d. A document strictly inside the query block always does; the lowest and
    # highest shared ones are checked.
    def keeps(d):
        d = d.clamp(min=0, max=starts.numel() - 1)
        return torch.minimum(q_hi, ends[d]) >= torch.maximum(kv_lo, starts[d])

    inner = hi - lo >= 2
    any_kept = shared & (keeps(lo) | keeps(hi) | inner)
    return classes(any_kept, one_doc & (kv_hi <= q_lo))
