#!/usr/bin/env bash
# The mixture-of-experts convergence comparison (docs/MOE.md, Convergence) as one job of a 2-GPU
# machine: the dense model and the MoE of equal active parameters (configs/conv-dense-38m.yaml,
# configs/conv-moe-8x2-38m.yaml), the MoE with BF16 and with FP8 experts, 3 seeds, one run per GPU,
# on the convergence corpus (gathered and prepared first by benchmarks/convergence.sh).
#   bash benchmarks/moe_convergence.sh [OUT_DIR] [more benchmarks/convergence.py arguments]
# BUDGET_S (default 510) counts from this script's start, corpus preparation included: then the
# runs are stopped (they checkpoint) and the summary is written, so the job ends inside 540 s.
# The same command again on the same machine resumes what was cut off. TOKENS (default 100e6, the
# length of docs/MOE.md's table: two calls on two H200s) sets each run's length. OUT_DIR gets summary.json, convergence.png, the log and results.tar.gz
# (results/*.json and each run's log): few files, as a machine's outbox may take only a handful.
# KEPT=results.tar.gz from an earlier call (another machine) counts its complete runs as done,
# so only the rest runs (benchmarks/convergence.py keeps a result of the same corpus and length).
set -uo pipefail
START=$(date +%s)
OUT_DIR=${1:-${OUT:-/tmp/conv-moe-out}}
shift $(( $# > 0 ? 1 : 0 ))
RUN_DIR=${RUN_DIR:-/tmp/conv/moe}
mkdir -p "$OUT_DIR" "$RUN_DIR"
if [ -n "${KEPT:-}" ]; then
  tar -xzf "$KEPT" -C "$RUN_DIR" results || exit 1
fi
END_AT=$(( START + ${BUDGET_S:-510} )) bash benchmarks/convergence.sh \
  --model dense=configs/conv-dense-38m.yaml --model moe=configs/conv-moe-8x2-38m.yaml \
  --variants dense.bf16 moe.bf16 moe.fp8_experts --baseline dense.bf16 \
  --seeds 0 1 2 --tokens "${TOKENS:-100e6}" --out "$RUN_DIR" "$@" 2>&1 | tee "$OUT_DIR/convergence.log"
code=${PIPESTATUS[0]}
cp "$RUN_DIR/summary.json" "$RUN_DIR/convergence.png" "$OUT_DIR/" 2>/dev/null
( cd "$RUN_DIR" && tar -czf "$OUT_DIR/results.tar.gz" results runs/*.log )
echo "moe_convergence: $(( $(date +%s) - START )) s, exit $code"
exit "$code"
