#!/usr/bin/env bash
# CP at scale on one H200: the new paths validated with two ranks sharing the GPU, planning a
# user's mask, and topology=auto's picks on the scaling rows (simulated ranks, B=1 H=8 D=128
# bf16). From the repository root:   bash experiments/cp_model/scale.sh OUT [PHASE...]
# PHASE: real plan auto big ring exchange exchange_docs step step_window step_auto graph graph_rows graph_docs graph_kernels step_kernels ring_docs ring_docs_again ring_sums ring_sums_p64 overlap_again
# (default: all; each fits one 10-minute call). T_TIMEOUT bounds one run (default 300 s).
set -u
OUT=${1:?usage: scale.sh OUT [PHASE...]}; shift || true
WHAT=" ${*:-real plan auto big ring exchange exchange_docs step step_window step_auto graph graph_rows graph_docs graph_kernels step_kernels ring_docs ring_docs_again ring_sums ring_sums_p64 overlap_again} "
ROOT=$PWD && mkdir -p "$OUT" && W=$(mktemp -d) && source experiments/gpu_env.sh
export PYTHONPATH=/tmp/site:$PWD ATTNGYM_PROGRESS=0
readme_masks $W
AG="python3 -m attngym logger=none"
SHAPE="shape.batch=1 shape.heads=8 shape.head_dim=128"
GRAPHED="$AG topology.simulate=true topology.cuda_graph=true validate=false baselines=[] $SHAPE benchmark.warmup=1 benchmark.repeats=5"
DOCS_P8="attention=document shape.seq_len=131072 topology.world_size=8 topology.transport=nccl"
has() { [[ $WHAT == *" $1 "* ]]; }
if has real; then  # two ranks on the one GPU: validated fwd+bwd against float64
  export TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1
  t ring_user_32k $AG topology=ring topology.world_size=2 topology.layout=balanced $SHAPE \
    attention=custom attention.mask_mod=mymasks.checkerboard shape.seq_len=32768 hydra.run.dir=ring_user_32k
  t allgather_user_16k $AG topology=allgather topology.world_size=2 $SHAPE \
    attention=custom attention.mask_mod=mymasks.checkerboard shape.seq_len=16384 hydra.run.dir=allgather_user_16k
  t auto_documents_16k $AG topology=auto topology.world_size=2 $SHAPE attention=document \
    shape.seq_len=16384 hydra.run.dir=auto_documents_16k
  t auto_window_16k $AG topology=auto topology.world_size=2 $SHAPE attention=sliding_window \
    shape.seq_len=16384 hydra.run.dir=auto_window_16k
  unset TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES
fi
if has plan; then  # the grid, the placement and every rank's plans for a user's mask, 128K, P=8
  t plan_user_128k python3 -c "
import time, torch, mymasks
from attngym.variants.base import Variant
from attngym.distributed import grid, layout
v = Variant(name='checkerboard', mask_mod=mymasks.checkerboard).to('cuda')
t0 = time.perf_counter(); grid.block_grid(v, 131072, (128, 128), 'cuda'); torch.cuda.synchronize()
t1 = time.perf_counter()
lay = layout.plan('balanced', 8, 131072, v, device='cuda')
t2 = time.perf_counter()
plans = grid.plans_for(v, 131072, (128, 128), 'cuda')
n = 0
for r in range(8):
    for qc in lay.chunks(r):
        for p in range(8):
            for kc in lay.chunks(p):
                plans(1, 8, qc, kc, (128, 128), 'flex', torch.device('cuda')); n += 1
torch.cuda.synchronize(); t3 = time.perf_counter()
print(f'grid {t1-t0:.2f} s, balanced placement {t2-t1:.2f} s, {n} pair plans {t3-t2:.2f} s')"
fi
if has auto; then  # the model's pick on the scaling rows (every candidate in auto.json)
  SIM="$AG topology=auto topology.simulate=true validate=false baselines=[] $SHAPE benchmark.warmup=1 benchmark.repeats=5"
  WIN="attention=sliding_window ++attention.window_size=1024 shape.seq_len=131072"
  t auto_window_p2 $SIM $WIN topology.world_size=2 hydra.run.dir=auto_window_p2
  t auto_window_p8 $SIM $WIN topology.world_size=8 hydra.run.dir=auto_window_p8
