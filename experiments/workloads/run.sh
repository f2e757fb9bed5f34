#!/usr/bin/env bash
# Workloads and the varlen contender on one H200 (issue "your data and your real alternative"):
#   bash experiments/workloads/run.sh OUT [PHASE...]     (from the repository root; wheels in .whl/)
#   BATCHES=N: the workload's first N batches only (default 16), for a short call
# PHASE: tests tests_ulysses tests_documents one_gpu headline workload_ring workload_allgather
# workload_ring_documents workload_allgather_documents workload_ulysses workload_ulysses_rounds
# workload_ulysses_rounds4 workload_hybrid workload_auto workload_auto_profile workload_allgather_unfolded
# workload_allgather_documents_unfolded
# (default: all but the profile and the unfolded; a 10-minute call takes one_gpu and tests, or about three workload runs).
#   tests     the varlen kernels against float64 (GPU tests), CP calls captured as CUDA graphs
#             against eager ones, and a two-rank workload sharing the GPU
#   tests_ulysses  Ulysses (one call and in rounds) and the copy-engine all-to-all on two ranks
#             sharing the GPU, against float64
#   one_gpu   the README's Results rows: B=4 H=16 S=8192 D=128, every variant, every contender
#   headline  flex against varlen_attn, fwd+bwd, B=1 H=8 S=64K D=128: window(1024), four documents
#   workload_<scheme>  16 lognormal batches (median 2K, tail to 64K) of 128K, P=8 simulated with
#               CUDA graphs: ring (PyTorch's CP predicted beside it with its balancers), all-gather
#               (both balanced), Ulysses and hybrid (contiguous), Ulysses in rounds (zigzag,
#               topology.options.pipeline=true; _rounds4: double_zigzag, four rounds)
#   workload_ring_documents, workload_allgather_documents  the same batches on layout=documents
#               (whole documents placed from their lengths, the long ones split head and tail)
#   workload_allgather_unfolded, workload_allgather_documents_unfolded  (not in the default
#               list) the all-gather's two with topology.options.fold=false: its calls with the
#               heads one after the other, as flex runs them unfolded
#   tests_documents  a 3-batch workload on two ranks sharing the GPU, ring and all-gather (its
#             call split around the exchange) on layout=documents, each batch against float64
#   workload_auto  the same batches, topology=auto: one pick for the workload, its choice's
#               seconds and auto_dynamic_gain (graphs weighed, not fixed)
#   workload_auto_profile  the same with a cProfile of the run's Python (run_profile.txt): where
#               the choice's seconds go (the profiler slows it: its auto_s is not the answer's)
set -u
OUT=${1:?usage: run.sh OUT [PHASE...]}; shift || true
WHAT=" ${*:-tests tests_ulysses tests_documents one_gpu headline workload_ring workload_allgather workload_ring_documents workload_allgather_documents workload_ulysses workload_ulysses_rounds workload_ulysses_rounds4 workload_hybrid workload_auto} "
ROOT=$PWD && mkdir -p "$OUT" && W=$(mktemp -d) && source experiments/gpu_env.sh
export PYTHONPATH=/tmp/site:$PWD ATTNGYM_PROGRESS=0
python3 -c "import attngym.conf" 2>/dev/null || ln -sfn "$PWD/conf" attngym/conf
has() { [[ $WHAT == *" $1 "* ]]; }
AG="python3 -m attngym logger=none"
WL="workload=documents workload.batches=${BATCHES:-16} workload.median=2048 workload.sigma=1.2 workload.max_len=65536"
SIM="topology.simulate=true topology.cuda_graph=true topology.world_size=8 shape.batch=1 shape.heads=8 shape.head_dim=128 shape.seq_len=131072 attention=document topology.transport=nccl validate=false benchmark.warmup=1 benchmark.repeats=5"
if has one_gpu; then
  T_TIMEOUT=420 t one_gpu $AG +experiment=flex_vs_sdpa shape.seq_len=8192 shape.head_dim=128 \
    benchmark.repeats=10 benchmark.warmup=2 hydra.sweep.dir=one_gpu
  cp "$W/one_gpu/summary.csv" "$OUT/flex_vs_best_d128.csv"
fi
if has tests; then
  export TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1
  T_TIMEOUT=150 t varlen_tests python3 -m pytest -q -p no:cacheprovider "$ROOT/tests/test_varlen.py"
  T_TIMEOUT=150 t graph_tests python3 -m pytest -q -p no:cacheprovider \
    "$ROOT/tests/distributed/test_cp_gpu.py" -k replay_as_cuda_graphs
  T_TIMEOUT=120 t workload_2ranks $AG $WL workload.batches=3 attention=document topology=ring topology.world_size=2 \
    topology.layout=balanced shape.batch=1 shape.heads=8 shape.head_dim=128 shape.seq_len=16384 \
    hydra.run.dir=workload_2ranks
  unset TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES
