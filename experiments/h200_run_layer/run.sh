#!/usr/bin/env bash
# The refactored run layer and CP task on one H200, custom and attention-gym variants on CUDA, and
# the wall time of the default run (first and second run in fresh processes).
#   bash experiments/h200_run_layer/run.sh [OUT_DIR]    (from the repository root)
# On a machine without network, wheels of Hydra, OmegaConf, wandb and attn-gym go in .whl/ first.
set -u
OUT=${1:-${OUT:-/tmp/attngym_h200_run_layer}}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD
# Without an install of attngym, conf/ as the package attngym.conf (what pip's package-dir maps).
python3 -c "import attngym.conf" 2>/dev/null || ln -sfn "$PWD/conf" attngym/conf
mkdir -p /tmp/w && cp experiments/h200_run_layer/mymasks.py /tmp/w/
AG="python3 -m attngym logger=none"
t() { local name=$1; shift; local s=$(date +%s.%N); ( cd /tmp/w && timeout 240 $AG "$@" > $OUT/$name.log 2>&1 ); local rc=$?; echo "$name rc=$rc wall_s=$(python3 -c "print(round($(date +%s.%N)-$s,1))")" | tee -a $OUT/summary.txt; grep -E "validation|fwd \(ms\)|fwd\+bwd \(ms\)|speed-up|efficiency|torch_cp  |error" $OUT/$name.log | head -12 >> $OUT/summary.txt; }
t default1
t default2
t custom_window attention=custom attention.mask_mod=attn_gym.masks.generate_sliding_window attention.mask_args.window_size=256 shape.seq_len=8192 shape.batch=2 shape.heads=16 shape.head_dim=128
t custom_mine attention=custom attention.mask_mod=mymasks.documents "attention.mask_args.lengths=[3000,5192]" shape.seq_len=8192 shape.heads=8 shape.head_dim=128
t gym_document attention=gym_document shape.seq_len=8192 shape.heads=8 shape.head_dim=128
t ring1_custom topology=ring topology.world_size=1 attention=custom attention.mask_mod=mymasks.documents "attention.mask_args.lengths=[20000,45536]" shape.seq_len=65536 shape.heads=8 shape.head_dim=128
echo "== gpu tests" | tee -a $OUT/summary.txt
timeout 280 python3 -m pytest -q -x -m gpu tests/test_tasks_single.py tests/test_kernels_gpu.py tests/test_device.py tests/test_bench.py tests/test_profiling.py -p no:cacheprovider > $OUT/pytest_gpu.log 2>&1; echo "pytest rc=$?" | tee -a $OUT/summary.txt
tail -5 $OUT/pytest_gpu.log >> $OUT/summary.txt
cat $OUT/summary.txt