fi
if has big; then  # documents at P=8, causal on 64 ranks of 8-GPU nodes
  SIM="$AG topology=auto topology.simulate=true validate=false baselines=[] $SHAPE benchmark.warmup=1 benchmark.repeats=5"
  T_TIMEOUT=420 t auto_documents_p8 $SIM attention=document shape.seq_len=131072 \
    topology.world_size=8 hydra.run.dir=auto_documents_p8
  t auto_causal_128k_p64 $SIM attention=causal shape.seq_len=131072 topology.world_size=64 \
    topology.fabric=hgx_h200 'topology.options.candidates=[ring,allgather,hybrid]' \
    'topology.options.layouts=[zigzag]' hydra.run.dir=auto_causal_128k_p64
  T_TIMEOUT=480 t auto_causal_1m_p64 $SIM attention=causal shape.seq_len=1048576 \
    topology.world_size=64 topology.fabric=hgx_h200 topology.compare_one_device=false \
    'topology.options.candidates=[ring,hybrid]' 'topology.options.layouts=[zigzag]' \
    benchmark.repeats=2 hydra.run.dir=auto_causal_1m_p64
fi
if has ring; then  # the ring's one call per step (zigzag, balanced): validated, then its rows again
  TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 t ring_zigzag_documents_16k $AG topology=ring \
    topology.layout=zigzag topology.world_size=2 $SHAPE attention=document shape.seq_len=16384 \
    hydra.run.dir=ring_zigzag_documents_16k
  t step_times_ring_zigzag_window python3 "$ROOT/experiments/cp_model/step_times.py" \
    --kind ring --layout zigzag --world-size 8 --variant sliding_window
  SIM="$AG topology=ring topology.layout=zigzag topology.simulate=true validate=false baselines=[] $SHAPE"
  t ring_causal_128k_p64 $SIM attention=causal shape.seq_len=131072 topology.world_size=64 \
    topology.fabric=hgx_h200 hydra.run.dir=ring_causal_128k_p64
  t ring_documents_p8 $SIM attention=document shape.seq_len=131072 topology.world_size=8 \
    topology.layout=balanced hydra.run.dir=ring_documents_p8
fi
if has exchange; then  # the all-gather's exact exchange: the transport, then validated runs
  export TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1
  t exchange_transport python3 -m pytest -q -p no:cacheprovider -k exchange \
    "$ROOT/tests/distributed/test_copy_engine_gpu.py"
  t allgather_window_16k $AG topology=allgather topology.world_size=2 $SHAPE \
    attention=sliding_window ++attention.window_size=1024 shape.seq_len=16384 \
    hydra.run.dir=allgather_window_16k
  t allgather_documents_16k $AG topology=allgather topology.world_size=2 topology.layout=balanced \
    $SHAPE attention=document shape.seq_len=16384 hydra.run.dir=allgather_documents_16k
  t allgather_user_16k_exchange $AG topology=allgather topology.world_size=2 $SHAPE \
    attention=custom attention.mask_mod=mymasks.checkerboard shape.seq_len=16384 \
    hydra.run.dir=allgather_user_16k_exchange
  unset TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES
  SIM="$AG topology=auto topology.simulate=true validate=false baselines=[] $SHAPE benchmark.warmup=1 benchmark.repeats=5"
  WIN="attention=sliding_window ++attention.window_size=1024 shape.seq_len=131072"
  t exchange_window_p2 $SIM $WIN topology.world_size=2 hydra.run.dir=exchange_window_p2
  t exchange_window_p8 $SIM $WIN topology.world_size=8 hydra.run.dir=exchange_window_p8
fi
if has exchange_docs; then  # documents at P=8 with the exchange (every candidate in auto.json)
  SIM="$AG topology=auto topology.simulate=true validate=false baselines=[] $SHAPE benchmark.warmup=1 benchmark.repeats=5"
  T_TIMEOUT=540 t exchange_documents_p8 $SIM attention=document shape.seq_len=131072 \
    topology.world_size=8 hydra.run.dir=exchange_documents_p8
