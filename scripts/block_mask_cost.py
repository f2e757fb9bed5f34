"""What a block mask costs at long sequences, against the attention it serves.

For each variant and sequence length: the seconds attngym.kernels.make_block_mask takes (the first
call and the median of the next ones; the variant's block rule where it has one), the same for
create_block_mask evaluating the mask_mod on every pair (compiled above
kernels.COMPILED_MASK_ENTRIES; its first call may compile), whether both give the same blocks,
the compiled flex forward+backward on one device with the mask (bench.time_fn: CUDA events, L2
flushed) and each mask's share of it. A context-parallel rank builds masks for its rows only
(S/P of them), so the whole-sequence mask here is the worst case.

Usage (one GPU):
    python scripts/block_mask_cost.py --seq-lens 131072 262144 524288 1048576 --out cost.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import time

import torch

from attngym import bench, kernels, variants
from attngym.device import sync


def _variant(name: str, seq_len: int):
    if name == "causal":
        return variants.get("causal")
    if name == "sliding_window":
        return variants.get("sliding_window", window_size=1024)
    if name == "document":  # unequal documents, 4K to 60K tokens, as packed pre-training has
        rng = random.Random(0)
        lengths: list[int] = []
        while sum(lengths) < seq_len:
            lengths.append(min(rng.randrange(4096, 61440), seq_len - sum(lengths)))
        return variants.get("document", doc_lengths=lengths)
    raise ValueError(f"--variants: unknown {name!r} (causal, sliding_window, document)")


def _mask_seconds(variant, seq_len: int, repeats: int, device) -> tuple[float, float, object]:
    """(first, median of the next `repeats`) seconds of a fresh make_block_mask, and the mask."""
    times = []
    for _ in range(repeats + 1):  # outside kernels.kept_block_masks: each call builds it
        sync(device)
        start = time.perf_counter()
        mask = kernels.make_block_mask(variant, seq_len, seq_len, device=device)
        sync(device)
        times.append(time.perf_counter() - start)
    return times[0], statistics.median(times[1:]), mask


def measure(name: str, seq_len: int, args, device) -> dict:
    variant = _variant(name, seq_len).to(device)
    first_s, median_s, mask = _mask_seconds(variant, seq_len, args.mask_repeats, device)
    generic = dataclasses.replace(variant, block_rule=None)  # create_block_mask on every pair
    generic_first_s, generic_s, generic_mask = _mask_seconds(generic, seq_len, 1, device)
    same = torch.equal(mask.kv_num_blocks, generic_mask.kv_num_blocks) and torch.equal(
        mask.full_kv_num_blocks, generic_mask.full_kv_num_blocks
    )
    del generic_mask
    row = {
        "variant": name,
        "seq_len": seq_len,
        "mask_first_s": round(first_s, 4),
        "mask_s": round(median_s, 4),
        "create_block_mask_first_s": round(generic_first_s, 4),
        "create_block_mask_s": round(generic_s, 4),
        "same_blocks": same,
        "sparsity": round(float(bench.block_sparsity(mask)), 4),
    }
    pairs = (1.0 - row["sparsity"]) * seq_len**2
    if pairs <= args.max_attention_pairs:
        shape = (1, args.heads, seq_len, args.head_dim)
        q, k, v = (
            torch.randn(shape, device=device, dtype=torch.bfloat16, requires_grad=True)
            for _ in range(3)
        )
        grad = torch.randn(shape, device=device, dtype=torch.bfloat16)

        def fwd_bwd():
            out, _ = kernels.attend_chunk(q, k, v, variant, backend="flex", block_mask=mask)
            torch.autograd.grad(out, (q, k, v), grad)

        fwd_bwd()  # compile
        timing = bench.time_fn(fwd_bwd, warmup=1, repeats=args.repeats, device=device)
        row["fwd_bwd_ms"] = round(timing.median_ms, 3)
        row["mask_share"] = round(median_s * 1e3 / timing.median_ms, 5)
        row["create_block_mask_share"] = round(generic_s * 1e3 / timing.median_ms, 5)
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[131072, 262144, 524288])
    parser.add_argument("--variants", nargs="+", default=["causal", "document", "sliding_window"])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mask-repeats", type=int, default=3)
    parser.add_argument(
        "--max-attention-pairs",
        type=float,
        default=2e11,
        help="time the attention only where it attends at most this many pairs (causal 1M: 5e11)",
    )
    parser.add_argument("--out", default="block_mask_cost.json")
    args = parser.parse_args()
    device = torch.device("cuda")
    kernels.raise_recompile_limits()
    rows = [measure(name, s, args, device) for s in args.seq_lens for name in args.variants]
    with open(args.out, "w") as f:
        json.dump(
            {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows},
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
