#!/usr/bin/env bash
# How near the limit, what it costs, which kernel ran, and the tuner, on one GPU (issue: fraction
# of peak, joules, kernel path, a tuner for your own mask). From the repository root:
#   bash experiments/limits/run.sh OUT [PHASE...]      PHASE: tests triton flash cp tune shipped
#                                                    (default: all)
# Offline GPU hosts: build the wheels first with the tuner's extra, e.g.
#   ../shared/tools/gpu-wheelhouse .whl "hydra-optuna-sweeper>=1.2" "sqlalchemy>=1.4,<2" "alembic<1.14"
# and, for the flash phase, flash-attn-4's (experiments/h200_flex/README.md lists them).
# T_TIMEOUT bounds one run (default 300 s); TRIALS the tuner's trials per variant (default 6);
# TUNE the variants the tune and shipped phases run (default: causal sliding_window document custom).
set -u
OUT=${1:?usage: run.sh OUT [PHASE...]}; shift || true
WHAT=" ${*:-tests triton flash cp tune shipped} "
ROOT=$PWD && mkdir -p "$OUT" && W=$(mktemp -d) && source experiments/gpu_env.sh
export PYTHONPATH=$PYTHONPATH:$PWD ATTNGYM_PROGRESS=0 XDG_CACHE_HOME=$W/cache
readme_masks $W
AG="python3 -m attngym logger=none"
SHAPE="shape.batch=4 shape.heads=16 shape.seq_len=8192 shape.head_dim=128"
has() { [[ $WHAT == *" $1 "* ]]; }
if has tests; then  # the limits metrics, the energy counter and the kernel path on this GPU
  t tests python3 -m pytest -q -p no:cacheprovider "$ROOT/tests/test_limits.py" \
    "$ROOT/tests/test_profiling.py" "$ROOT/tests/test_tune.py"
fi
HEADLINE="full causal sliding_window document prefix_lm alibi softcap"
if has triton; then  # the headline variants at 8K (docs/results.md), beside cuDNN
  for v in $HEADLINE; do
    t "triton_$v" $AG attention=$v $SHAPE 'baselines=[sdpa_cudnn]' hydra.run.dir=triton_$v
  done
fi
if has flash; then  # the same with FLASH, beside cuDNN and Triton flex's defaults
  for v in $HEADLINE; do
    t "flash_$v" $AG attention=$v $SHAPE block_size=flash kernel_options.BACKEND=FLASH \
      'baselines=[sdpa_cudnn,flex_default]' hydra.run.dir=flash_$v
  done
fi
if has cp; then  # a context-parallel run reports the same, two ranks sharing this GPU (counted once)
  TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 t cp_ring $AG +experiment=ring_attention \
    topology.world_size=2 shape.seq_len=32768 shape.heads=8 hydra.run.dir=cp_ring
fi
mask_of() { [ "$1" = custom ] && echo attention.mask_mod=mymasks.checkerboard; }
if has tune; then  # the tuner on three catalogue variants and a user's mask, then the winner
  for v in ${TUNE:-causal sliding_window document custom}; do
    T_TIMEOUT=${T_TUNE:-900} t "tune_$v" python3 -m attngym +experiment=tune attention=$v \
      $(mask_of $v) hydra.sweeper.n_trials=${TRIALS:-6} hydra.sweep.dir=tune_$v
    t "tuned_$v" $AG attention=$v $(mask_of $v) $SHAPE block_size=tuned \
      'baselines=[flex_default]' hydra.run.dir=tuned_$v
  done
  cp "$XDG_CACHE_HOME/attngym/tuned.json" "$OUT/user_tuned.json" 2>/dev/null
  for d in "$W"/tune_*/; do cp "$d/summary.csv" "$OUT/$(basename $d).summary.csv" 2>/dev/null; done
fi
if has shipped; then  # the shipped table alone (an empty cache folder: no user table)
  for v in ${TUNE:-causal sliding_window document custom}; do
    XDG_CACHE_HOME=$W/shipped t "shipped_$v" $AG attention=$v $(mask_of $v) $SHAPE \
      block_size=tuned 'baselines=[flex_default]' hydra.run.dir=shipped_$v
  done
fi
for d in "$W"/*/; do  # metrics of every run
  [ -f "$d/metrics.json" ] && cp "$d/metrics.json" "$OUT/$(basename $d).metrics.json"
done
cat "$OUT/summary.txt"
tar -C "$OUT" -czf /tmp/limits.tgz . && rm -rf "$OUT"/* && mv /tmp/limits.tgz "$OUT/"
