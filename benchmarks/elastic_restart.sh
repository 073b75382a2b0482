#!/usr/bin/env bash
# An elastic restart of a real run on one node: trains CONFIG with one process per GPU on the
# builtin corpus, stopping and resuming at each segment's end on another GPU count (the default
# 4 -> 2 -> 4 GPUs, the global batch unchanged: train.elastic raises train.microbatches while the
# run has fewer GPUs), against the same run uninterrupted on the first segment's GPUs; prints
# the two loss curves side by side and the largest relative difference.
# Usage: bash benchmarks/elastic_restart.sh CONFIG.yaml [more.yaml] [key=value ...]
# Environment: SEGMENTS ("4:20 2:40 4:60": GPUs:last step of each segment), OUT_ROOT (a fresh
# temporary folder).
set -euo pipefail
SEGMENTS=${SEGMENTS:-"4:20 2:40 4:60"}
OUT_ROOT=${OUT_ROOT:-$(mktemp -d)}
export DATA_SOURCE=builtin CHECKPOINTS=1
first=${SEGMENTS%% *}; last=${SEGMENTS##* }
echo "== uninterrupted: ${first%%:*} GPUs to step ${last##*:}"
OUT_DIR=$OUT_ROOT/whole STEPS=${last##*:} bash benchmarks/per_gpu_processes.sh "${first%%:*}" "$@" | grep PROCESSES
for seg in $SEGMENTS; do
  echo "== elastic: ${seg%%:*} GPUs to step ${seg##*:}"
  OUT_DIR=$OUT_ROOT/elastic STEPS=${seg##*:} bash benchmarks/per_gpu_processes.sh "${seg%%:*}" "$@" \
    data.tokenizer="$OUT_ROOT/whole/bench/tokenizer.model" | grep -E "PROCESSES|elastic:" || true
  grep -h "elastic:" "$OUT_ROOT/elastic/log0.txt" | tail -1 || true
done
python3 - "$OUT_ROOT/whole/bench/metrics.jsonl" "$OUT_ROOT/elastic/bench/metrics.jsonl" "$SEGMENTS" <<'PY'
import json, sys
def losses(path):
    out = {}
    for line in open(path):
        r = json.loads(line)
        if "loss" in r and "step" in r:
            out[r["step"]] = r  # a resumed segment's records overwrite nothing earlier: steps go on
    return out
ref, got = losses(sys.argv[1]), losses(sys.argv[2])
ends = {int(s.split(":")[1]) for s in sys.argv[3].split()}
steps = sorted(set(ref) & set(got))
worst = max(abs(got[s]["loss"] - ref[s]["loss"]) / ref[s]["loss"] for s in steps)
lr = max(abs(got[s]["lr"] - ref[s]["lr"]) / max(ref[s]["lr"], 1e-30) for s in steps)
for s in steps:
    if s % 5 == 0 or s in ends or s - 1 in ends:
        print(f"step {s:4d}  uninterrupted {ref[s]['loss']:.4f}  elastic {got[s]['loss']:.4f}")
print(f"ELASTIC steps={len(steps)} of {max(ref)} max_rel_loss_diff={worst:.2e} max_rel_lr_diff={lr:.1e} "
      f"loss {got[steps[0]]['loss']:.3f} -> {got[steps[-1]]['loss']:.3f}")
PY
