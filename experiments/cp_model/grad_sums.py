"""The sums a ring step pays on its gradients, eager against compiled (cp.compiled_sums): a
bfloat16 piece cast to float32, a float32 sum plus a bfloat16 piece (a new tensor: the dK/dV
passed on) and a float32 sum += a bfloat16 piece in place (the rank's dq), at one rank's shard
of the scaling rows (B=1, H=8, S/P=16K, D=128), with the memory speed each reaches.

    python experiments/cp_model/grad_sums.py
"""

from __future__ import annotations

import torch

from attngym import bench
from attngym.distributed.cp import _add_into, _cast_add, compiled_sums


def main() -> None:
    dev, shape = torch.device("cuda"), (1, 8, 16384, 128)
    piece = torch.randn(shape, device=dev, dtype=torch.bfloat16)
    total = torch.randn(shape, device=dev, dtype=torch.float32)
    n = piece.numel()
    cast_add, add_into = compiled_sums()
    cases = {  # name: (eager, compiled, bytes read and written)
        "cast bf16 -> fp32": (lambda: _cast_add(piece, None, torch.float32),
                              lambda: cast_add(piece, None, torch.float32), 6 * n),
        "fp32 + bf16 (new)": (lambda: _cast_add(total, piece, torch.float32),
                              lambda: cast_add(total, piece, torch.float32), 10 * n),
        "fp32 += bf16": (lambda: _add_into(total, piece, torch.float32),
                         lambda: add_into(total, piece, torch.float32), 10 * n),
    }  # fmt: skip
    for name, (eager, compiled, nbytes) in cases.items():
        times = [bench.time_fn(fn, warmup=3, repeats=20, device=dev).median_ms
                 for fn in (eager, compiled)]  # fmt: skip
        rates = ", ".join(f"{nbytes / (t * 1e-3) / 1e12:.2f}" for t in times)
        print(f"{name:18s} eager {times[0] * 1e3:6.1f} us, compiled {times[1] * 1e3:6.1f} us "
              f"({rates} TB/s)")  # fmt: skip


if __name__ == "__main__":
    main()
