"""The kernels of a flex call and an SDPA-cuDNN call, and (under Nsight Compute) why one is slower.

Builds one variant at one shape, compiles flex (as attngym's single-device task calls it) and warms
both contenders, then runs one forward (under no_grad) and one backward of each:
    * plain: under torch.profiler, the GPU kernels of each pass by name with their time;
    * --ncu: inside cudaProfilerStart/Stop ranges and nothing else, so that
      `ncu --profile-from-start off` collects exactly these kernels. Then `--summarize RAW.csv`
      turns ncu's raw page into a short table: duration, SM and tensor-pipe use, issue activity,
      occupancy, registers, shared memory and the top warp stall reasons per kernel.

Usage (one GPU):
    python scripts/kernel_profile.py --out kernels.json
    ncu --clock-control none --profile-from-start off --set full -o prof \
        python scripts/kernel_profile.py --ncu
    ncu --import prof.ncu-rep --csv --page raw > raw.csv
    python scripts/kernel_profile.py --summarize raw.csv
"""

from __future__ import annotations

import argparse
import collections
import csv
import json
import sys
from pathlib import Path

import torch

# Raw ncu metrics shown by --summarize: the first of a tuple's names the report holds; "-" where
# it holds none (metric names differ between ncu versions and GPU generations).
NCU_METRICS = {
    "ms": "gpu__time_duration.sum",
    "sm_%": "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "tensor_%": (
        "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
        "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
        "sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active",
    ),
    "issue_%": (
        "sm__inst_issued.avg.pct_of_peak_sustained_active",
        "smsp__issue_active.avg.pct_of_peak_sustained_active",
    ),
    "dram_%": (
        "dram__throughput.avg.pct_of_peak_sustained_elapsed",
        "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
    ),
    "occ_%": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "regs": "launch__registers_per_thread",
    "smem_KiB": "launch__shared_mem_per_block_dynamic",
    "threads": "launch__block_size",
    "grid": "launch__grid_size",
}
STALL_PREFIX = "smsp__average_warps_issue_stalled_"
STALL_SUFFIX = "_per_issue_active.ratio"


def _attention(name: str, heads: int, seq_len: int) -> dict:
    """The attention entry as the CLI's config group has it (presets like gemma2 compose two),
    with its `${shape.*}` interpolations resolved for this shape."""
    from omegaconf import OmegaConf

    from attngym.runner.overrides import register_resolvers

    path = Path(__file__).resolve().parents[1] / "conf" / "attention" / f"{name}.yaml"
    if not path.exists():
        return {"name": name}
    register_resolvers()
    shape = {"heads": heads, "seq_len": seq_len}
    cfg = OmegaConf.create({"shape": shape, "attention": OmegaConf.load(path)})
    return OmegaConf.to_container(cfg, resolve=True)["attention"]


