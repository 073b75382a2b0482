#!/usr/bin/env bash
# Records the loss and gradient-norm traces that tests/test_guard.py replays through the guard:
# an 88M dense model (d_model 768, 12 blocks, vocabulary 8192) on the Python sources of the
# installed transformers package, 16 x 1024 tokens a step, guard off, one record a step, in
# BF16, FP8 delayed scaling and NVFP4 (LM head BF16). Run on a GPU machine from the repo root:
#   bash benchmarks/record_guard_traces.sh OUT_DIR [STEPS]
# writes OUT_DIR/<device>_<recipe>.json in the traces' format ({"source", "loss", "grad_norm"}).
set -uo pipefail
OUT_DIR=${1:?output directory}; STEPS=${2:-700}
mkdir -p "$OUT_DIR"
. benchmarks/device_env.sh
SRC=$(python3 -c "import os, transformers; print(os.path.dirname(transformers.__file__))")
DEVICE=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | awk '{print tolower($2)}')
COMMON=(configs/quickstart.yaml run.output_dir=/tmp/traces run.seed=1 model.d_model=768 model.n_layers=12
  model.n_heads=12 model.n_kv_heads=12 model.d_ff=2048 model.vocab_size=8192 data.source=text
  "data.paths=[$SRC/models/**/*.py]" data.seq_len=1024 data.global_batch=16 train.steps=$STEPS
  train.log_every=1 optim.lr=1e-3 optim.warmup_steps=100 resilience.guard=false checkpoint.enabled=false)
TOK=/tmp/traces/bf16/tokenizer.model
run() {  # name, extra overrides...
  local name=$1; shift
  local tok=(); [ -f "$TOK" ] && tok=(data.tokenizer=$TOK)
  timeout 240 python3 -m maxfp4.train "${COMMON[@]}" run.name=$name "${tok[@]}" "$@" 2>&1 | tail -4
  python3 - "$name" "$OUT_DIR/${DEVICE}_$name.json" "$DEVICE" "$*" <<'PY'
import json, sys
name, out, device, extra = sys.argv[1:]
rows = [json.loads(l) for l in open(f"/tmp/traces/{name}/metrics.jsonl")]
json.dump({"source": f"benchmarks/record_guard_traces.sh on one {device}: 88M dense, {name} {extra}".strip(),
           "loss": [round(r["loss"], 5) for r in rows], "grad_norm": [round(r["grad_norm"], 5) for r in rows]},
          open(out, "w"))
print(name, len(rows), "steps, last loss", rows[-1]["loss"])
PY
}
run bf16 precision.default=bf16
run fp8 configs/precision/fp8.yaml
run nvfp4 precision.default=nvfp4 "precision.rules=[{classes: [lm_head], recipe: bf16}]"
