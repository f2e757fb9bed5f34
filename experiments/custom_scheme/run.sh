#!/usr/bin/env bash
# A user's context-parallel scheme and balancer on one H200: docs/custom-cp.md's mycp.py (an
# all-gather written with attngym's public pieces) on two ranks sharing the GPU (gloo group), in a
# sweep beside the built-in ring and all-gather, validated forward and backward against float64; a
# balancer of the user's on the ring; and the simulated ranks of issue 35's table again after the
# topology refactor (the same predictions are expected, the same work being simulated).
#   bash experiments/custom_scheme/run.sh [OUT_DIR]    (from the repository root)
# On a machine without network, wheels of Hydra, OmegaConf and wandb (and attngym's) go in .whl/.
set -u
OUT=${1:-${OUT:-/tmp/attngym_custom_scheme}}
mkdir -p "$OUT"
source experiments/gpu_env.sh  # the H200's settings, the wheels of .whl/, t NAME COMMAND
W=/tmp/w_custom_scheme && rm -rf $W && mkdir -p $W
# docs/custom-cp.md's mycp.py, as a user copies it; the tests' balancers as a user's own module.
python3 - "$PWD/docs/custom-cp.md" > $W/mycp.py <<'PY'
import re, sys
print(re.search(r"```python\n# mycp\.py\n(.*?)```", open(sys.argv[1]).read(), re.S)[1])
PY
cp tests/distributed/balancers.py $W/mybal.py
AG="python3 -m attngym"  # a sweep's -m comes first, then logger=none
SHAPE="shape.heads=8 shape.head_dim=128"
# One rank beside the one-device call in the same job (efficiency): what the refactored ring,
# all-gather and the docs' scheme cost of their own; causal S=32K, validated against float64.
for kind in ring allgather custom; do
  [ -z "${SKIP_ONE_RANK:-}" ] && t one_rank_$kind $AG logger=none topology=$kind topology.scheme=mycp.my_allgather topology.world_size=1 shape.seq_len=32768 $SHAPE hydra.run.dir=one_rank_$kind
done
# Two ranks on one GPU: protocol and correctness, not NVLink speed.
[ -z "${SKIP_SHARED:-}" ] && TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 t shared_sweep $AG -m logger=none topology=ring,allgather,custom topology.scheme=mycp.my_allgather topology.world_size=2 topology.layout=zigzag attention=document shape.seq_len=16384 $SHAPE hydra.sweep.dir=sweep
# Issue 35's table, simulated again: S=128K, P=8, fabric h200_nvlink, fwd+bwd.
SIM="topology.simulate=true topology.world_size=8 shape.seq_len=131072 $SHAPE"
[ -z "${SKIP_SIM:-}" ] && t sim_ring_window $AG logger=none topology=ring attention=sliding_window attention.window_size=1024 $SIM topology.compare_one_device=false hydra.run.dir=sim_ring_window
[ -z "${SKIP_SIM:-}" ] && t sim_allgather_window $AG logger=none topology=allgather attention=sliding_window attention.window_size=1024 $SIM topology.compare_one_device=false hydra.run.dir=sim_allgather_window
[ -z "${SKIP_SIM:-}" ] && t sim_ring_documents $AG logger=none topology=ring topology.layout=balanced attention=document $SIM hydra.run.dir=sim_ring_documents
[ -z "${SKIP_SHARED:-}" ] && TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 t shared_balancer $AG -m logger=none topology=ring,custom topology.scheme=mycp.my_allgather topology.world_size=2 topology.layout=mybal.by_document_work attention=document shape.seq_len=16384 $SHAPE hydra.sweep.dir=balancer
python3 - $W $OUT <<'PY' | tee -a $OUT/summary.txt
import json, pathlib, sys
w = pathlib.Path(sys.argv[1])
keys = ("topology", "scheme", "layout", "status", "validation", "err_out_rel", "err_dq_rel",
        "err_dk_rel", "fwd_ms", "fwd_bwd_ms", "load_imbalance", "load_time_imbalance",
        "predicted_fwd_bwd_ms", "predicted_efficiency_fwd_bwd", "bottleneck", "bytes_moved",
        "predicted_torch_cp_fwd_bwd_ms", "time_imbalance", "sim_s", "single_fwd_ms",
        "single_fwd_bwd_ms", "efficiency", "efficiency_fwd_bwd")
for m in sorted(w.glob("**/metrics.json")):
    d = json.loads(m.read_text())
    print(m.parent.relative_to(w), {k: d[k] for k in keys if d.get(k) is not None})
PY
tar czf $OUT/runs.tgz -C $W --exclude='*.pt' . 2>/dev/null
