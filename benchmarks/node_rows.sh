#!/usr/bin/env bash
# The several-GPU rows of one node for docs/PERFORMANCE.md (the 8B models' pipeline stages,
# context splits and tensor layouts) and docs/MOE.md (moe-1b-active on two GPUs), one process a
# GPU (benchmarks/per_gpu_processes.sh), each run under its own time limit, then one line a run:
# step ms, tokens/s per GPU, MFU, and the planner's step for the same arguments (python -m maxfp4.plan).
# Usage: bash benchmarks/node_rows.sh [pipeline|context|tensor|moe|all] [precision ...]   (default: all bf16 fp8)
# tensor: Llama-3-8B at tensor=2 x fsdp=GPUS/2 without and with mesh.sequence_parallel, and with
# it plus XLA's windowed einsum (the GEMMs overlapping the tensor axis's collectives).
# moe: moe-1b-active on two GPUs at fsdp=2, expert=2, tensor=2 (the tokens split) and tensor=2
# with expert tensor parallelism.
# Environment: TIMEOUT (seconds a run, default 300), STEPS (6), GPUS (4; the context rows of two
# GPUs run on the first two), GPU_KIND (the planner's GPU, h200).
set -uo pipefail
WHICH=${1:-all}
[ $# -eq 0 ] || shift
if [ $# -gt 0 ]; then PRECISIONS=("$@"); else PRECISIONS=(bf16 fp8); fi
GPUS=${GPUS:-4}
export NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
BATCH="mesh.data=1 data.global_batch=8 resilience.preflight=false"
rows=()  # "label|processes|precision|arguments[|environment]"
for P in "${PRECISIONS[@]}"; do
  R="configs/precision/$P.yaml"
  if [ "$WHICH" = pipeline ] || [ "$WHICH" = all ]; then
    rows+=("llama3-8b $P pipeline=2 x fsdp=2, 4 microbatches, save_gemm|4|$P|configs/llama3-8b.yaml $R $BATCH mesh.pipeline=2 mesh.fsdp=2 train.microbatches=4 train.remat=save_gemm")
    rows+=("llama3-8b $P pipeline=4, 8 microbatches, full|4|$P|configs/llama3-8b.yaml $R $BATCH mesh.pipeline=4 mesh.fsdp=1 train.microbatches=8 train.remat=full")
    rows+=("nemotron-h-8b $P pipeline=2 x fsdp=2, 4 microbatches, full|4|$P|configs/nemotron-h-8b.yaml $R $BATCH mesh.pipeline=2 mesh.fsdp=2 train.microbatches=4 train.remat=full")
    rows+=("nemotron-h-8b $P pipeline=4, 8 microbatches, full|4|$P|configs/nemotron-h-8b.yaml $R $BATCH mesh.pipeline=4 mesh.fsdp=1 train.microbatches=8 train.remat=full")
  fi
  if [ "$WHICH" = tensor ] || [ "$WHICH" = all ]; then
    T="configs/llama3-8b.yaml $R mesh.data=1 data.global_batch=$((2 * GPUS)) resilience.preflight=false mesh.tensor=2 mesh.fsdp=$((GPUS / 2)) train.remat=save_gemm"
    WINDOWED="XLA_FLAGS=--xla_gpu_multi_streamed_windowed_einsum=true --xla_gpu_threshold_for_windowed_einsum_mib=0"
    rows+=("llama3-8b $P tensor=2 x fsdp=$((GPUS / 2))|$GPUS|$P|$T")
    rows+=("llama3-8b $P tensor=2 x fsdp=$((GPUS / 2)), sequence parallel|$GPUS|$P|$T mesh.sequence_parallel=true")
    rows+=("llama3-8b $P tensor=2 x fsdp=$((GPUS / 2)), sequence parallel, windowed einsum|$GPUS|$P|$T mesh.sequence_parallel=true|$WINDOWED")
  fi
  if [ "$WHICH" = moe ] || [ "$WHICH" = all ]; then
    E="configs/moe-1b-active.yaml $R mesh.data=1 data.global_batch=16 resilience.preflight=false"
    rows+=("moe-1b-active $P fsdp=2|2|$P|$E mesh.fsdp=2")
    rows+=("moe-1b-active $P expert=2|2|$P|$E mesh.expert=2")
    rows+=("moe-1b-active $P tensor=2, tokens split|2|$P|$E mesh.tensor=2 mesh.sequence_parallel=true")
    rows+=("moe-1b-active $P tensor=2, expert tensor parallel|2|$P|$E mesh.tensor=2 mesh.sequence_parallel=true model.moe.expert_tensor_parallel=true")
  fi
  if [ "$WHICH" = context ] || [ "$WHICH" = all ]; then
    for M in llama3-8b nemotron-h-8b; do
      rows+=("$M $P 32,768 tokens, context=2|2|$P|configs/$M-64k.yaml $R data.seq_len=32768 mesh.context=2 resilience.preflight=false")
      rows+=("$M $P 65,536 tokens, context=4|4|$P|configs/$M-64k.yaml $R resilience.preflight=false")
    done
  fi
done
results=()
for row in "${rows[@]}"; do
  IFS='|' read -r label nproc precision args environment <<< "$row"
  if [ "$nproc" -gt "$GPUS" ]; then results+=("$label: skipped ($nproc GPUs)"); continue; fi
  out=$(mktemp -d)
  echo "== $label" >&2
  # shellcheck disable=SC2086  # args is several words
  line=$(env ${environment:+"$environment"} OUT_DIR=$out STEPS=${STEPS:-6} timeout -k 10 "${TIMEOUT:-300}" \
         bash benchmarks/per_gpu_processes.sh "$nproc" $args 2>&1 | grep PROCESSES)
  pkill -9 -f "run.output_dir=$out " 2>/dev/null  # the trainer stops at a step on SIGTERM; this one may be compiling
  # shellcheck disable=SC2086
  planner=$(python3 -m maxfp4.plan $args --gpus "$nproc" --gpu "${GPU_KIND:-h200}" --tokens 1e9 --json 2>/dev/null |
            python3 -c 'import json, sys
rows = [r for r in json.load(sys.stdin) if r["precision"] == sys.argv[1]]
print("planner %.0f ms" % (rows[0]["step_time_s"] * 1e3) if rows else "planner -")' "$precision")
  if [ -n "$line" ]; then
    results+=("$label: $line; $planner")
  else
    results+=("$label: no result ($(grep -m1 -ohE 'RESOURCE_EXHAUSTED[^.]*|error: .*' "$out"/log0.txt 2>/dev/null || echo "over ${TIMEOUT:-300} s")); $planner")
  fi
done
printf '%s\n' "${results[@]}"
