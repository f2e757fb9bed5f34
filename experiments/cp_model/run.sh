#!/usr/bin/env bash
# Context parallelism on one H200: every topology at world size 1 against the one-device call (its
# own overhead), launches per call before/after (cp_profile.py), the GPU tests on one GPU, and the
# model: simulated ranks against the two-H200 measurements, and the predicted scaling tables.
#   bash experiments/cp_model/run.sh [OUT_DIR] [tests|overhead|check|scaling|all]   (repository root)
# On a machine without network, wheels of Hydra, OmegaConf, wandb and attn-gym go in .whl/ first.
set -u
OUT=${1:-${OUT:-/tmp/attngym_cp_model}}
WHAT=${2:-all}
mkdir -p "$OUT/metrics"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export ATTNGYM_PROGRESS=0 PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/pycache}
unset PYTHONDONTWRITEBYTECODE
if [ -d .whl ] && [ ! -d /tmp/site/hydra ]; then
  python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD
python3 -c "import attngym.conf" 2>/dev/null || ln -sfn "$PWD/conf" attngym/conf
mkdir -p /tmp/w
t() {  # t NAME ARGS...: one run in a fresh process, its last line and metrics.json
  local name=$1; shift
  ( cd /tmp/w && timeout 240 python3 -m attngym hydra.run.dir=/tmp/runs/$name "$@" > $OUT/$name.log 2>&1 )
  echo "$name rc=$? $(grep -E '^  wall ' $OUT/$name.log)" | tee -a $OUT/summary.txt
  cp /tmp/runs/$name/metrics.json $OUT/metrics/$name.json 2>/dev/null
}
case $WHAT in tests|all)
  timeout 400 python3 -m pytest -q -m "gpu or multigpu" tests/distributed/test_cp_gpu.py \
      tests/distributed/test_ulysses_gpu.py -p no:cacheprovider > $OUT/pytest_cp_gpu.log 2>&1
  echo "pytest rc=$? $(tail -1 $OUT/pytest_cp_gpu.log)" | tee -a $OUT/summary.txt ;;
esac
case $WHAT in overhead|all)
  BASE="+experiment=ring_attention topology.world_size=1 shape.seq_len=65536 shape.heads=8 shape.head_dim=128 logger=none validate_rows=64 benchmark.warmup=1 benchmark.repeats=5"
  for kind in ring allgather ulysses hybrid; do
    extra=""; [ $kind = hybrid ] && extra="topology.a2a_size=1"
    t ws1_${kind}_causal $BASE topology=$kind $extra attention=causal
    t ws1_${kind}_window $BASE topology=$kind $extra attention=sliding_window ++attention.window_size=1024
    t ws1_${kind}_document $BASE topology=$kind $extra attention=document
  done
  for kind in ring allgather; do
    timeout 200 python3 scripts/cp_profile.py --kind $kind --variant sliding_window --seq-len 65536 \
        --layout contiguous --heads 8 --world-size 1 --out $OUT/metrics/profile_${kind}_window.json > $OUT/profile_$kind.log 2>&1
    echo "cp_profile $kind rc=$?" | tee -a $OUT/summary.txt
  done ;;
esac
case $WHAT in check|all)
  timeout 500 python3 scripts/check_cp_model.py experiments/multi_gpu_cp --out /tmp/check > $OUT/check.log 2>&1
  echo "check rc=$?" | tee -a $OUT/summary.txt; cp /tmp/check/check_cp_model.* $OUT/ 2>/dev/null ;;
esac
case $WHAT in scaling)
  timeout 560 python3 scripts/check_cp_model.py --scaling --out /tmp/scaling > $OUT/scaling.log 2>&1
  echo "scaling rc=$?" | tee -a $OUT/summary.txt; cp /tmp/scaling/scaling.* $OUT/ 2>/dev/null ;;
esac
cat $OUT/summary.txt
# The device's file count per call is small: one archive of every file.
tar -C $OUT -czf /tmp/cp_model.tgz . && rm -rf $OUT/* && mv /tmp/cp_model.tgz $OUT/
