#!/usr/bin/env bash
# Token agreement of the lossy Polestar-Cache stages: decode the same problems with quant=none,
# offload=none and with quant=nvfp4, offload=cpu, then compare them token by token with `polestar agree`.
# Usage: bash bench/run_agreement.sh [N]   (MODELS="tiny-llada" to run one checkpoint, TASKS="arith")
set -euo pipefail
N=${1:-200}
OUT=${OUT:-docs/results}  # the comparison tables (committed)
RAW=${RAW:-runs/agree}    # the two runs' JSON (large; not committed)
mkdir -p "$OUT" "$RAW"
for model in ${MODELS:-tiny-llada tiny-dream tiny-llada-noisy tiny-dream-noisy}; do
  for task in ${TASKS:-arith sudoku}; do
    raw="$RAW/$model-$task"
    common=(--model "$model" --task "$task" --policies polestar-cache,polestar --n "$N" --batch-size 50
            --gen-length 64 --block-length 16)
    polestar bench "${common[@]}" --set quant=none --set offload=none --overwrite --json "$raw-exact.json" > /dev/null
    polestar bench "${common[@]}" --set quant=nvfp4 --set offload=cpu --overwrite --json "$raw-lossy.json" > /dev/null
    polestar agree "$raw-exact.json" "$raw-lossy.json" | tee "$OUT/$model-$task-agree.txt"
  done
done
