#!/usr/bin/env bash
# Context parallelism on one H200: every topology at world size 1 against the one-device call (its
# own overhead), launches per call before/after (cp_profile.py), the GPU tests on one GPU, and the
# model: simulated ranks against the two-H200 measurements, and the predicted scaling tables.
#   bash experiments/cp_model/run.sh [OUT_DIR] [PHASE...]   (repository root; default: all)
# PHASE: tests, overhead, defects, check, scaling (all = every one but scaling). SECONDS_LEFT (default
# 560) bounds the whole: scaling gets what is left and resumes from RESUME (a scaling.json) if set.
# On a machine without network, wheels of Hydra, OmegaConf, wandb and attn-gym go in .whl/ first.
set -u
OUT=${1:-${OUT:-/tmp/attngym_cp_model}}
shift || true
WHAT=" ${*:-all} "
END=$(( $(date +%s) + ${SECONDS_LEFT:-560} ))
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
has() { [[ $WHAT == *" $1 "* || ( $WHAT == *" all "* && $1 != scaling ) ]]; }
t() {  # t NAME ARGS...: one run in a fresh process, its last line and metrics.json
  local name=$1 left=$(( END - $(date +%s) )); shift
  [ $left -gt 30 ] || { echo "$name skipped: out of time" | tee -a $OUT/summary.txt; return 1; }
  ( cd /tmp/w && timeout $(( left < 240 ? left : 240 )) python3 -m attngym hydra.run.dir=/tmp/runs/$name "$@" > $OUT/$name.log 2>&1 )
  local rc=$?
  echo "$name rc=$rc $(grep -E '^  wall ' $OUT/$name.log)" | tee -a $OUT/summary.txt
  cp /tmp/runs/$name/metrics.json $OUT/metrics/$name.json 2>/dev/null
  return $rc
}
if has tests; then
  timeout $(( END - $(date +%s) )) python3 -m pytest -q -m "gpu or multigpu" tests/distributed/test_cp_gpu.py \
      tests/distributed/test_ulysses_gpu.py -p no:cacheprovider > $OUT/pytest_cp_gpu.log 2>&1
  echo "pytest rc=$? $(tail -1 $OUT/pytest_cp_gpu.log)" | tee -a $OUT/summary.txt
fi
if has overhead; then
  BASE="+experiment=ring_attention topology.world_size=1 shape.seq_len=65536 shape.heads=8 shape.head_dim=128 logger=none validate_rows=64 benchmark.warmup=1 benchmark.repeats=5"
  for kind in ring allgather ulysses hybrid; do
    extra=""; [ $kind = hybrid ] && extra="topology.a2a_size=1"
    t ws1_${kind}_window $BASE topology=$kind $extra attention=sliding_window ++attention.window_size=1024 \
      || [ $kind != ring ] || { echo "the first run failed: overhead stopped" | tee -a $OUT/summary.txt; break; }
    t ws1_${kind}_causal $BASE topology=$kind $extra attention=causal
    t ws1_${kind}_document $BASE topology=$kind $extra attention=document
  done
  for kind in ring allgather; do
    timeout 200 python3 scripts/cp_profile.py --kind $kind --variant sliding_window --seq-len 65536 \
        --layout contiguous --heads 8 --world-size 1 --out $OUT/metrics/profile_${kind}_window.json > $OUT/profile_$kind.log 2>&1
    echo "cp_profile $kind rc=$?" | tee -a $OUT/summary.txt
  done
fi
if has defects; then  # two ranks sharing the one GPU (rank 1's SIGSEGV), and the causal 16K ring job
  TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 t ws2_one_gpu_ring +experiment=ring_attention \
    topology.world_size=2 logger=none
  t ws1_ring_causal_16k +experiment=ring_attention topology.world_size=1 topology=ring \
    attention=causal shape.seq_len=16384 shape.heads=8 shape.head_dim=128 logger=none
fi
if has check; then
  timeout $(( END - $(date +%s) )) python3 scripts/check_cp_model.py experiments/multi_gpu_cp \
    --out /tmp/check > $OUT/check.log 2>&1
  echo "check rc=$?" | tee -a $OUT/summary.txt; cp /tmp/check/check_cp_model.* $OUT/ 2>/dev/null
fi
if has scaling; then  # rows are written as they come: a timeout keeps those done
  timeout $(( END - $(date +%s) )) python3 scripts/check_cp_model.py --scaling --out /tmp/scaling \
    ${RESUME:+--resume "$RESUME"} > $OUT/scaling.log 2>&1
  echo "scaling rc=$?" | tee -a $OUT/summary.txt; cp /tmp/scaling/scaling.* $OUT/ 2>/dev/null
fi
cat $OUT/summary.txt
# The device's file count per call is small: one archive of every file.
tar -C $OUT -czf /tmp/cp_model.tgz . && rm -rf $OUT/* && mv /tmp/cp_model.tgz $OUT/
