#!/usr/bin/env bash
# One training config under several sets of XLA collective flags (XLA_FLAGS), one
# train_throughput.py run each, on all visible GPUs; prints one table row per flag set.
#   bash benchmarks/xla_flag_sweep.sh "configs/llama3-8b.yaml model.n_layers=8 train.remat=save_gemm train.microbatches=4"
# STEPS / WARMUP (default 3 / 2) set the timed and warm-up steps.
set -uo pipefail
if [ $# -ne 1 ]; then
  echo "usage: bash benchmarks/xla_flag_sweep.sh \"CONFIG [PRECISION] [key=value ...]\"" >&2
  exit 2
fi
. benchmarks/device_env.sh
LHS="--xla_gpu_enable_latency_hiding_scheduler=true"
PIPE="--xla_gpu_enable_pipelined_all_gather=true --xla_gpu_enable_pipelined_reduce_scatter=true --xla_gpu_enable_pipelined_all_reduce=true --xla_gpu_enable_while_loop_double_buffering=true"
COMB="--xla_gpu_all_gather_combine_threshold_bytes=1073741824 --xla_gpu_reduce_scatter_combine_threshold_bytes=1073741824 --xla_gpu_all_reduce_combine_threshold_bytes=1073741824"
run() {  # LABEL FLAGS [ENV=VALUE ...]; the label must not contain '='
  local label=$1 flags=$2; shift 2
  local vars=("$@") all="${XLA_FLAGS:-}${XLA_FLAGS:+ }$flags"
  # An XLA_FLAGS of blanks would be read as a file name: set it only when there are flags.
  if [ -n "$all" ]; then vars+=("XLA_FLAGS=$all"); fi
  env "${vars[@]}" python3 benchmarks/train_throughput.py --steps "${STEPS:-3}" \
    --warmup "${WARMUP:-2}" --timeout 600 --run "$label=$CONFIG" | tail -1
}
CONFIG=$1
run "default" ""
run "lhs" "$LHS"
run "lhs+pipe" "$LHS $PIPE"
run "lhs+pipe+comb" "$LHS $PIPE $COMB"
run "lhs+comb" "$LHS $COMB"
run "nccl-proto-simple" "" NCCL_PROTO=Simple
