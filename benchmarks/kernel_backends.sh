#!/usr/bin/env bash
# The Mamba-2 kernels on each Pallas backend (one GPU): the
# GPU tests of the Mosaic GPU kernels, the SSD alone at mamba2-1p3b's shapes (Triton kernels /
# Mosaic forward / Mosaic forward and backward: benchmarks/ssd_layer.py), the convolution's
# kernels and the gated norm's on Triton and Mosaic GPU (benchmarks/conv_layer.py,
# benchmarks/norm_layer.py), and whole mamba2-1p3b steps with
# model.mamba.kernel_backend triton / auto / mosaic in BF16 and FP8 (benchmarks/train_throughput.py).
# PARTS=cold: the first step of mamba2-1p3b with kernel_backend auto and triton in each of
# PRECISIONS, each run with every compilation cache empty (train_throughput.py --cold), before any
# other part (one precision a call: ~2.5 min a run), e.g. PARTS=cold PRECISIONS=fp8.
# Writes tests.txt, ssd_layer.txt, conv_layer.txt, norm_layer.txt, steps_PRECISIONS.txt and
# cold_PRECISIONS.txt to OUT_DIR.
#   bash benchmarks/kernel_backends.sh [OUT_DIR]
# All of it runs past one call's 10 minutes: PARTS picks (default "kernels steps"), PRECISIONS the
# steps' presets (default "bf16 fp8"), e.g. PARTS="kernels steps" PRECISIONS=bf16, then
# PARTS=steps PRECISIONS=fp8 in a second call (~5 min each).
set -uo pipefail
OUT_DIR=${1:-${OUT:-/tmp/maxfp4-backends}}
PARTS=${PARTS:-kernels steps}
PRECISIONS=${PRECISIONS:-bf16 fp8}
mkdir -p "$OUT_DIR"
. benchmarks/device_env.sh
if [[ " $PARTS " == *" cold "* ]]; then
  runs=()
  for precision in $PRECISIONS; do
    for backend in auto triton; do
      runs+=(--run "$precision $backend=configs/mamba2-1p3b.yaml configs/precision/$precision.yaml model.mamba.kernel_backend=$backend")
    done
  done
  timeout 560 python3 benchmarks/train_throughput.py --cold --steps 3 --warmup 1 "${runs[@]}" > "$OUT_DIR/cold_${PRECISIONS// /_}.txt" 2>&1
  grep -v '^\s*$' "$OUT_DIR/cold_${PRECISIONS// /_}.txt" | tail -5
fi
if [[ " $PARTS " == *" kernels "* ]]; then
  # at most 560 s together, under one call's 600
  timeout 210 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_mamba_kernels.py -k mosaic \
    > "$OUT_DIR/tests.txt" 2>&1
  tail -3 "$OUT_DIR/tests.txt"
  timeout 120 python3 benchmarks/conv_layer.py --kernels --json "$OUT_DIR/conv_layer.json" > "$OUT_DIR/conv_layer.txt" 2>&1
  cat "$OUT_DIR/conv_layer.txt"
  timeout 130 python3 benchmarks/norm_layer.py --kernels --json "$OUT_DIR/norm_layer.json" > "$OUT_DIR/norm_layer.txt" 2>&1
  cat "$OUT_DIR/norm_layer.txt"
  tiling=pallas:bf16:128:8:16:1
  timeout 100 python3 benchmarks/ssd_layer.py --iters 20 --json "$OUT_DIR/ssd_layer.json" \
    --variants "$tiling,$tiling:mosaic,$tiling:mosaic:mosaic" > "$OUT_DIR/ssd_layer.txt" 2>&1
  cat "$OUT_DIR/ssd_layer.txt"
fi
if [[ " $PARTS " == *" steps "* ]]; then
  runs=()
  for precision in $PRECISIONS; do
    for backend in triton auto mosaic; do
      runs+=(--run "$precision $backend=configs/mamba2-1p3b.yaml configs/precision/$precision.yaml model.mamba.kernel_backend=$backend")
    done
  done
  timeout 330 python3 benchmarks/train_throughput.py --steps 8 --warmup 2 "${runs[@]}" > "$OUT_DIR/steps_${PRECISIONS// /_}.txt" 2>&1
  grep -v '^\s*$' "$OUT_DIR/steps_${PRECISIONS// /_}.txt" | tail -5
fi
