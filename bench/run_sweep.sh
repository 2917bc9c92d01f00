#!/usr/bin/env bash
# Polestar-Cache recompute-budget sweep: `polestar-cache` under a few settings of its
# refresh selector beside `fast-dllm`, `elastic-cache` and `parallel` (no cache), as one table per model and task
# (`python bench/sweep_table.py`). About 4 min per model and task at N=500 on one core (15 min for the four).
# Usage: bash bench/run_sweep.sh [N]   (MODELS="tiny-llada", TASKS="sudoku" to run part of it)
set -euo pipefail
N=${1:-200}
OUT=${OUT:-docs/results}  # the tables (committed)
RAW=${RAW:-runs/sweep}
mkdir -p "$OUT" "$RAW"
# label and --set options of each polestar-cache run (label "default": the paper's values)
CONFIGS=(
  "default|"
  "k2|refresh.topk=2"
  "k6|refresh.topk=6"
  "k-all|refresh.topk=8 refresh.topk_last=8"
  "c16-k8|refresh.n_clusters=16 refresh.topk=8"
  "tau0|refresh.tau_upd=0"
  "k-all-tau0|refresh.topk=8 refresh.topk_last=8 refresh.tau_upd=0"
  # the window covers the whole sequence (prompt 2 blocks + 4 generated): with an exact store it should equal `parallel`, no cache
  "full-window|refresh.topk=8 refresh.topk_last=8 refresh.tau_upd=0 refresh.prefix_blocks=6 refresh.suffix_blocks=4 quant=none"
)
for model in ${MODELS:-tiny-llada tiny-dream}; do
  for task in ${TASKS:-arith sudoku}; do
    common=(--model "$model" --task "$task" --n "$N" --batch-size 50 --gen-length 64 --block-length 16)
    dir="$RAW/$model-$task"
    mkdir -p "$dir"
    polestar bench "${common[@]}" --policies parallel,fast-dllm,elastic-cache --overwrite --json "$dir/reference.json" > /dev/null
    for config in "${CONFIGS[@]}"; do
      label=${config%%|*}
      sets=()
      for kv in ${config#*|}; do sets+=(--set "$kv"); done
      polestar bench "${common[@]}" --policies polestar-cache "${sets[@]}" --overwrite --json "$dir/$label.json" > /dev/null
    done
    { python bench/sweep_table.py "$dir"; echo
      polestar agree "$dir/reference.json" "$dir/full-window.json" --policy-a parallel --policy-b polestar-cache
    } | tee "$OUT/$model-$task-sweep.txt"
  done
done
