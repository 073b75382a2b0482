#!/usr/bin/env bash
# Weak scaling on one node of 8 GPUs (4 if that is what the node has), one process per GPU:
# Llama-3-8B shapes and the Nemotron-H-8B hybrid, BF16 and FP8 (delayed), as fsdp=N and as
# data=2 x fsdp=N/2, plus the 2-GPU fsdp=2 baseline of each model at the same tokens a GPU;
# then the planner's prediction for the same runs.
# Sequences of 8192 tokens a GPU: llama3-8b 4 (as its 4-GPU runs in docs/PERFORMANCE.md);
# nemotron-h-8b 2, because at 4 XLA asked 152.8 GiB a GPU on 4 H200s (out of memory), when the
# Mamba-2 kernels still ran on the whole global batch on every GPU (docs/PERFORMANCE.md, "Whole
# models, several GPUs"); SEQS_HYBRID=4 checks whether 4 fit now. Override with SEQS_LLAMA
# / SEQS_HYBRID.
# Usage (repo root, wheels for packages the GPU image lacks in .whl/): bash benchmarks/scaling_8gpu.sh
set -uo pipefail
N=${N:-$(nvidia-smi -L | wc -l)}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
# data=2 x fsdp=N/2 of llama3-8b needs more than JAX's default 75% of the GPU's memory to pass the
# trainer's memory preflight (docs/PERFORMANCE.md, "Whole models, several GPUs").
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
. benchmarks/device_env.sh
declare -A SEQS=([llama3-8b]=${SEQS_LLAMA:-4} [nemotron-h-8b]=${SEQS_HYBRID:-2})

run() {  # GPUS MODEL PRECISION MESH...
  local gpus=$1 model=$2 prec=$3; shift 3
  echo "== $model $prec $gpus GPUs $* (${SEQS[$model]} x 8192 tokens a GPU)"
  STEPS=${STEPS:-8} timeout 900 bash benchmarks/per_gpu_processes.sh "$gpus" "configs/$model.yaml" \
    "configs/precision/$prec.yaml" "$@" data.global_batch=$((SEQS[$model] * gpus)) 2>&1 | grep -E "PROCESSES|rror" | tail -2
}

for model in llama3-8b nemotron-h-8b; do
  for prec in bf16 fp8; do
    run 2 "$model" "$prec" mesh.data=1 mesh.fsdp=2
    run "$N" "$model" "$prec" mesh.data=1 mesh.fsdp="$N"
    run "$N" "$model" "$prec" mesh.data=2 mesh.fsdp=$((N / 2))
  done
done
for model in llama3-8b nemotron-h-8b; do
  for mesh in "mesh.data=1 mesh.fsdp=$N" "mesh.data=2 mesh.fsdp=$((N / 2))"; do
    echo "== planner: $model $mesh"
    python3 -m maxfp4.plan "configs/$model.yaml" $mesh data.global_batch=$((SEQS[$model] * N)) --gpus "$N" \
      --gpu h200 --tokens 1e9 | tail -4
  done
done
