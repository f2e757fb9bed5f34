#!/usr/bin/env bash
# Context parallelism on the GPUs of one host against PyTorch's own flex CP (the torch_cp baseline
# of every CP job) and one GPU, as two torchrun sweeps per part. Run from any directory where
# attngym is installed; results land in $STUDY_DIR (default multirun/cp_study).
#
#   bash experiments/multi_gpu_cp/study.sh causal     # causal 32K/128K + sliding_window(1024) 128K
#   bash experiments/multi_gpu_cp/study.sh document   # 8 unequal documents at 128K, ring
#
# Every job: ring, all-gather and Ulysses over the copy engine, B=1, H=8, D=128, bf16, forward and
# forward+backward, validated on 64 sampled rows against the float64 reference, timed with one
# warm-up and five repeats; torch_cp and the one-GPU run measured in the same job.
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
  torchrun --nproc-per-node "$gpus" -m attngym -m "hydra.sweep.dir=$dir/$name" "${common[@]}" "$@" \
    || { echo "sweep $name failed" >&2; status=1; }
}
case $part in
  causal)
    sweep causal attention=causal shape.seq_len=32768,131072 topology=ring,allgather,ulysses \
      topology.layout=zigzag
    sweep window attention=sliding_window ++attention.window_size=1024 shape.seq_len=131072 \
      topology=ring,allgather,ulysses topology.layout=contiguous
    ;;
  document)
    # 8 documents of unequal length (22, 4, 18, 8, 16, 6, 20, 6 % of 128K)
    # What ran: the ring only. The all-gather and Ulysses document jobs were not run.
    docs='++attention.doc_lengths=[28835,5242,23592,10485,20971,7864,26214,7869]'
    sweep document attention=document "$docs" shape.seq_len=131072 topology=ring \
      topology.layout=balanced,zigzag
    ;;
  *)
    echo "unknown part $part; use causal or document" >&2
    exit 2
    ;;
esac
exit $status
