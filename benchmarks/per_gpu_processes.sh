#!/usr/bin/env bash
# One node, one process per GPU, started by hand (what srun does under Slurm): trains a config
# for a few steps with checkpoints off and prints the median step time and tokens/s per GPU
# from process 0's metrics.jsonl.
# Usage: bash benchmarks/per_gpu_processes.sh NPROC CONFIG.yaml [more.yaml] [key=value ...]
# Environment: STEPS (12), PORT (12355), FIRST_GPU (0: GPUs FIRST_GPU..FIRST_GPU+NPROC-1, so that
# two jobs can share a node), OUT_DIR (a fresh temporary folder; a kept one resumes its run),
# DATA_SOURCE (synthetic), CHECKPOINTS=1 keeps the config's checkpointing (benchmarks/elastic_restart.sh).
set -euo pipefail
NPROC=$1; shift
OUT_DIR=${OUT_DIR:-$(mktemp -d)}
PORT=${PORT:-12355}
STEPS=${STEPS:-12}
FIRST_GPU=${FIRST_GPU:-0}
extra=()
[ "${CHECKPOINTS:-0}" = 1 ] || extra+=(checkpoint.enabled=false)
mkdir -p "$OUT_DIR"
pids=()
for ((i = 0; i < NPROC; i++)); do
  CUDA_VISIBLE_DEVICES=$((FIRST_GPU + i)) python3 -m maxfp4.train "$@" run.output_dir="$OUT_DIR" run.name=bench \
    data.source="${DATA_SOURCE:-synthetic}" "${extra[@]}" train.log_every=1 train.steps="$STEPS" \
    optim.schedule_steps=100000 distributed.coordinator=127.0.0.1:$PORT \
    distributed.num_processes="$NPROC" distributed.process_id=$i > "$OUT_DIR/log$i.txt" 2>&1 &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
tail -3 "$OUT_DIR/log0.txt"
python3 - "$OUT_DIR/bench/metrics.jsonl" "$NPROC" <<'PY'
import json, statistics, sys
recs = [json.loads(l) for l in open(sys.argv[1])]
recs = [r for r in recs if r.get("step_time_s")]
first = recs[0]["step"]  # a resumed run's first step compiles too
timed = [r for r in recs if r["step"] > first + 2] or recs[-1:]
t = statistics.median(r["step_time_s"] for r in timed)
tps = statistics.median(r["tokens_per_s"] for r in timed)
n = int(sys.argv[2])
mfu = [r["mfu"] for r in timed if r.get("mfu") is not None]
print(f"PROCESSES processes={n} step_ms={1e3*t:.1f} tokens_per_s={tps:.0f} per_gpu={tps/n:.0f} "
      f"tflops_per_device={statistics.median(r['tflops_per_device'] for r in timed):.1f} "
      f"mfu={statistics.median(mfu) if mfu else '-'}")
PY
exit $rc