fi
if has step; then  # the ring's one call per step and the all-gather's overlap: exact, then rows
  export TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1
  T_TIMEOUT=240 t step_gpu_tests python3 -m pytest -q -p no:cacheprovider -m "gpu or multigpu" \
    -k "cp_on_cuda or second_call or exchange or backward_op" \
    "$ROOT/tests/distributed/test_cp_gpu.py" "$ROOT/tests/distributed/test_copy_engine_gpu.py"
  t step_ring_zigzag_documents_16k $AG topology=ring topology.layout=zigzag topology.world_size=2 \
    $SHAPE attention=document shape.seq_len=16384 hydra.run.dir=step_ring_zigzag_documents_16k
  t step_allgather_documents_16k $AG topology=allgather topology.layout=balanced \
    topology.world_size=2 topology.options.overlap=true $SHAPE attention=document \
    shape.seq_len=16384 hydra.run.dir=step_allgather_documents_16k
  unset TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES
  SIM="$AG topology.simulate=true topology.transport=nccl validate=false baselines=[] $SHAPE benchmark.warmup=1 benchmark.repeats=5"
  t step_ring_causal_128k_p64 $SIM topology=ring topology.layout=zigzag attention=causal \
    shape.seq_len=131072 topology.world_size=64 topology.fabric=hgx_h200 \
    hydra.run.dir=step_ring_causal_128k_p64
  for row in "ring balanced" "allgather balanced"; do set -- $row
    t step_${1}_documents_p8 $SIM topology=$1 topology.layout=$2 attention=document \
      shape.seq_len=131072 topology.world_size=8 hydra.run.dir=step_${1}_documents_p8
  done
fi
if has step_window; then  # the window at P=8 with this code (simulated ranks)
  SIM="$AG topology.simulate=true topology.transport=nccl validate=false baselines=[] $SHAPE benchmark.warmup=1 benchmark.repeats=5"
  WIN="attention=sliding_window ++attention.window_size=1024 shape.seq_len=131072"
  for row in "ring zigzag" "allgather contiguous"; do set -- $row
    T_TIMEOUT=110 t step_${1}_window_p8 $SIM topology=$1 topology.layout=$2 $WIN topology.world_size=8 \
      hydra.run.dir=step_${1}_window_p8
  done
fi
if has step_auto; then  # topology=auto on the window and documents rows, P=8, with this code
  SIM="$AG topology=auto topology.simulate=true validate=false baselines=[] $SHAPE benchmark.warmup=1 benchmark.repeats=5"
  t step_auto_window_p8 $SIM attention=sliding_window ++attention.window_size=1024 \
    shape.seq_len=131072 topology.world_size=8 hydra.run.dir=step_auto_window_p8
  T_TIMEOUT=420 t step_auto_documents_p8 $SIM attention=document shape.seq_len=131072 \
    topology.world_size=8 hydra.run.dir=step_auto_documents_p8
fi
if has graph; then  # topology.cuda_graph: the captured calls exact, then the host-bound rows
  export TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1
  T_TIMEOUT=240 t graph_gpu_tests python3 -m pytest -q -p no:cacheprovider -m "gpu or multigpu" \
    -k "replay or alltoall or cuda_graphs" "$ROOT/tests/distributed/test_cp_gpu.py" \
    "$ROOT/tests/distributed/test_copy_engine_gpu.py" "$ROOT/tests/distributed/test_cp_task.py"
  unset TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES
  SIM="$AG topology.simulate=true topology.transport=nccl topology.cuda_graph=true validate=false baselines=[] $SHAPE benchmark.warmup=1 benchmark.repeats=5"
  T_TIMEOUT=110 t graph_allgather_window_p8 $SIM topology=allgather topology.layout=contiguous \
    attention=sliding_window ++attention.window_size=1024 shape.seq_len=131072 \
    topology.world_size=8 hydra.run.dir=graph_allgather_window_p8
  T_TIMEOUT=150 t graph_ring_causal_128k_p64 $SIM topology=ring topology.layout=zigzag \
    attention=causal shape.seq_len=131072 topology.world_size=64 topology.fabric=hgx_h200 \
    hydra.run.dir=graph_ring_causal_128k_p64
  T_TIMEOUT=150 t graph_ring_documents_p8 $SIM topology=ring topology.layout=balanced \
    attention=document shape.seq_len=131072 topology.world_size=8 \
    hydra.run.dir=graph_ring_documents_p8
