#!/usr/bin/env bash
# The accuracy–TPF frontier: `fast-dllm` and `parallel` over a threshold sweep, the adaptive commit rules
# (`polestar-commit`, `polestar`, `eb`, `klass`) at their defaults, the factor rule with the paper's and the code's
# bound, and `polestar` at two more α values, on the same
# problems, and the commit anatomy of fast-dllm, polestar-commit and polestar there. Raw bench JSON goes to
# runs/frontier/<model>-<task>/, the tables and the plot to docs/results/. About 11 min per model and task at
# N=500 on one core of the shared 2-core machine (tiny-llada-noisy arith measured; sudoku takes more forwards).
# Usage: bash bench/run_frontier.sh [N]   (MODELS="tiny-llada-noisy", TASKS="arith" to run part of it)
set -euo pipefail
N=${1:-200}
OUT=${OUT:-docs/results}
RAW=${RAW:-runs/frontier}
TAUS=${TAUS:-0.5 0.6 0.7 0.8 0.85 0.9 0.95}
ALPHAS=${ALPHAS:-3 30}
mkdir -p "$OUT" "$RAW"
for model in ${MODELS:-tiny-llada-noisy tiny-dream-noisy}; do
  for task in ${TASKS:-arith sudoku}; do
    common=(--model "$model" --task "$task" --n "$N" --batch-size 50 --gen-length 64 --block-length 16)
    dir="$RAW/$model-$task"
    mkdir -p "$dir"
    for tau in $TAUS; do
      polestar bench "${common[@]}" --policies fast-dllm,parallel --set threshold="$tau" --overwrite --json "$dir/tau-$tau.json" > /dev/null
    done
    polestar bench "${common[@]}" --policies polestar-commit,polestar,eb,klass --overwrite --json "$dir/adaptive.json" > /dev/null
    # the factor rule's two bounds: the paper's (the default) and Fast-dLLM's code's
    polestar bench "${common[@]}" --policies "fast-dllm[commit=factor,rule=paper],fast-dllm[commit=factor,rule=code]" \
      --overwrite --json "$dir/factor.json" > /dev/null
    for alpha in $ALPHAS; do
      polestar bench "${common[@]}" --policies polestar --set alpha="$alpha" --overwrite --json "$dir/alpha-$alpha.json" > /dev/null
    done
    python bench/frontier_table.py "$dir" --plot "$OUT/$model-$task-frontier.png" | tee "$OUT/$model-$task-frontier.txt"
    polestar anatomy "${common[@]}" --policies fast-dllm,polestar-commit,polestar | tee "$OUT/$model-$task-anatomy.txt"
  done
done
