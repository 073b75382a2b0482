#!/usr/bin/env bash
# One device-machine call: GPU tests, the quickstart, and dense-1p3b on synthetic data.
# Usage (repo root, wheels for packages the GPU image lacks in .whl/):
#   bash benchmarks/gpu_smoke.sh [OUT_DIR]
set -uo pipefail
OUT_DIR=${1:-${OUT:-/tmp/maxfp4-gpu}}
mkdir -p "$OUT_DIR"
. benchmarks/device_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT_DIR/device.txt"
python3 -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())"
python3 -m pytest -q -m gpu tests/test_gpu_attention.py 2>&1 | tail -15 | tee "$OUT_DIR/gpu_tests.txt"
( time python3 -m maxfp4.train configs/quickstart.yaml run.output_dir=/tmp/runs ) 2>&1 | tail -12 | tee "$OUT_DIR/quickstart.txt"
python3 -m maxfp4.train configs/dense-1p3b.yaml run.output_dir=/tmp/runs data.source=synthetic \
  train.steps=${STEPS:-40} train.log_every=10 ${EXTRA:-} 2>&1 | tail -12 | tee "$OUT_DIR/dense1p3b.txt"
cp /tmp/runs/dense-1p3b/metrics.jsonl "$OUT_DIR/dense1p3b_metrics.jsonl" 2>/dev/null || true