fi
if has tests_documents; then  # layout=documents on two ranks sharing the GPU, each batch validated
  export TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1
  for s in ring "allgather topology.options.overlap=true"; do
    T_TIMEOUT=120 t "workload_2ranks_documents_${s%% *}" $AG $WL workload.batches=3 \
      attention=document topology=$s topology.world_size=2 topology.layout=documents \
      shape.batch=1 shape.heads=8 shape.head_dim=128 shape.seq_len=16384 \
      hydra.run.dir="workload_2ranks_documents_${s%% *}"
  done
  unset TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES
fi
if has tests_ulysses; then
  export TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1
  T_TIMEOUT=420 t tests_ulysses python3 -m pytest -q -p no:cacheprovider \
    "$ROOT/tests/distributed/test_ulysses_gpu.py" "$ROOT/tests/distributed/test_copy_engine_gpu.py" \
    -k "ulysses or alltoall"
  unset TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES
fi
if has headline; then
  H="shape.batch=1 shape.heads=8 shape.head_dim=128 shape.seq_len=65536 baselines=[varlen,flash_varlen,sdpa_cudnn]"
  t headline_window $AG $H attention=sliding_window ++attention.window_size=1024 hydra.run.dir=headline_window
  t headline_documents $AG $H attention=document '++attention.doc_lengths=[16384,16384,16384,16384]' \
    hydra.run.dir=headline_documents
fi
# One run a scheme (not a sweep): a run cut by its timeout keeps the batches it finished in
# batches.csv. PyTorch's CP is predicted beside the ring only (the same batches for every scheme).
scheme() {  # NAME TIMEOUT OVERRIDES...
  local name=$1 limit=$2; shift 2
  T_TIMEOUT=$limit t "$name" $AG $WL $SIM "$@" hydra.run.dir="$name"
  mkdir -p "$OUT/$name" && cp "$W/$name"/{batches.csv,metrics.json,batches.png} "$OUT/$name/" 2>/dev/null
}
has workload_ring && scheme workload_ring 400 topology=ring topology.layout=balanced
has workload_allgather && scheme workload_allgather 240 topology=allgather topology.layout=balanced 'baselines=[]'
has workload_allgather_unfolded && scheme workload_allgather_unfolded 240 topology=allgather \
  topology.layout=balanced topology.options.fold=false 'baselines=[]'
has workload_ulysses && scheme workload_ulysses 150 topology=ulysses topology.layout=contiguous 'baselines=[]'
has workload_ulysses_rounds && scheme workload_ulysses_rounds 150 topology=ulysses topology.layout=zigzag \
  topology.options.pipeline=true 'baselines=[]'
has workload_ulysses_rounds4 && scheme workload_ulysses_rounds4 150 topology=ulysses \
  topology.layout=double_zigzag topology.options.pipeline=true 'baselines=[]'
has workload_ring_documents && scheme workload_ring_documents 300 topology=ring topology.layout=documents
has workload_allgather_documents && scheme workload_allgather_documents 200 topology=allgather \
  topology.layout=documents 'baselines=[]'
has workload_allgather_documents_unfolded && scheme workload_allgather_documents_unfolded 200 \
  topology=allgather topology.layout=documents topology.options.fold=false 'baselines=[]'
has workload_hybrid && scheme workload_hybrid 200 topology=hybrid topology.layout=contiguous \
  topology.options.a2a_size=4 'baselines=[]'
if has workload_auto; then
  T_TIMEOUT=240 t workload_auto $AG $WL ${SIM/topology.cuda_graph=true /} topology=auto \
    'baselines=[]' hydra.run.dir=workload_auto
  mkdir -p "$OUT/workload_auto" && cp "$W/workload_auto"/{auto.json,batches.csv,metrics.json} "$OUT/workload_auto/" 2>/dev/null
fi
if has workload_auto_profile; then
  T_TIMEOUT=400 t workload_auto_profile $AG $WL ${SIM/topology.cuda_graph=true /} topology=auto \
    topology.options.reuse=false profile_run=true 'baselines=[]' hydra.run.dir=workload_auto_profile
  mkdir -p "$OUT/workload_auto_profile" && cp "$W/workload_auto_profile"/{auto.json,run_profile.txt,run_profile.prof,metrics.json} \
    "$OUT/workload_auto_profile/" 2>/dev/null
fi
for d in "$W"/*/; do [ -f "$d/metrics.json" ] && cp "$d/metrics.json" "$OUT/$(basename "$d").metrics.json"; done
python3 "$ROOT/experiments/workloads/compare.py" "$OUT" > "$OUT/compare.md" 2>&1
echo "done: $(cat "$OUT/summary.txt" 2>/dev/null | wc -l) runs"
tar -C "$OUT" -czf /tmp/workloads.tgz . && rm -rf "${OUT:?}"/* && mv /tmp/workloads.tgz "$OUT/"
