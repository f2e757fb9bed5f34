#!/usr/bin/env bash
# The README's Quick start on one H200, and the GPU paths the reliability and newcomer rounds
# touched: the first-call timing (first_call_s), the ring at one rank beside the one-device call
# (forward and backward against float64), a script without a main guard running a 2-rank ring on
# one shared GPU (gloo group), and a GPU sweep with a failing job (exit code, summary, report).
#   bash experiments/h200_newcomer/run.sh [OUT_DIR]    (from the repository root)
# On a machine without network, wheels of Hydra, OmegaConf and wandb (and attngym's) go in .whl/.
set -u
OUT=${1:-${OUT:-/tmp/attngym_h200_newcomer}}
mkdir -p "$OUT"
T_TIMEOUT=200  # seconds a command may take (t, experiments/gpu_env.sh)
source experiments/gpu_env.sh  # the H200's settings, the wheels of .whl/, t NAME COMMAND
W=/tmp/w_newcomer && rm -rf $W && mkdir -p $W
readme_masks $W  # the Quick start's mymasks.py
AG="python3 -m attngym logger=none"
t quick_start $AG attention=custom attention.mask_mod=mymasks.checkerboard hydra.run.dir=quick
t ring1_causal_32k $AG topology=ring topology.world_size=1 shape.seq_len=32768 shape.heads=8 shape.head_dim=128 hydra.run.dir=ring1
cat > $W/noguard.py <<'PY'
import attngym
from mymasks import strided
print("script body runs", flush=True)
m = attngym.run(mask_mod=strided, mask_args={"stride": 3}, run_dir="noguard",
                overrides=["topology=ring", "topology.world_size=2", "topology.timeout_s=120",
                           "shape.seq_len=8192", "shape.heads=8", "shape.head_dim=128", "logger=none"])
print("status", m["status"], "validation", m.get("validation"), "bwd", m.get("bwd_status"),
      "err_dq_rel", m.get("err_dq_rel"), flush=True)
PY
TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 t noguard_ring2_shared python3 noguard.py
t sweep_failing python3 -m attngym -m logger=none attention=custom attention.mask_mod=mymasks.checkerboard,mymasks.strided shape.seq_len=4096 hydra.sweep.dir=sweep
( cd $W && python3 -m attngym report sweep > $OUT/report.log 2>&1; echo "report rc=$?" | tee -a $OUT/summary.txt )
grep -c "script body runs" $OUT/noguard_ring2_shared.log | sed 's/^/script bodies run: /' | tee -a $OUT/summary.txt
for f in $OUT/*.log; do awk -v f=$(basename $f) 'length($0) > 100 && $0 !~ /\// && $0 !~ /error|failed: |\[HYDRA\] \t#/ {n++} END {print f": lines over 100 (no path, no error): "n+0}' $f; done | tee -a $OUT/summary.txt
( cd $W && tar czf $OUT/pictures.tgz quick/*.png ring1/*.png sweep/summary.* sweep/report.html noguard/metrics.json ring1/metrics.json quick/metrics.json )
cat $OUT/summary.txt
