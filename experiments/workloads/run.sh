#!/usr/bin/env bash
# Workloads and the varlen contender on one H200 (issue "your data and your real alternative"):
#   bash experiments/workloads/run.sh OUT [PHASE...]     (from the repository root; wheels in .whl/)
# PHASE: tests one_gpu headline workload_a workload_b workload_auto (default: all; each fits a 10-minute call).
#   tests     the varlen kernels against float64 (GPU tests), and a two-rank workload sharing the GPU
#   one_gpu   the README's Results rows: B=4 H=16 S=8192 D=128, every variant, every contender
#   headline  flex against varlen_attn, fwd+bwd, B=1 H=8 S=64K D=128: window(1024), four documents
#   workload_a  16 lognormal batches (median 2K, tail to 64K) of 128K, P=8 simulated with CUDA
#               graphs: ring and all-gather (balanced; PyTorch's CP predicted with its balancers)
#   workload_b  the same batches: Ulysses and hybrid
#   workload_auto  the same batches, topology=auto: one pick for the workload, its choice's
#               seconds and auto_dynamic_gain (graphs weighed, not fixed)
set -u
OUT=${1:?usage: run.sh OUT [PHASE...]}; shift || true
WHAT=" ${*:-tests one_gpu headline workload_a workload_b workload_auto} "
ROOT=$PWD && mkdir -p "$OUT" && W=$(mktemp -d) && source experiments/gpu_env.sh
export PYTHONPATH=/tmp/site:$PWD ATTNGYM_PROGRESS=0
python3 -c "import attngym.conf" 2>/dev/null || ln -sfn "$PWD/conf" attngym/conf
has() { [[ $WHAT == *" $1 "* ]]; }
AG="python3 -m attngym logger=none"
WL="workload=documents workload.batches=16 workload.median=2048 workload.sigma=1.2 workload.max_len=65536"
SIM="topology.simulate=true topology.cuda_graph=true topology.world_size=8 shape.batch=1 shape.heads=8 shape.head_dim=128 shape.seq_len=131072 attention=document topology.transport=nccl validate=false benchmark.warmup=1 benchmark.repeats=5"
if has tests; then
  export TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1
  T_TIMEOUT=240 t varlen_tests python3 -m pytest -q -p no:cacheprovider "$ROOT/tests/test_varlen.py"
  t workload_2ranks $AG $WL workload.batches=3 attention=document topology=ring topology.world_size=2 \
    topology.layout=balanced shape.batch=1 shape.heads=8 shape.head_dim=128 shape.seq_len=16384 \
    hydra.run.dir=workload_2ranks
  unset TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES
fi
if has one_gpu; then
  T_TIMEOUT=540 t one_gpu $AG +experiment=flex_vs_sdpa shape.seq_len=8192 shape.head_dim=128 \
    benchmark.repeats=10 benchmark.warmup=2 hydra.sweep.dir=one_gpu
  cp "$W/one_gpu/summary.csv" "$OUT/flex_vs_best_d128.csv"
fi
if has headline; then
  H="shape.batch=1 shape.heads=8 shape.head_dim=128 shape.seq_len=65536 baselines=[varlen,flash_varlen,sdpa_cudnn]"
  t headline_window $AG $H attention=sliding_window ++attention.window_size=1024 hydra.run.dir=headline_window
  t headline_documents $AG $H attention=document '++attention.doc_lengths=[16384,16384,16384,16384]' \
    hydra.run.dir=headline_documents
fi
if has workload_a; then
  T_TIMEOUT=560 t workload_ring_allgather $AG -m $WL $SIM topology=ring,allgather topology.layout=balanced \
    hydra.sweep.dir=workload_a
  cp -r "$W/workload_a" "$OUT/"
fi
if has workload_b; then
  T_TIMEOUT=560 t workload_ulysses_hybrid $AG -m $WL $SIM topology=ulysses,hybrid \
    topology.layout=contiguous topology.options.a2a_size=4 'baselines=[]' hydra.sweep.dir=workload_b
  cp -r "$W/workload_b" "$OUT/"
fi
if has workload_auto; then
  T_TIMEOUT=560 t workload_auto $AG $WL ${SIM/topology.cuda_graph=true /} topology=auto \
    hydra.run.dir=workload_auto
  cp "$W/workload_auto/auto.json" "$OUT/workload_auto.auto.json" 2>/dev/null
fi
for d in "$W"/*/; do [ -f "$d/metrics.json" ] && cp "$d/metrics.json" "$OUT/$(basename "$d").metrics.json"; done
echo "done: $(cat "$OUT/summary.txt" 2>/dev/null | wc -l) runs"
