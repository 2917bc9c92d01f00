#!/usr/bin/env bash
# Regenerates the tables of docs/results.md (CPU; about 25 minutes per model at N=500 on one core).
# Usage: bash bench/run_results.sh [N]   (MODELS="tiny-llada" to run one checkpoint, TASKS="arith sudoku" to
# run some tasks; two processes with one model each use both cores)
# The per-item results (`polestar bench --json`, large) go under the ignored runs/results; the text tables to
# docs/results. Afterwards `python bench/render_results.py --raw runs/results` keeps each table's summary
# (docs/results/*.summary.json), redraws the plots and renders docs/results.md.
set -euo pipefail
N=${1:-200}
OUT=${OUT:-docs/results}  # text tables (committed)
RAW=${RAW:-runs/results}    # per-item JSON (not committed)
mkdir -p "$OUT" "$RAW"
ALL=baseline,parallel,fast-dllm,elastic-cache,polestar-cache,polestar-commit,polestar
for model in ${MODELS:-tiny-llada tiny-dream}; do
  for task in ${TASKS:-arith sudoku countdown parallel}; do
    polestar bench --model $model --task $task --policies $ALL --n "$N" --batch-size 50 \
      --gen-length 64 --block-length 16 --overwrite --json "$RAW/$model-$task.json" \
      | tee "$OUT/$model-$task.txt"
  done
  for task in ${T05_TASKS:-arith sudoku}; do
    # only `parallel` depends on the threshold: compare with the threshold-0.9 table's `baseline`
    polestar bench --model $model --task $task --policies parallel --set threshold=0.5 --n "$N" \
      --batch-size 50 --gen-length 64 --block-length 16 --overwrite --json "$RAW/$model-$task-t05.json" \
      | tee "$OUT/$model-$task-t05.txt"
  done
  for task in ${ANATOMY_TASKS:-arith sudoku}; do
    # where the commits come from, with the EOS stop and, as in the reference loops, without
    for eos in "" --no-stop-at-eos; do
      polestar anatomy --model $model --task $task --policies fast-dllm,polestar-commit,polestar --n "$N" \
        --batch-size 50 --gen-length 64 --block-length 16 $eos | tee "$OUT/$model-$task-anatomy${eos:+-noeos}.txt"
    done
  done
done
