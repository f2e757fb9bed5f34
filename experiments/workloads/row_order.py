"""Does the order of a rank's block rows change its call's time? The all-gather's heaviest rank
measured 1.13-1.33x the ideal on packed documents where its placement's model (the blocks each
rank's call computes) says 1.00-1.02. One suspect: flex's grid runs a rank's query blocks in
shard order, head after head, and a causal document's costliest block rows are its last, so a
long document's longest rows start last and end alone. This script times each rank's call (fwd,
fwd+bwd) on `layout=documents` and `balanced` with its block rows in these orders, beside the
call's price:

    python experiments/workloads/row_order.py [--first 0] [--batches 2]
        [--layouts documents balanced] [--out row_order.csv]

    position   the shard as placed (chunks in position order): what runs today
    heavy      block rows sorted by their price, costliest first (longest-processing-time first)
    folded     the heads folded into the rows (q viewed as one head of H x S/P rows, the keys as
               one of H x S, the mask pairing each query head with its keys' head), and these
               (head, block row) rows sorted costliest first: the longest rows of every head
               start first, where flex's grid runs the heads one after the other
    folded_long  folded, only the long rows (fold.SPREAD times the mean or more) first and the
               others after them in grid order, where neighbours read the same keys
    attngym    the same fold as attngym.distributed.call.fold makes it (the variant read through
               its tables), on q already folded
    attngym_copies  the same with q gathered into the fold's order and the output (and in the
               backward dq) gathered back, as the all-gather's call does

Each rank's keys are the whole sequence (global order; the block mask skips what the rank does not
read), so that every rank and order is one kernel shape and one compile; the masks read positions
through tables updated in place. The workload is run.sh's (lognormal, median 2K, tail to 64K,
128K, P=8; B=1 H=8 D=128, bf16). Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import csv
import statistics

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from triton.testing import do_bench

from attngym.distributed.call import fold
from attngym.distributed.placement import layout
from attngym.runner.config import workload_batches
from attngym.variants.spec import build_variant

SEQ_LEN, WORLD, HEADS, DIM, BLOCK = 131072, 8, 8, 128, 128
WORKLOAD = {"name": "documents", "distribution": "lognormal", "seed": 0, "median": 2048,
            "sigma": 1.2, "max_len": 65536}  # fmt: skip
SHARD = SEQ_LEN // WORLD


ORDERS = ("position", "heavy", "folded", "folded_long", "attngym", "attngym_copies")


def folded_mask(bm, order: torch.Tensor, heads: int, mask_mod):
    """The rank's block mask `bm` (one head) with the heads folded into the rows: row i is the
    (head, block row) `order[i]` (head-major numbering), its key blocks shifted into that head's
    keys."""
    rows, cols = bm.kv_indices.shape[-2:]
    head = (order // rows).view(-1, 1)
    row = order % rows

    def fold(num, idx):
        idx = torch.nn.functional.pad(idx[0, 0][row] + head * cols, (0, cols * (heads - 1)))
        return num[0, 0][row].view(1, 1, -1), idx.view(1, 1, len(order), cols * heads).int()

    kv_num, kv_idx = fold(bm.kv_num_blocks, bm.kv_indices)
    full_num, full_idx = fold(bm.full_kv_num_blocks, bm.full_kv_indices)
    q_len, kv_len = bm.seq_lengths
    return BlockMask.from_kv_blocks(kv_num.int(), kv_idx, full_num.int(), full_idx,
                                    BLOCK_SIZE=bm.BLOCK_SIZE, mask_mod=mask_mod,
                                    seq_lengths=(q_len * heads, kv_len * heads))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=2)
    parser.add_argument("--first", type=int, default=0, help="the workload's batch to start at")
    parser.add_argument("--layouts", nargs="+", default=["documents", "balanced"])
    parser.add_argument("--out", default="row_order.csv")
    args = parser.parse_args()
    dev = torch.device("cuda")
    batches = args.first + args.batches
    data = {"workload": {**WORKLOAD, "batches": batches}, "shape": {"seq_len": SEQ_LEN}}
    # the tables the masks read, updated in place (one mask function, one compile)
    doc = torch.empty(SEQ_LEN, dtype=torch.long, device=dev)
    qpos = torch.empty(SHARD, dtype=torch.long, device=dev)
    fpos = torch.empty(HEADS * SHARD, dtype=torch.long, device=dev)  # folded row -> position
    fhead = torch.empty(HEADS * SHARD, dtype=torch.long, device=dev)  # folded row -> head

    def rank_mask(b, h, q, kv):
        p = qpos[q]
        return (doc[p] == doc[kv]) & (p >= kv)

    def whole_mask(b, h, q, kv):
        return (doc[q] == doc[kv]) & (q >= kv)

    def fold_mask(b, h, q, kv):
        p, k = fpos[q], kv % SEQ_LEN
        return (fhead[q] == kv // SEQ_LEN) & (doc[p] == doc[k]) & (p >= k)

    attend = torch.compile(flex_attention, dynamic=False)
    gen = torch.Generator(device=dev).manual_seed(0)

    def tensors(heads, rows, keys):
        return [torch.randn(1, heads, n, DIM, device=dev, dtype=torch.bfloat16, generator=gen,
                            requires_grad=True) for n in (rows, keys, keys)]  # fmt: skip

    def timed(q, k, v, bm, variant=None, f=None):
        """fwd and fwd+bwd ms of the call (with `variant`'s score and mask; `f`: q, k, v in
        their own layout, folded around the call as the all-gather folds them)."""
        score = None if variant is None else variant.score_mod

        def call():
            if f is None:
                return attend(q, k, v, score_mod=score, block_mask=bm)
            out = attend(fold.rows_in(f, q), fold.keys_in(k), fold.keys_in(v),
                         score_mod=score, block_mask=bm)  # fmt: skip
            return fold.rows_out(f, out)

        fwd = do_bench(call, warmup=25, rep=100)
        grad = torch.randn_like(call())
        both = do_bench(lambda: torch.autograd.grad(call(), (q, k, v), grad), warmup=25, rep=100)
        return fwd, both

    rows = []
    qkv = tensors(HEADS, SHARD, SEQ_LEN)
    folded_qkv = tensors(1, HEADS * SHARD, HEADS * SEQ_LEN)
    whole = tensors(HEADS, SEQ_LEN, SEQ_LEN)
    for i, docs in enumerate(workload_batches(data)):
        if i < args.first:
            continue
        ids = torch.repeat_interleave(torch.arange(len(docs)), torch.tensor(docs))
        doc.copy_(ids)
        bm = create_block_mask(whole_mask, 1, 1, SEQ_LEN, SEQ_LEN, device=dev, _compile=True)
        single = timed(*whole, bm)
        variant = build_variant({"name": "document", "doc_lengths": list(docs)},
                                seq_len=SEQ_LEN, heads=HEADS)  # fmt: skip
        print(
            f"batch {i}: {len(docs)} documents, longest {max(docs)}; one device fwd "
            f"{single[0]:.3f} ms, fwd+bwd {single[1]:.3f} ms (ideal at P={WORLD}: "
            f"{single[1] / WORLD:.3f})",
            flush=True,
        )
        for how in args.layouts:
            placed = layout.plan(how, WORLD, SEQ_LEN, variant, (BLOCK, BLOCK), "cpu")
            for r in range(WORLD):
                pos = placed.positions(r).to(dev)
                qpos.copy_(pos)
                bm = create_block_mask(rank_mask, 1, 1, SHARD, SEQ_LEN, device=dev, _compile=True)
                full = bm.full_kv_num_blocks[0, 0].double()
                partial = bm.kv_num_blocks[0, 0].double()
                price = layout.block_row_prices(bm)[0, 0]
                for name in ORDERS:
                    if name.startswith("attngym"):
                        keys = torch.arange(SEQ_LEN, device=dev)
                        f = fold.fold(variant.to(dev), pos, keys, bm, (1, HEADS, HEADS),
                                      exact=False)  # fmt: skip
                        if name == "attngym":
                            fwd, both = timed(*folded_qkv, f.block_mask, f.variant)
                        else:
                            fwd, both = timed(*qkv, f.block_mask, f.variant, f)
                    elif name.startswith("folded"):
                        every = price.repeat(HEADS)
                        if name == "folded_long":  # the others: -1, in grid order
                            every = torch.where(every >= fold.SPREAD * every.mean(), every, -1.0)
                        order = torch.argsort(every, descending=True, stable=True)
                        fpos.copy_(pos.view(-1, BLOCK)[order % len(price)].flatten())
                        fhead.copy_((order // len(price)).repeat_interleave(BLOCK))
                        fwd, both = timed(*folded_qkv, folded_mask(bm, order, HEADS, fold_mask))
                    else:
                        order = torch.arange(len(price), device=dev)
                        if name == "heavy":
                            order = torch.argsort(price, descending=True, stable=True)
                        qpos.copy_(pos.view(-1, BLOCK)[order].flatten())
                        mask = create_block_mask(rank_mask, 1, 1, SHARD, SEQ_LEN, device=dev,
                                                 _compile=True)  # fmt: skip
                        fwd, both = timed(*qkv, mask)
                    rows.append({
                        "batch": i, "layout": how, "rank": r, "order": name, "fwd_ms": fwd,
                        "fwd_bwd_ms": both, "blocks_full": int(full.sum()),
                        "blocks_partial": int(partial.sum()), "price": float(price.sum()),
                        "longest_row_blocks": int((full + partial).max()),
                        "single_fwd_ms": single[0], "single_fwd_bwd_ms": single[1],
                    })  # fmt: skip
                    print(f"  {how} rank {r} {name:8s} fwd {fwd:.3f} fwd+bwd {both:.3f} ms, "
                          f"price {float(price.sum()):.0f}, longest row "
                          f"{int((full + partial).max())} blocks", flush=True)  # fmt: skip
            for name in ORDERS:
                mine = [x for x in rows if (x["batch"], x["layout"], x["order"]) == (i, how, name)]
                most = max(x["fwd_bwd_ms"] for x in mine)
                print(f"batch {i} {how} {name}: slowest rank {most:.3f} ms fwd+bwd, mean "
                      f"{statistics.fmean(x['fwd_bwd_ms'] for x in mine):.3f}, slowest over "
                      f"ideal {most / (single[1] / WORLD):.3f}", flush=True)  # fmt: skip
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()
