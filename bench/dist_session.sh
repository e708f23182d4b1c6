#!/usr/bin/env bash
# One device call on a 2-GPU machine: bench_dist.py's launches for each model named, 1-GPU
# references first. Usage (repo root): bash bench/dist_session.sh 8b [1b]
# Per model: FSDP2 on 1 GPU (the parity references: exact, fast, and fast again for the noise
# floor; timed at 4 and 8 sequences per GPU), FSDP2 on 2 GPUs (parity; timed at 4 and 8), data
# parallel on 2 GPUs (parity; timed at 4). Logs under $OUT.
# MODE=timing: FSDP2 on 1 and 2 GPUs, no parity, timed with fastaf's launch graphs on and off,
# at BATCHES (default "4 8").
# MODE=scaling: bench_dist_scaling.py, FSDP2 on 1 and on 2 GPUs in one launch, interleaved rounds,
# at BATCHES (default "8").
# Env: LAUNCH_TIMEOUT (s per launch, default 240), EXPANDABLE=1 (expandable segments).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/dist-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-}
# the 8B shape at 8 sequences on one 80 GB GPU fits only without the caching allocator's
# fragments; but measured 2x slower steps with it (dist-nvidia-h100-80gb-hbm3.json): off by default
[ "${EXPANDABLE:-0}" = 1 ] && export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # the machine's rule
nvidia-smi --query-gpu=index,name,clocks.sm,memory.total --format=csv,noheader
nvidia-smi topo -m 2>/dev/null | head -4
launch() {  # launch GPUS LOG ARGS...
  local gpus=$1 log=$2; shift 2
  local visible=0; [ "$gpus" = 2 ] && visible=0,1
  echo "== $log: $*"
  CUDA_VISIBLE_DEVICES=$visible timeout "${LAUNCH_TIMEOUT:-240}" \
    torchrun --standalone --nproc-per-node "$gpus" bench/bench_dist.py "$@" >"$OUT/$log.log" 2>&1
  echo "   rc=$? $(grep -cE 'Warning|warn' "$OUT/$log.log") warning lines"
  grep -E '^parity|^\{' "$OUT/$log.log" | sed 's/^/   /'
}
for model in "$@"; do
  if [ "${MODE:-parity}" = scaling ]; then
    for bs in ${BATCHES:-8}; do
      echo "== $model-scaling-$bs"
      CUDA_VISIBLE_DEVICES=0,1 timeout "${LAUNCH_TIMEOUT:-240}" torchrun --standalone --nproc-per-node 2 \
        bench/bench_dist_scaling.py --model "$model" --batch "$bs" >"$OUT/$model-scaling-$bs.log" 2>&1
      echo "   rc=$?"; grep -E '^round|^\{' "$OUT/$model-scaling-$bs.log" | sed 's/^/   /'
    done
    continue
  fi
  if [ "${MODE:-parity}" = timing ]; then
    for g in 1 2; do
      launch $g "$model-fsdp2-$g-timing" --engine fsdp2 --model "$model" --grad autograd --parity-steps 0 \
        --batch ${BATCHES:-4 8} --launch-graphs on,off
    done
    continue
  fi
  launch 1 "$model-fsdp2-1" --engine fsdp2 --model "$model" --grad autograd --parity exact,fast,fast --batch 4 8
  launch 2 "$model-fsdp2-2" --engine fsdp2 --model "$model" --grad autograd --parity exact,fast --batch 4 8
  launch 2 "$model-ddp-2" --engine ddp --model "$model" --grad func --parity exact --batch 4
done
