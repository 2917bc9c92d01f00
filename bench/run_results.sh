#!/usr/bin/env bash
# Regenerates the tables of docs/results.md (CPU, ~40 min on 2 cores). Usage: bash bench/run_results.sh [N]
set -euo pipefail
N=${1:-200}
OUT=docs/results
mkdir -p "$OUT"
ALL=baseline,parallel,fast-dllm,elastic-cache,polestar-cache,polestar-commit,polestar
for model in tiny-llada tiny-dream; do
  for task in arith sudoku; do
    polestar bench --model $model --task $task --policies $ALL --n "$N" --batch-size 50 \
      --gen-length 64 --block-length 16 --json "$OUT/$model-$task.json" --plot "$OUT/$model-$task.png" \
      | tee "$OUT/$model-$task.txt"
  done
  polestar bench --model $model --task arith --policies baseline,parallel --set threshold=0.5 --n "$N" \
    --batch-size 50 --gen-length 64 --block-length 16 --json "$OUT/$model-arith-t05.json" | tee "$OUT/$model-arith-t05.txt"
done