def _contenders(args):
    """(name, forward closure) for flex and SDPA-cuDNN on the same inputs."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from attngym import kernels
    from attngym.variants.spec import build_variant

    variant = build_variant(
        _attention(args.variant, args.heads, args.seq_len), seq_len=args.seq_len
    ).to("cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (args.batch, args.heads, args.seq_len, args.head_dim)
    q, k, v, grad = (
        torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4)
    )
    for t in (q, k, v):
        t.requires_grad_(True)
    options = json.loads(args.kernel_options)
    from attngym.device import get_flash_block_size

    block_size = get_flash_block_size() if kernels.is_flash(options) else (128, 128)
    block_mask = kernels.make_block_mask(
        variant, args.seq_len, args.seq_len, block_size=block_size, device="cuda"
    )

    def flex():
        return kernels.attend_chunk(
            q, k, v, variant, backend="flex", block_mask=block_mask, kernel_options=options
        )[0]

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=variant.sdpa == "causal")

    contenders = [("flex", flex)]
    if variant.sdpa in ("full", "causal"):
        contenders.append(("sdpa_cudnn", cudnn))
    return contenders, (q, k, v), grad


def _passes(name, fn, inputs, grad, region):
    """Run the forward, then the backward of a fresh forward, each inside `region(label)`."""
    with region(f"{name}.fwd"), torch.no_grad():
        fn()
        torch.cuda.synchronize()
    out = fn()
    torch.cuda.synchronize()
    with region(f"{name}.bwd"):
        torch.autograd.grad(out, inputs, grad)
        torch.cuda.synchronize()


def _torch_profile(contenders, inputs, grad) -> dict:
    """GPU kernels per contender and pass: {"flex.fwd": {kernel: ms}}."""
    import contextlib

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    result: dict[str, dict[str, float]] = {}

    @contextlib.contextmanager
    def region(label):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            yield
        times: collections.Counter[str] = collections.Counter()
        for e in prof.events():
            if e.device_type == DeviceType.CUDA:
                times[e.name[:120]] += e.device_time / 1e3
        result[label] = {name: round(ms, 4) for name, ms in times.most_common()}

    for name, fn in contenders:
        _passes(name, fn, inputs, grad, region)
    return result


def _ncu_regions(contenders, inputs, grad) -> None:
    import contextlib

    @contextlib.contextmanager
    def region(label):
        torch.cuda.profiler.start()
        try:
            yield
        finally:
            torch.cuda.profiler.stop()

    for name, fn in contenders:
        _passes(name, fn, inputs, grad, region)


def summarize(raw_csv: Path, top_stalls: int = 4) -> list[dict]:
    """Selected metrics per kernel from `ncu --csv --page raw` (row 2 holds the units)."""
    with open(raw_csv, newline="") as f:
        rows = list(csv.DictReader(line for line in f if not line.startswith("==")))
    units, rows = rows[0], rows[1:]
    table = []
    for row in rows:
        entry = {"kernel": row.get("Kernel Name", "?")[:60]}
        for label, names in NCU_METRICS.items():
            names = (names,) if isinstance(names, str) else names
            metric = next((name for name in names if row.get(name)), None)
            if metric is None:
                entry[label] = "-"
                continue
            value = row[metric]
            number = float(value.replace(",", ""))
            unit = units.get(metric, "").lower()
            if label == "ms":
                number /= {"nsecond": 1e6, "usecond": 1e3, "msecond": 1.0, "second": 1e-3}[unit]
            if label == "smem_KiB":  # ncu's Kbyte and Mbyte are decimal
                number *= {"byte": 1, "kbyte": 1e3, "mbyte": 1e6}[unit] / 1024
            entry[label] = round(number, 3 if label == "ms" else 1)
        stalls = {
            name[len(STALL_PREFIX) : -len(STALL_SUFFIX)]: float(value.replace(",", ""))
            for name, value in row.items()
            if name.startswith(STALL_PREFIX) and name.endswith(STALL_SUFFIX) and value
        }
        best = sorted(stalls.items(), key=lambda kv: -kv[1])[:top_stalls]
        entry["top_stalls"] = ", ".join(f"{k} {v:.2f}" for k, v in best)
        table.append(entry)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="causal", help="a conf/attention option")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--kernel-options", default="{}", help="flex kernel_options as JSON")
    parser.add_argument("--ncu", action="store_true", help="mark the ranges for ncu only")
    parser.add_argument("--summarize", type=Path, help="summarise an ncu raw CSV and exit")
    parser.add_argument("--out", type=Path, help="write the result as JSON")
    args = parser.parse_args()

    if args.summarize:
        table = summarize(args.summarize)
        result = {"ncu": table}
        columns = list(table[0]) if table else []
        print("\t".join(columns))
        for entry in table:
            print("\t".join(str(entry[c]) for c in columns))
    else:
        contenders, inputs, grad = _contenders(args)
        for _ in range(3):  # compile, then warm both contenders, in both grad modes
            for _, fn in contenders:
                torch.autograd.grad(fn(), inputs, grad)
                with torch.no_grad():
                    fn()
        torch.cuda.synchronize()
        if args.ncu:
            _ncu_regions(contenders, inputs, grad)
            return
        result = {"shape": vars(args) | {"summarize": None, "out": None}}
        result["kernels_ms"] = _torch_profile(contenders, inputs, grad)
        for label, kernels_ms in result["kernels_ms"].items():
            print(f"{label}: {sum(kernels_ms.values()):.3f} ms")
            for name, ms in list(kernels_ms.items())[:4]:
                print(f"    {ms:8.3f}  {name}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2, default=str))
        print(f"written: {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
