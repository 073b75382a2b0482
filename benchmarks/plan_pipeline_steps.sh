#!/usr/bin/env bash
# The planner's pipeline model against measured steps: dense-1p3b on two GPUs at fsdp=2 and at
# pipeline=2 with 2 to 16 microbatches (REPEATS=1 adds mesh.pipeline_repeats=2), one process a
# GPU, each measured step beside the planner's for the same config and overrides.
# Usage: bash benchmarks/plan_pipeline_steps.sh        (GPU=h100 on H100s, default h200; SEQ tokens, default 2048)
set -euo pipefail
GPU=${GPU:-h200}
BASE=(configs/dense-1p3b.yaml configs/precision/bf16.yaml data.seq_len=${SEQ:-2048}
      train.remat=full mesh.data=1 data.global_batch=16 resilience.preflight=false)
MESHES=("mesh.fsdp=2" "mesh.pipeline=2 train.microbatches=2" "mesh.pipeline=2 train.microbatches=4"
        "mesh.pipeline=2 train.microbatches=8" "mesh.pipeline=2 train.microbatches=16")
[ -z "${REPEATS:-}" ] || MESHES+=("mesh.pipeline=2 mesh.pipeline_repeats=2 train.microbatches=8")
for MESH in "${MESHES[@]}"; do
  echo "== $MESH"
  # shellcheck disable=SC2086  # MESH is several key=value words
  STEPS=8 bash benchmarks/per_gpu_processes.sh 2 "${BASE[@]}" $MESH | tail -2
  # shellcheck disable=SC2086
  python3 -m maxfp4.plan "${BASE[@]}" $MESH --gpus 2 --gpu "$GPU" --tokens 1e9 --json | python3 -c '
import json, sys
r = json.load(sys.stdin)[0]
ms, bubble = r["step_time_s"] * 1e3, r["pipeline_bubble"]
print(f"planner: {ms:.1f} ms a step, bubble {bubble:.1%}")'
done