fi
if has graph_rows; then  # with graphs: the received rows' call over its reading rows; auto's picks
  WIN="attention=sliding_window ++attention.window_size=1024 shape.seq_len=131072 topology.world_size=8"
  T_TIMEOUT=100 t graph_rows_window_p8 $GRAPHED topology=allgather topology.layout=contiguous \
    topology.transport=nccl topology.options.overlap=true $WIN hydra.run.dir=graph_rows_window_p8
  T_TIMEOUT=200 t graph_auto_window_p8 $GRAPHED topology=auto $WIN hydra.run.dir=graph_auto_window_p8
  T_TIMEOUT=280 t graph_auto_documents_p8 $GRAPHED topology=auto attention=document \
    shape.seq_len=131072 topology.world_size=8 hydra.run.dir=graph_auto_documents_p8
fi
if has graph_docs; then  # with graphs: documents P=8 on Ulysses and the overlapped all-gather
  T_TIMEOUT=150 t graph_ulysses_documents_p8 $GRAPHED topology=ulysses topology.layout=contiguous \
    $DOCS_P8 hydra.run.dir=graph_ulysses_documents_p8
  T_TIMEOUT=180 t graph_allgather_documents_p8 $GRAPHED topology=allgather topology.layout=balanced \
    topology.options.overlap=true $DOCS_P8 hydra.run.dir=graph_allgather_documents_p8
fi
if has graph_kernels; then  # with graphs: the documents ring with half-height forward tiles
  T_TIMEOUT=120 t graph_ring_documents_p8_m64 $GRAPHED topology=ring topology.layout=balanced \
    +kernel_options.fwd_BLOCK_M=64 $DOCS_P8 hydra.run.dir=graph_ring_documents_p8_m64
  t step_times_ring_balanced_documents python3 "$ROOT/experiments/cp_model/step_times.py" \
    --kind ring --layout balanced --world-size 8 --variant document
fi
if has step_kernels; then  # the documents ring's step calls, kernel by kernel
  t step_kernels_ring_balanced_documents python3 "$ROOT/experiments/cp_model/step_times.py" \
    --kind ring --layout balanced --world-size 8 --variant document --kernels
fi
if has ring_docs; then  # the ring's placement per step call, its backward's order, fused sums
  t grad_sums python3 "$ROOT/experiments/cp_model/grad_sums.py"
  TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 T_TIMEOUT=200 t ring_docs_gpu_tests python3 -m \
    pytest -q -p no:cacheprovider -m "gpu or multigpu" -k "cp_on_cuda and ring" \
    "$ROOT/tests/distributed/test_cp_gpu.py"
  TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 t ring_balanced_documents_16k $AG topology=ring \
    topology.layout=balanced topology.world_size=2 $SHAPE attention=document \
    shape.seq_len=16384 hydra.run.dir=ring_balanced_documents_16k
  T_TIMEOUT=150 t ring_docs_graph_p8 $GRAPHED topology=ring topology.layout=balanced $DOCS_P8 \
    hydra.run.dir=ring_docs_graph_p8
  t ring_docs_step_times python3 "$ROOT/experiments/cp_model/step_times.py" \
    --kind ring --layout balanced --world-size 8 --variant document
