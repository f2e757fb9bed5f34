"""A call folded (attngym.distributed.call.fold): its batch and heads as rows, costliest first.

The folded call must compute the call: each query row's output and lse, unfolded, equal to the
call's own against float64, both as the dense reference evaluates the folded mask everywhere
(`exact`) and as flex reads it (only inside the blocks the folded block mask keeps; `exact`
off, the GPU's way), with a score that reads the head (ALiBi), GQA and a batch of 2, the rows
and keys at scattered positions as a rank's shard holds them.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from attngym import reference, variants
from attngym.distributed.call import fold
from attngym.distributed.placement.layout import block_row_prices

B, H, G, D, BLOCK = 2, 4, 2, 8, 16
# A rank's rows: two chunks out of order; its keys: the positions they read, in order.
Q_POS = torch.cat([torch.arange(64, 96), torch.arange(16, 48)])
KV_POS = torch.arange(0, 96)


def _variant():
    docs = variants.get("document", doc_lengths=[20, 50, 30, 28])
    return variants.compose(docs, variants.get("alibi", num_heads=H))


def _block_mask(variant):
    def at_positions(b, h, q, kv):
        return variant.mask_mod(b, h, Q_POS[q], KV_POS[kv])

    return create_block_mask(at_positions, None, None, len(Q_POS), len(KV_POS), device="cpu",
                             BLOCK_SIZE=BLOCK)  # fmt: skip


@pytest.mark.parametrize("exact", [True, False])
def test_the_folded_call_is_the_call(exact):
    variant = _variant()
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(B, H, len(Q_POS), D, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(B, G, len(KV_POS), D, generator=gen, dtype=torch.float64) for _ in "kv")
    want_out, want_lse = reference.attention(q, k, v, variant.score_mod, variant.mask_mod,
                                             q_positions=Q_POS, kv_positions=KV_POS)  # fmt: skip
    f = fold.fold(variant, Q_POS, KV_POS, _block_mask(variant), (B, H, G), exact)
    mask = f.variant.mask_mod
    if not exact:  # as flex computes it: the mask inside the blocks the block mask keeps
        kept = f.block_mask.to_dense()[0, 0].repeat_interleave(BLOCK, 0)
        kept = kept.repeat_interleave(BLOCK, 1).bool()

        def mask(b, h, q_idx, kv_idx):
            return f.variant.mask_mod(b, h, q_idx, kv_idx) & kept[q_idx, kv_idx]

    out, lse = reference.attention(fold.rows_in(f, q), fold.keys_in(k), fold.keys_in(v),
                                   f.variant.score_mod, mask)  # fmt: skip
    assert (fold.rows_out(f, out) - want_out).abs().max() < 1e-12
    assert torch.equal(fold.rows_out(f, lse).isinf(), want_lse.isinf())
    finite = want_lse.isfinite()
    assert (fold.rows_out(f, lse)[finite] - want_lse[finite]).abs().max() < 1e-12


def test_the_costliest_rows_go_first_and_every_row_once():
    variant = _variant()
    bm = _block_mask(variant)
    f = fold.fold(variant, Q_POS, KV_POS, bm, (B, H, G))
    assert torch.equal(torch.sort(f.rows).values, torch.arange(B * H * len(Q_POS)))
    price = block_row_prices(bm)[0, 0]
    first = f.rows[::BLOCK] // BLOCK % len(price)  # each folded block row's row of the shard
    assert torch.all(price[first][:-1] >= price[first][1:])
    x = torch.randn(B, H, len(Q_POS), 3)
    assert torch.equal(fold.rows_out(f, fold.rows_in(f, x)), x)


def test_a_call_of_rows_that_are_not_whole_blocks_is_not_folded():
    variant = _variant()
    bm = _block_mask(variant)
    assert fold.fold(variant, Q_POS[:40], KV_POS, bm, (B, H, G)) is None


def test_worth_it_where_the_rows_costs_spread():
    """A rank holding a long document's last block row (16 blocks) and three rows of short
    documents' (2-3 blocks) folds; rows of a window (alike) and a call without a mask do not."""
    docs = variants.get("document", doc_lengths=[240] + [2] * 8)
    rows = torch.cat([torch.arange(224, 256), torch.arange(0, 32)])

    def at_rows(b, h, q, kv):
        return docs.mask_mod(b, h, rows[q], kv)

    spread = create_block_mask(at_rows, None, None, 64, 256, device="cpu", BLOCK_SIZE=BLOCK)
    assert fold.worth_it(spread)
    window = variants.get("sliding_window", window_size=32)

    def band(b, h, q, kv):
        return window.mask_mod(b, h, q + 256, kv + 256)

    uniform = create_block_mask(band, None, None, 128, 128, device="cpu", BLOCK_SIZE=BLOCK)
    assert not fold.worth_it(uniform)
    assert not fold.worth_it(None)
