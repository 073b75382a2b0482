#!/usr/bin/env bash
# Weak scaling on one node of 8 GPUs (4 if that is what the node has), one process per GPU:
# Llama-3-8B and the whole Nemotron-H-8B hybrid, BF16 and FP8 (delayed), as fsdp=N,
# data=2 x fsdp=N/2 and tensor=2 x fsdp=N/2, plus the 2-GPU fsdp=2 baseline of each model at the same tokens a GPU;
# then the planner's prediction for the same runs.
# Tokens a GPU, as docs/PERFORMANCE.md's several-GPU table ran them: llama3-8b 2 x 8192 with
# train.remat=save_gemm (~107 GiB a GPU at fsdp=2: an H200 setting; on 80 GB cards use
# SEQS_LLAMA=1 LLAMA_REMAT=full), nemotron-h-8b 1 x 8192 with full remat (its config's).
# Usage (repo root, wheels for packages the GPU image lacks in .whl/): bash benchmarks/scaling_8gpu.sh
set -uo pipefail
N=${N:-$(nvidia-smi -L | wc -l)}
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -q H200 && echo h200 || echo h100)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
. benchmarks/device_env.sh
declare -A SEQS=([llama3-8b]=${SEQS_LLAMA:-2} [nemotron-h-8b]=${SEQS_HYBRID:-1})
declare -A REMAT=([llama3-8b]=${LLAMA_REMAT:-save_gemm} [nemotron-h-8b]=${HYBRID_REMAT:-full})

run() {  # GPUS MODEL PRECISION MESH...
  local gpus=$1 model=$2 prec=$3; shift 3
  echo "== $model $prec $gpus GPUs $* (${SEQS[$model]} x 8192 tokens a GPU, remat ${REMAT[$model]})"
  STEPS=${STEPS:-7} timeout 900 bash benchmarks/per_gpu_processes.sh "$gpus" "configs/$model.yaml" \
    "configs/precision/$prec.yaml" "$@" data.global_batch=$((SEQS[$model] * gpus)) train.remat="${REMAT[$model]}" \
    resilience.preflight=false 2>&1 | grep -E "PROCESSES|rror" | tail -2
}

for model in llama3-8b nemotron-h-8b; do
  for prec in bf16 fp8; do
    run 2 "$model" "$prec" mesh.data=1 mesh.fsdp=2
    run "$N" "$model" "$prec" mesh.data=1 mesh.fsdp="$N"
    run "$N" "$model" "$prec" mesh.data=2 mesh.fsdp=$((N / 2))
    run "$N" "$model" "$prec" mesh.data=1 mesh.fsdp=$((N / 2)) mesh.tensor=2
  done
done
for model in llama3-8b nemotron-h-8b; do
  for mesh in "mesh.data=1 mesh.fsdp=$N" "mesh.data=2 mesh.fsdp=$((N / 2))" "mesh.fsdp=$((N / 2)) mesh.tensor=2"; do
    echo "== planner: $model $mesh"
    python3 -m maxfp4.plan "configs/$model.yaml" $mesh data.global_batch=$((SEQS[$model] * N)) \
      train.remat="${REMAT[$model]}" --gpus "$N" --gpu "$GPU" --tokens 1e9 | tail -4
  done
done
