#!/usr/bin/env bash
# One job of the convergence benchmark on a GPU machine: the corpus (installed packages' sources, gathered
# and prepared once per machine, kept in $CORPUS), then benchmarks/convergence.py with the given
# arguments; an unfinished set of runs resumes when the same command runs again on the same machine.
#   bash benchmarks/convergence.sh --config configs/dense-125m.yaml --variants bf16 nvfp4 \
#       --seeds 0 --tokens 200e6 --out /tmp/conv/dense --deadline-s 540
# END_AT (epoch seconds), when set, is when the runs must be stopped: the deadline is counted from
# the end of the corpus preparation, whose length varies (for a job of fixed length).
set -uo pipefail
CORPUS=${CORPUS:-/tmp/corpus}
. benchmarks/device_env.sh
if [ ! -f "$CORPUS/heldout/manifest.json" ]; then
  python3 benchmarks/gather_corpus.py --out "$CORPUS" --max-mb "${CORPUS_MB:-500}" --heldout 0.005 || exit 1
  python3 -m maxfp4.data.prepare --source jsonl --paths "$CORPUS/train.jsonl" --out "$CORPUS/train" \
    --vocab-size 8192 || exit 1
  python3 -m maxfp4.data.prepare --source jsonl --paths "$CORPUS/heldout.jsonl" --out "$CORPUS/heldout" \
    --tokenizer "$CORPUS/train/tokenizer.model" || exit 1
fi
if [ -n "${END_AT:-}" ]; then
  set -- "$@" --deadline-s $(( END_AT - $(date +%s) ))
fi
python3 benchmarks/convergence.py --data "$CORPUS" "$@"
