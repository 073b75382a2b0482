#!/usr/bin/env bash
# Training throughput of two source trees in one call: the tree at OLD (a commit, extracted with
# git archive) against the working tree, each run in its own process from its own tree, old and
# new alternating on the same GPU (a refactor must not change the speed).
# Usage (repo root): bash benchmarks/compare_trees.sh OLD "LABEL=CONFIG.yaml [more.yaml] [key=value ...]" ...
# On a GPU machine without git history, extract first and pass the folder:
#   mkdir -p build/old && git archive OLD | tar -x -C build/old   (here), then OLD=build/old there.
# Environment: STEPS (6), WARMUP (2), CUDA_VISIBLE_DEVICES as usual; ORDER ("old new"): the
# runs of each spec in turn, e.g. ORDER="old new new old". The second run of a pair measured
# 0.9-1.8% slower than the first whichever tree it ran (mamba2-1p3b FP8, one H200, 2026-11-29:
# the GPU settles at its power cap), so a change worth ~1% needs both orders.
set -uo pipefail
old=$1; shift
for side in ${ORDER:-old new}; do
  case $side in old|new) ;; *) echo "error: compare_trees: ORDER holds old and new only, got $side" >&2; exit 2;; esac
done
if [ ! -d "$old" ]; then
  dir=$(mktemp -d)
  git archive "$old" | tar -x -C "$dir" || { echo "error: compare_trees: $old is neither a folder nor a commit" >&2; exit 2; }
  old=$dir
fi
root=$PWD
. benchmarks/device_env.sh  # PYTHONPATH=<packages>:<repo>; each tree goes first on it below
export PYTHONHASHSEED=0  # one hash seed for both trees (set iteration order at trace time)
for spec in "$@"; do
  label=${spec%%=*} args=${spec#*=}
  for side in ${ORDER:-old new}; do
    tree=$root; [ $side = old ] && tree=$old
    (cd "$tree" && PYTHONPATH="$tree:$PYTHONPATH" python3 "$root/benchmarks/train_throughput.py" \
       --steps "${STEPS:-6}" --warmup "${WARMUP:-2}" --run "$label $side=$args" | tail -1)
  done
done
