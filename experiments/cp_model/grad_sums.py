"""The sums a ring rank pays over its steps, added as each piece comes against held and added in
one pass (cp.HELD; merge.merged_weights and merge.weighted_sum), both compiled, at one rank's
shard of the scaling rows (B=1, H=8, S/P=16K, D=128) with 8 steps, with the memory speed each
reaches:

    dq          8 bfloat16 pieces summed in float32, written in bfloat16
    out         8 partials (bfloat16 out, float32 lse) merged, written in bfloat16
    dK/dV on    a float32 sum so far plus a bfloat16 piece, a new float32 tensor (one pass
                either way: the same call)

One at a time is what the ring did before: the first piece cast to float32, each next one
added into that sum in place (a read and a write of it), one cast at the end.

    python experiments/cp_model/grad_sums.py
"""

from __future__ import annotations

import torch

from attngym import bench
from attngym.distributed.call.merge import compiled_sums

STEPS = 8


def _fold_into(out, lse, out_i, lse_i):
    """One partial merged into a float32 (out, lse) in place, as the ring's merge did."""
    new = torch.logaddexp(lse, lse_i)
    w_old = torch.where(torch.isneginf(lse), 0.0, torch.exp(lse - new)).unsqueeze(-1)
    w_new = torch.where(torch.isneginf(lse_i), 0.0, torch.exp(lse_i - new)).unsqueeze(-1)
    out.mul_(w_old).addcmul_(out_i, w_new)
    lse.copy_(new)


def _add_into(total, piece):
    total.add_(piece)


def main() -> None:
    dev, shape = torch.device("cuda"), (1, 8, 16384, 128)
    pieces = [torch.randn(shape, device=dev, dtype=torch.bfloat16) for _ in range(STEPS)]
    lses = [torch.randn(shape[:3], device=dev) for _ in range(STEPS)]
    weights_of, summed = compiled_sums()
    fold_into, add_into = torch.compile(_fold_into), torch.compile(_add_into)
    bf16, fp32 = torch.bfloat16, torch.float32

    def dq_each():
        total = summed(pieces[:1], None, fp32, fp32)
        for piece in pieces[1:]:
            add_into(total, piece)
        return summed([total], None, fp32, bf16)

    def out_each():
        out, lse = summed(pieces[:1], None, fp32, fp32), lses[0].clone()
        for out_i, lse_i in zip(pieces[1:], lses[1:], strict=True):
            fold_into(out, lse, out_i, lse_i)
        return summed([out], None, fp32, bf16), lse

    def out_once():
        lse, ws = weights_of(lses)
        return summed(pieces, ws, fp32, bf16), lse

    so_far = torch.randn(shape, device=dev, dtype=fp32)
    n = pieces[0].numel()
    cases = {  # name: (one at a time, one pass, bytes the one pass reads and writes)
        "dq": (dq_each, lambda: summed(pieces, None, fp32, bf16), (2 * STEPS + 2) * n),
        "out": (out_each, out_once, (2 * STEPS + 2) * n),
        "dK/dV on": (None, lambda: summed([so_far, pieces[0]], None, fp32, fp32), 10 * n),
    }
    for name, (each, once, nbytes) in cases.items():
        fns = [fn for fn in (each, once) if fn is not None]
        times = [bench.time_fn(fn, warmup=3, repeats=20, device=dev).median_ms for fn in fns]
        rate = nbytes / (times[-1] * 1e-3) / 1e12
        each_s = f"one at a time {times[0] * 1e3:6.1f} us, " if each is not None else ""
        print(f"{name:9s} {each_s}one pass {times[-1] * 1e3:6.1f} us ({rate:.2f} TB/s)")


if __name__ == "__main__":
    main()
