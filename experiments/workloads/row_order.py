"""Does the order of a rank's block rows change its call's time? The all-gather on
`layout=documents` measured its heaviest rank 1.13-1.33x the ideal where its placement's model
(the blocks each rank's call computes) says 1.00-1.02. One suspect: flex's grid runs a rank's
query blocks in shard order, head after head, and a causal document's costliest block rows are its
last, so a long document's longest rows start last and end alone. This script times each rank's
call (fwd, fwd+bwd) with its block rows in three orders, against the same call's price:

    python experiments/workloads/row_order.py [--batches 2] [--out row_order.csv]

    position   the shard as placed (chunks in position order): what runs today
    heavy      block rows sorted by their price, costliest first (longest-processing-time first)
    reversed   the shard's block rows last to first

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
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from triton.testing import do_bench

from attngym.distributed.placement import layout
from attngym.runner.config import workload_batches
from attngym.variants.spec import build_variant

SEQ_LEN, WORLD, HEADS, DIM, BLOCK = 131072, 8, 8, 128, 128
WORKLOAD = {"name": "documents", "distribution": "lognormal", "seed": 0, "median": 2048,
            "sigma": 1.2, "max_len": 65536}  # fmt: skip
SHARD = SEQ_LEN // WORLD


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=2)
    parser.add_argument("--out", default="row_order.csv")
    args = parser.parse_args()
    dev = torch.device("cuda")
    data = {"workload": {**WORKLOAD, "batches": args.batches}, "shape": {"seq_len": SEQ_LEN}}
    # the tables the masks read, updated in place (one mask function, one compile)
    doc = torch.empty(SEQ_LEN, dtype=torch.long, device=dev)
    qpos = torch.empty(SHARD, dtype=torch.long, device=dev)

    def rank_mask(b, h, q, kv):
        p = qpos[q]
        return (doc[p] == doc[kv]) & (p >= kv)

    def whole_mask(b, h, q, kv):
        return (doc[q] == doc[kv]) & (q >= kv)

    attend = torch.compile(flex_attention, dynamic=False)
    gen = torch.Generator(device=dev).manual_seed(0)

    def tensors(rows):
        return [torch.randn(1, HEADS, n, DIM, device=dev, dtype=torch.bfloat16, generator=gen,
                            requires_grad=True) for n in (rows, SEQ_LEN, SEQ_LEN)]  # fmt: skip

    def timed(q, k, v, bm):
        fwd = do_bench(lambda: attend(q, k, v, block_mask=bm), warmup=25, rep=100)
        out = attend(q, k, v, block_mask=bm)
        grad = torch.randn_like(out)
        both = do_bench(lambda: torch.autograd.grad(attend(q, k, v, block_mask=bm), (q, k, v),
                                                    grad), warmup=25, rep=100)  # fmt: skip
        return fwd, both

    rows = []
    qkv = tensors(SHARD)
    whole = tensors(SEQ_LEN)
    for i, docs in enumerate(workload_batches(data)):
        ids = torch.repeat_interleave(torch.arange(len(docs)), torch.tensor(docs))
        doc.copy_(ids)
        bm = create_block_mask(whole_mask, 1, 1, SEQ_LEN, SEQ_LEN, device=dev, _compile=True)
        single = timed(*whole, bm)
        variant = build_variant({"name": "document", "doc_lengths": list(docs)},
                                seq_len=SEQ_LEN, heads=HEADS)  # fmt: skip
        placed = layout.plan("documents", WORLD, SEQ_LEN, variant, (BLOCK, BLOCK), "cpu")
        print(
            f"batch {i}: {len(docs)} documents, longest {max(docs)}; one device fwd "
            f"{single[0]:.3f} ms, fwd+bwd {single[1]:.3f} ms (ideal at P={WORLD}: "
            f"{single[1] / WORLD:.3f})",
            flush=True,
        )
        for r in range(WORLD):
            pos = placed.positions(r).to(dev)
            qpos.copy_(pos)
            bm = create_block_mask(rank_mask, 1, 1, SHARD, SEQ_LEN, device=dev, _compile=True)
            full = bm.full_kv_num_blocks[0, 0].double()
            partial = bm.kv_num_blocks[0, 0].double()
            price = full * layout.BLOCK_COSTS[0] + partial * layout.BLOCK_COSTS[1]
            by_row = pos.view(-1, BLOCK)
            orders = {
                "position": torch.arange(len(by_row), device=dev),
                "heavy": torch.argsort(price, descending=True, stable=True),
                "reversed": torch.arange(len(by_row) - 1, -1, -1, device=dev),
            }
            for name, order in orders.items():
                qpos.copy_(by_row[order].flatten())
                bm = create_block_mask(rank_mask, 1, 1, SHARD, SEQ_LEN, device=dev, _compile=True)
                fwd, both = timed(*qkv, bm)
                rows.append({
                    "batch": i, "rank": r, "order": name, "fwd_ms": fwd, "fwd_bwd_ms": both,
                    "blocks_full": int(full.sum()), "blocks_partial": int(partial.sum()),
                    "price": float(price.sum()), "longest_row_blocks": int((full + partial).max()),
                    "single_fwd_ms": single[0], "single_fwd_bwd_ms": single[1],
                })  # fmt: skip
                print(
                    f"  rank {r} {name:9s} fwd {fwd:.3f} fwd+bwd {both:.3f} ms "
                    f"price {float(price.sum()):.0f}, longest row "
                    f"{int((full + partial).max())} blocks",
                    flush=True,
                )
        for name in ("position", "heavy", "reversed"):
            mine = [x for x in rows if x["batch"] == i and x["order"] == name]
            most = max(x["fwd_bwd_ms"] for x in mine)
            print(
                f"batch {i} {name}: slowest rank {most:.3f} ms fwd+bwd, mean "
                f"{statistics.fmean(x['fwd_bwd_ms'] for x in mine):.3f}, slowest over ideal "
                f"{most / (single[1] / WORLD):.3f}",
                flush=True,
            )
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()
