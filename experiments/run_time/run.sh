#!/usr/bin/env bash
# Where a run's wall time goes on one H200: the default run, the headline causal 8K run, a CP job
# at one rank, a forward-only run and a 10-job sweep, the first ones a first and a second time in
# fresh processes; then the block-mask cost at long sequences.
#   bash experiments/run_time/run.sh [OUT_DIR] [runs|masks|all]   (from the repository root)
# On a machine without network, wheels of Hydra, OmegaConf, wandb and attn-gym go in .whl/ first.
set -u
OUT=${1:-${OUT:-/tmp/attngym_run_time}}
WHAT=${2:-all}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# A read-only Python installation without bytecode caches compiles every module it imports again
# in each process (10 s of `import torch` and its dependencies there): keep the bytecode in /tmp.
export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/pycache}
unset PYTHONDONTWRITEBYTECODE
if [ -d .whl ] && [ ! -d /tmp/site/hydra ]; then
  python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD
python3 -c "import attngym.conf" 2>/dev/null || ln -sfn "$PWD/conf" attngym/conf
mkdir -p /tmp/w "$OUT/metrics"
t() {  # t NAME ARGS...: one run in a fresh process: its wall time, last line and metrics.json
  local name=$1; shift; local s=$(date +%s.%N)
  ( cd /tmp/w && timeout 200 python3 -m attngym hydra.run.dir=/tmp/runs/$name "$@" > $OUT/$name.log 2>&1 )
  local rc=$?
  echo "$name rc=$rc wall_s=$(python3 -c "print(round($(date +%s.%N)-$s,1))") $(grep -E '^  wall ' $OUT/$name.log)" | tee -a $OUT/summary.txt
  cp /tmp/runs/$name/metrics.json $OUT/metrics/$name.json 2>/dev/null
}
if [ "$WHAT" != masks ]; then
  { env | grep -E '^PYTHON' ; python3 -c "import sys; print('dont_write_bytecode', sys.flags.dont_write_bytecode, 'prefix', sys.pycache_prefix)"; } > $OUT/env.txt 2>&1
  t default1
  t default2
  HEAD="attention=causal shape.seq_len=8192 shape.heads=16 shape.head_dim=128 logger=none"
  t causal8k1 $HEAD
  t causal8k2 $HEAD
  t fwd_only $HEAD "passes=[fwd]" attention=document
  CP="+experiment=ring_attention topology.world_size=1 attention=sliding_window ++attention.window_size=1024 shape.seq_len=65536 shape.heads=8 shape.head_dim=128 logger=none"
  t cp1 $CP
  t cp2 $CP
  s=$(date +%s.%N)
  ( cd /tmp/w && timeout 200 python3 -m attngym -m hydra.sweep.dir=/tmp/sweep logger=none shape.seq_len=8192 shape.heads=16 shape.head_dim=128 \
      attention=full,causal,sliding_window,document,prefix_lm,alibi,softcap,gemma2,chunked_causal,dilated_sliding_window > $OUT/sweep.log 2>&1 )
  echo "sweep rc=$? wall_s=$(python3 -c "print(round($(date +%s.%N)-$s,1))")" | tee -a $OUT/summary.txt
  cp /tmp/sweep/summary.csv $OUT/metrics/sweep_summary.csv 2>/dev/null
fi
if [ "$WHAT" != runs ]; then
  timeout 200 python3 scripts/block_mask_cost.py --seq-lens 131072 524288 1048576 --out $OUT/block_mask_cost.json > $OUT/block_mask_cost.log 2>&1
  echo "block_mask_cost rc=$?" | tee -a $OUT/summary.txt
  tail -14 $OUT/block_mask_cost.log
fi
cat $OUT/summary.txt
# The device's file count per call is small: one archive of every file.
tar -C $OUT -czf /tmp/run_time.tgz . && rm -rf $OUT/* && mv /tmp/run_time.tgz $OUT/