fi
if has ring_docs_again; then  # the same row with every sum of the ring's steps priced
  TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 T_TIMEOUT=200 t ring_docs_gpu_tests python3 -m \
    pytest -q -p no:cacheprovider -m "gpu or multigpu" -k "cp_on_cuda and ring" \
    "$ROOT/tests/distributed/test_cp_gpu.py"
  T_TIMEOUT=150 t ring_docs_graph_p8 $GRAPHED topology=ring topology.layout=balanced $DOCS_P8 \
    hydra.run.dir=ring_docs_graph_p8
  t ring_docs_step_times python3 "$ROOT/experiments/cp_model/step_times.py" \
    --kind ring --layout balanced --world-size 8 --variant document
  for kind in ring allgather; do  # world size 1 beside the one-device call, validated
    T_TIMEOUT=120 t ws1_${kind}_documents_64k $AG topology=$kind topology.world_size=1 $SHAPE \
      attention=document shape.seq_len=65536 hydra.run.dir=ws1_${kind}_documents_64k
  done
fi
if has ring_sums; then  # the steps' partials and dq pieces held and added in one pass (cp.HELD)
  t grad_sums python3 "$ROOT/experiments/cp_model/grad_sums.py"
  TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 T_TIMEOUT=200 t ring_sums_gpu_tests python3 -m \
    pytest -q -p no:cacheprovider -m "gpu or multigpu" -k "(cp_on_cuda and ring) or compiled_sums" \
    "$ROOT/tests/distributed/test_cp_gpu.py"
  T_TIMEOUT=150 t ring_sums_graph_p8 $GRAPHED topology=ring topology.layout=balanced $DOCS_P8 \
    hydra.run.dir=ring_sums_graph_p8
  for kind in ring allgather; do  # world size 1 beside the one-device call, validated
    T_TIMEOUT=120 t sums_ws1_${kind}_documents_64k $AG topology=$kind topology.world_size=1 \
      $SHAPE attention=document shape.seq_len=65536 hydra.run.dir=sums_ws1_${kind}_documents_64k
  done
  T_TIMEOUT=180 t sums_allgather_graph_p8 $GRAPHED topology=allgather topology.layout=balanced \
    topology.options.overlap=true $DOCS_P8 hydra.run.dir=sums_allgather_graph_p8
  t ring_sums_step_times python3 "$ROOT/experiments/cp_model/step_times.py" \
    --kind ring --layout balanced --world-size 8 --variant document
fi
if has ring_sums_p64; then  # the same at 64 steps: the sums added up every HELD pieces
  T_TIMEOUT=150 t sums_graph_ring_causal_128k_p64 $GRAPHED topology=ring topology.layout=zigzag \
    topology.transport=nccl attention=causal shape.seq_len=131072 topology.world_size=64 \
    topology.fabric=hgx_h200 hydra.run.dir=sums_graph_ring_causal_128k_p64
fi
if has overlap_again; then  # the overlapped all-gather, fixed: reference, runs, P=8 re-timed
  TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 T_TIMEOUT=200 t overlap_gpu_tests python3 -m \
    pytest -q -p no:cacheprovider -m "gpu or multigpu" -k "overlapped_allgather or compiled_sums" \
    "$ROOT/tests/distributed/test_cp_gpu.py"
  TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 T_TIMEOUT=120 t overlap_allgather_documents_16k $AG \
    topology=allgather topology.layout=balanced topology.world_size=2 topology.options.overlap=true \
    $SHAPE attention=document shape.seq_len=16384 hydra.run.dir=overlap_allgather_documents_16k
  TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 T_TIMEOUT=200 t overlap_auto_documents_16k $AG \
    topology=auto topology.world_size=2 $SHAPE attention=document shape.seq_len=16384 \
    hydra.run.dir=overlap_auto_documents_16k
  T_TIMEOUT=180 t overlap_allgather_graph_p8 $GRAPHED topology=allgather topology.layout=balanced \
    topology.options.overlap=true $DOCS_P8 hydra.run.dir=overlap_allgather_graph_p8
fi
for d in "$W"/*/; do  # metrics and auto.json of every run
  [ -f "$d/metrics.json" ] && cp "$d/metrics.json" "$OUT/$(basename $d).metrics.json"
  [ -f "$d/auto.json" ] && cp "$d/auto.json" "$OUT/$(basename $d).auto.json"
done
cat "$OUT/summary.txt"
tar -C "$OUT" -czf /tmp/scale.tgz . && rm -rf "$OUT"/* && mv /tmp/scale.tgz "$OUT/"
