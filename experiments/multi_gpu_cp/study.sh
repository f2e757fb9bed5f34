#!/usr/bin/env bash
# Context parallelism on the GPUs of one host against PyTorch's own flex CP (the torch_cp baseline
# of every CP job) and one GPU, as torchrun sweeps. Run from any directory where attngym is
# installed; results land in $STUDY_DIR (default multirun/cp_study).
#
#   bash experiments/multi_gpu_cp/study.sh causal     # causal + sliding_window(1024), 32K and 128K
#   bash experiments/multi_gpu_cp/study.sh document   # 8 unequal documents, 32K and 128K
#
# Every job: ring, all-gather and Ulysses over the copy engine (documents: ring and all-gather
# with the balanced and zigzag layouts, Ulysses with zigzag, as it takes no balanced layout),
# B=1, H=8, D=128, bf16, forward and forward+backward, validated on 64 sampled rows against the
# float64 reference, timed with one warm-up and five repeats; torch_cp and the one-GPU run
# measured in the same job.
#
# PREDICT=1 predicts the same jobs before they run: each is simulated on this one GPU at
# PREDICT_P ranks (default 2; topology.simulate=true, no validation, no baselines), into
# $STUDY_DIR/predicted/<sweep>. Keep those summaries; once the measured ones exist,
#   python scripts/check_cp_model.py MEASURED_CSV_FOLDER --predicted $STUDY_DIR/predicted
# compares them without simulating again.
set -euo pipefail
part=${1:?causal or document}
dir=${STUDY_DIR:-multirun/cp_study}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
common=(+experiment=ring_attention shape.batch=1 shape.heads=8 shape.head_dim=128
  topology.transport=copy_engine validate_rows=64 benchmark.warmup=1 benchmark.repeats=5
  logger=none)
status=0
sweep() {  # name, overrides...; a failed sweep is reported and the next one still runs
  local name=$1
  shift
  if [ "${PREDICT:-0}" = 1 ]; then
    python3 -m attngym -m "hydra.sweep.dir=$dir/predicted/$name" "${common[@]}" "$@" \
      topology.simulate=true "topology.world_size=${PREDICT_P:-2}" validate=false 'baselines=[]' \
      || { echo "sweep $name failed" >&2; status=1; }
    return
  fi
  torchrun --nproc-per-node "$gpus" -m attngym -m "hydra.sweep.dir=$dir/$name" "${common[@]}" "$@" \
    || { echo "sweep $name failed" >&2; status=1; }
}
case $part in
  causal)
    sweep causal attention=causal shape.seq_len=32768,131072 topology=ring,allgather,ulysses \
      topology.layout=zigzag
    sweep window attention=sliding_window ++attention.window_size=1024 \
      shape.seq_len=32768,131072 topology=ring,allgather,ulysses topology.layout=contiguous
    ;;
  document)
    # 8 documents of unequal length (22, 4, 18, 8, 16, 6, 20, 6 % of S)
    for n in 32768 131072; do
      if [ "$n" = 32768 ]; then
        docs='++attention.doc_lengths=[7209,1311,5898,2621,5243,1966,6554,1966]'
      else
        docs='++attention.doc_lengths=[28835,5242,23592,10485,20971,7864,26214,7869]'
      fi
      sweep "document_$n" attention=document "$docs" shape.seq_len=$n \
        topology=ring,allgather topology.layout=balanced,zigzag
      sweep "document_ulysses_$n" attention=document "$docs" shape.seq_len=$n \
        topology=ulysses topology.layout=zigzag
    done
    ;;
  *)
    echo "unknown part $part; use causal or document" >&2
    exit 2
    ;;
esac
exit $status
