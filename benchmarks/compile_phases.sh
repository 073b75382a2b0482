#!/usr/bin/env bash
# Where a train step's compile time goes, on the machine it runs on: jax's lowering, XLA's HLO
# passes and XLA's backend (kernel code generation, ptxas), one row per config, with the two
# HLO passes that took longest. Each row is one process running benchmarks/compile_cost.py
# (abstract inputs: nothing is allocated or run) with XLA's compile and pass timers logged
# (TF_CPP_VMODULE=gpu_compiler=1,hlo_pass_pipeline=1); the optimized HLO of each is kept,
# gzipped, as OUT_DIR/hlo_N.txt.gz (OUT_DIR: $OUT, else /tmp/maxfp4-compile).
#   bash benchmarks/compile_phases.sh "configs/mamba2-1p3b.yaml configs/precision/fp8.yaml" \
#       "configs/dense-1p3b.yaml configs/precision/nvfp4.yaml model.n_layers=6"
# ROOT=DIR runs another tree's maxfp4 (e.g. build/old from `git archive COMMIT | tar -x`) with
# this script's compile_cost.py, for a before/after in one call.
set -uo pipefail
if [ $# -lt 1 ]; then
  echo "usage: bash benchmarks/compile_phases.sh \"CONFIG [PRECISION] [key=value ...]\" ..." >&2
  exit 2
fi
HERE=$(cd "$(dirname "$0")" && pwd)
OUT_DIR=${OUT:-/tmp/maxfp4-compile}
mkdir -p "$OUT_DIR"
. "$HERE/device_env.sh"
ROOT=$(cd "${ROOT:-$HERE/..}" && pwd)
printf '%-70s %8s %9s %9s %9s %12s  %s\n' run "lower s" "passes s" "backend s" "compile s" instructions "longest passes s"
n=0
for run in "$@"; do
  n=$((n + 1))
  log="$OUT_DIR/compile_$n.log"
  # shellcheck disable=SC2086  # a run is a list of arguments
  TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=gpu_compiler=1,hlo_pass_pipeline=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" \
    python3 "$HERE/compile_cost.py" $run --top 1 --json "$OUT_DIR/compile_$n.json" \
    --hlo-out "$OUT_DIR/hlo_$n.txt.gz" > "$log" 2>&1
  python3 - "$log" "$OUT_DIR/compile_$n.json" "$run" <<'PY'
import json, re, sys
log, result, run = sys.argv[1:]
text = open(log, errors="replace").read()
def seconds(phase):  # XLA's timer line for the step's module, e.g. "... time: 21.3 s (21269640 us) ..."
    m = re.search(phase + r" for jit_train_step time: [^(]*\((\d+) us\)", text)
    return f"{int(m.group(1)) / 1e6:.1f}" if m else "-"
try:
    r = json.load(open(result))
except (OSError, ValueError):
    print(f"{run[:70]:<70} failed: {text.strip().splitlines()[-1][:120] if text.strip() else 'no output'}")
    sys.exit(0)
# Each pass's time in the step's module, summed over its runs: the log names the module before
# each pipeline ("Running HLO pass pipeline on module M: P") and times each pass after it.
passes, module = {}, None
for line in text.splitlines():
    m = re.search(r"Running HLO pass pipeline on module (\S+):", line)
    if m:
        module = m.group(1)
        continue
    m = re.search(r"HLO pass: (\S+) time: [^(]*\((\d+) us\)", line)
    if m and module == "jit_train_step":
        passes[m.group(1)] = passes.get(m.group(1), 0) + int(m.group(2))
longest = ", ".join(f"{name} {us / 1e6:.1f}" for name, us in sorted(passes.items(), key=lambda kv: -kv[1])[:2])
print(f"{run[:70]:<70} {r['lower_s']:>8} {seconds('GpuCompiler::RunHloPasses'):>9} "
      f"{seconds('GpuCompiler::RunBackend'):>9} {r['compile_s']:>9} {r['instructions']:>12,}  {longest or '-'}")
PY
done
