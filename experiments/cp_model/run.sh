#!/usr/bin/env bash
# Context parallelism on one H200: every topology at world size 1 against the one-device call (its
# own overhead), launches per call before/after (cp_profile.py), the GPU tests on one GPU, and the
# model: simulated ranks against the two-H200 measurements, and the predicted scaling tables.
#   bash experiments/cp_model/run.sh [OUT_DIR] [PHASE...]   (repository root; default: all)
# PHASE, run in this order: overhead, defects, balanced, check, tests, scaling (all = every one but
# scaling).
# SECONDS_LEFT (default 560) bounds the whole; the tests (TESTS, default every GPU test) leave
# SCALING_S of it to the scaling, which gets what is left, resumes from RESUME (a scaling.json) if
# set, and runs CASES (and TOPOLOGIES) only if set. T_LIMIT: one run's limit.
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
left() { echo $(( END - $(date +%s) - ${1:-0} )); }  # seconds left, keeping $1 for later
enough() { [ "$(left "${2:-0}")" -gt 30 ] || { echo "$1 skipped: out of time" | tee -a $OUT/summary.txt; false; }; }
has() { [[ $WHAT == *" $1 "* || ( $WHAT == *" all "* && $1 != scaling ) ]]; }
t() {  # t NAME ARGS...: one run in a fresh process, its last line and metrics.json
  local name=$1 left=$(left); shift
  enough $name || return 1
  ( cd /tmp/w && timeout $(( left < ${T_LIMIT:-240} ? left : ${T_LIMIT:-240} )) python3 -m attngym hydra.run.dir=/tmp/runs/$name "$@" > $OUT/$name.log 2>&1 )
  local rc=$?
  echo "$name rc=$rc $(grep -E '^  wall ' $OUT/$name.log)" | tee -a $OUT/summary.txt
  cp /tmp/runs/$name/metrics.json $OUT/metrics/$name.json 2>/dev/null
  return $rc
}
if has overhead; then  # KINDS, MASKS and PROFILE (0: no cp_profile) narrow it
  BASE="+experiment=ring_attention topology.world_size=1 shape.seq_len=65536 shape.heads=8 shape.head_dim=128 logger=none validate_rows=64 benchmark.warmup=1 benchmark.repeats=5"
  declare -A MASK=([window]="attention=sliding_window ++attention.window_size=1024"
                   [causal]="attention=causal" [document]="attention=document")
  first=1
  for kind in ${KINDS:-ring allgather ulysses hybrid}; do
    extra=""; [ $kind = hybrid ] && extra="topology.options.a2a_size=1"
    for mask in ${MASKS:-window causal document}; do
      t ws1_${kind}_$mask $BASE topology=$kind $extra ${MASK[$mask]} || [ $first = 0 ] \
        || { echo "the first run failed: overhead stopped" | tee -a $OUT/summary.txt; break 2; }
      first=0
    done
  done
  for kind in ring allgather; do
    [ "${PROFILE:-1}" = 1 ] || break
    timeout 200 python3 scripts/cp_profile.py --kind $kind --variant sliding_window --seq-len 65536 \
        --layout contiguous --heads 8 --world-size 1 --out $OUT/metrics/profile_${kind}_window.json > $OUT/profile_$kind.log 2>&1
    echo "cp_profile $kind rc=$?" | tee -a $OUT/summary.txt
  done
fi
if has defects; then  # two ranks sharing the one GPU (rank 1's SIGSEGV), and the causal 16K ring job
  TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 T_LIMIT=150 t ws2_one_gpu_ring \
    +experiment=ring_attention topology.world_size=2 logger=none
  T_LIMIT=150 t ws1_ring_causal_16k +experiment=ring_attention topology.world_size=1 topology=ring \
    attention=causal shape.seq_len=16384 shape.heads=8 shape.head_dim=128 logger=none
fi
if has balanced; then  # the ring's balanced placement priced per pair kernel, real ranks, validated
  TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 T_LIMIT=150 t ws2_one_gpu_ring_documents_balanced \
    +experiment=ring_attention topology.world_size=2 topology.layout=balanced attention=document \
    logger=none
fi
if has check && enough check; then
  timeout $(left) python3 scripts/check_cp_model.py experiments/multi_gpu_cp \
    --out /tmp/check > $OUT/check.log 2>&1
  echo "check rc=$?" | tee -a $OUT/summary.txt; cp /tmp/check/check_cp_model.* $OUT/ 2>/dev/null
fi
if has tests && enough tests ${SCALING_S:-0}; then
  timeout $(left ${SCALING_S:-0}) python3 -m pytest -v -m "gpu or multigpu" ${TESTS:-tests} \
      -p no:cacheprovider > $OUT/pytest_cp_gpu.log 2>&1
  echo "pytest rc=$? $(tail -1 $OUT/pytest_cp_gpu.log)" | tee -a $OUT/summary.txt
fi
if has scaling && enough scaling; then  # rows are written as they come: a timeout keeps those
  timeout $(left) python3 scripts/check_cp_model.py --scaling --out /tmp/scaling \
    ${RESUME:+--resume "$RESUME"} ${CASES:+--cases $CASES} ${TOPOLOGIES:+--topologies $TOPOLOGIES} \
    > $OUT/scaling.log 2>&1
  echo "scaling rc=$?" | tee -a $OUT/summary.txt; cp /tmp/scaling/scaling.* $OUT/ 2>/dev/null
fi
cat $OUT/summary.txt
# The device's file count per call is small: one archive of every file.
tar -C $OUT -czf /tmp/cp_model.tgz . && rm -rf $OUT/* && mv /tmp/cp_model.tgz $OUT/
