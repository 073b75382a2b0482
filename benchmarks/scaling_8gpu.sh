#!/usr/bin/env bash
# Weak scaling on one node of 8 GPUs (4 if that is what the node has), one process per GPU:
# Llama-3-8B shapes and the Nemotron-H-8B hybrid, BF16 and FP8 (delayed), as fsdp=N and as
# data=2 x fsdp=N/2, each GPU holding the same 4 sequences as in the 2-GPU runs of
# docs/PERFORMANCE.md; then the planner's prediction for the same runs.
# Usage (repo root, wheels for packages the GPU image lacks in .whl/): bash benchmarks/scaling_8gpu.sh
set -uo pipefail
N=${N:-$(nvidia-smi -L | wc -l)}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
# data=2 x fsdp=N/2 of llama3-8b needs more than JAX's default 75% of the GPU's memory to pass the
# trainer's memory preflight (docs/PERFORMANCE.md, four GPUs).
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
. benchmarks/device_env.sh
BATCH=$((4 * N))
for model in llama3-8b nemotron-h-8b; do
  for prec in bf16 fp8; do
    for mesh in "mesh.data=1 mesh.fsdp=$N" "mesh.data=2 mesh.fsdp=$((N / 2))"; do
      echo "== $model $prec $mesh"
      STEPS=${STEPS:-8} timeout 900 bash benchmarks/per_gpu_processes.sh "$N" "configs/$model.yaml" \
        "configs/precision/$prec.yaml" $mesh data.global_batch=$BATCH 2>&1 | grep -E "PROCESSES|rror" | tail -2
    done
  done
done
for model in llama3-8b nemotron-h-8b; do
  for mesh in "mesh.data=1 mesh.fsdp=$N" "mesh.data=2 mesh.fsdp=$((N / 2))"; do
    echo "== planner: $model $mesh"
    python3 -m maxfp4.plan "configs/$model.yaml" $mesh data.global_batch=$BATCH --gpus "$N" --gpu h200 \
      --tokens 1e9 | tail -4
  done
done
