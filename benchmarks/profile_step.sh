#!/usr/bin/env bash
# Profile two steps of a training run and summarise where the GPU time goes, kernel by kernel,
# each with the JAX operation XLA compiled it from. One call per configuration:
#   bash benchmarks/profile_step.sh NAME CONFIG [PRECISION] [key=value ...]
# e.g. bash benchmarks/profile_step.sh hybrid_fp8 configs/hybrid-1b.yaml configs/precision/fp8.yaml
# Writes OUT_DIR/prof_NAME.txt (OUT_DIR: $OUT, else /tmp/maxfp4-profiles) and, gzipped, the
# optimized HLO of the step (OUT_DIR/hlo_NAME.txt.gz) for reading fusions and GEMM types.
# Synthetic data as the configs set it; checkpoints off; steps 5 and 6 traced (1-4 warm up).
# AT=N traces steps N and N+1 instead: a GPU at its power cap runs slower clocks once it has
# run a while, so a later pair shows the sustained kernel times.
# GAPS=N also lists the N longest gaps in each GPU's compute and the collectives in flight.
set -uo pipefail
if [ $# -lt 2 ]; then
  echo "usage: bash benchmarks/profile_step.sh NAME CONFIG [PRECISION] [key=value ...]" >&2
  exit 2
fi
NAME=$1; shift
OUT_DIR=${OUT:-/tmp/maxfp4-profiles}
mkdir -p "$OUT_DIR"
. benchmarks/device_env.sh
DUMP=/tmp/maxfp4-dump-$NAME RUNS=/tmp/maxfp4-runs-$NAME
rm -rf "$DUMP" "$RUNS"
XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=$DUMP --xla_dump_hlo_as_text" python3 -m maxfp4.train "$@" \
  train.steps=$((${AT:-5} + 2)) optim.warmup_steps=2 "train.profile_steps=[${AT:-5},$((${AT:-5} + 1))]" run.output_dir="$RUNS" \
  checkpoint.enabled=false train.log_every=1 2>&1 | tail -2
python3 benchmarks/profile_summary.py "$RUNS"/*/profile --steps 2 --top "${TOP:-60}" --gaps "${GAPS:-0}" --hlo "$DUMP" \
  > "$OUT_DIR/prof_$NAME.txt" 2>&1
head -12 "$OUT_DIR/prof_$NAME.txt"
gzip -c "$(ls -S "$DUMP"/*after_optimizations.txt | head -1)" > "$OUT_DIR/hlo_$NAME.txt.gz"
