#!/usr/bin/env bash
# The policy side of the side-by-side comparisons with released code in docs/results.md ("Elastic-Cache side by
# side with its released code", "dLLM-Cache side by side with its released code"): `elastic-cache` and
# `dllm-cache` on the arith test problems, batch 1, generation 64, float32, no stop at EOS, one run per setting of
# the tables, then the table rows (python bench/side_by_side_table.py). About 6 min at N=100 on one core.
# Usage: bash bench/run_side_by_side.sh [N]   (PARTS="dllm" or PARTS="elastic" to run one of the two tables)
set -euo pipefail
N=${1:-100}
OUT=${OUT:-docs/results}          # the two tables (committed)
RAW=${RAW:-runs/side-by-side}     # the runs' JSON (not committed)
mkdir -p "$OUT" "$RAW"
for part in ${PARTS:-elastic dllm}; do
  mkdir -p "$RAW/$part"
  if [ "$part" = elastic ]; then
    # label|model|--set options (the released code's eos_id 126081 is no token of the tiny vocabularies; on
    # Dream the rows pass -1, which never occurs, and the last row tiny-dream's EOS, 0, as the released Dream
    # evaluation passes the tokenizer's)
    SETTINGS=(
      "tiny-llada-defaults|tiny-llada|refresh.eos_id=126081"
      "tiny-llada-gamma0|tiny-llada|refresh.eos_id=126081 refresh.gamma=0"
      "tiny-llada-gamma1|tiny-llada|refresh.eos_id=126081 refresh.gamma=1"
      "tiny-llada-window64|tiny-llada|refresh.eos_id=126081 refresh.window_length=64"
      "tiny-dream-defaults|tiny-dream|refresh.eos_id=-1"
      "tiny-dream-gamma0|tiny-dream|refresh.eos_id=-1 refresh.gamma=0"
      "tiny-dream-gamma1|tiny-dream|refresh.eos_id=-1 refresh.gamma=1"
      "tiny-dream-window64|tiny-dream|refresh.eos_id=-1 refresh.window_length=64"
      "tiny-dream-eos|tiny-dream|refresh.eos_id=0"
    )
    common=(--task arith --policies elastic-cache --n "$N" --batch-size 1 --gen-length 64 --block-length 64
            --no-stop-at-eos --dtype float32 --set threshold=0.9)
  else
    # the released LLaDA script's settings (prompt interval 50, response interval 7, ratio 0.25), then two more
    SETTINGS=(
      "p50-r7-ratio0.25|tiny-llada|"
      "p16-r8-ratio0.25|tiny-llada|refresh.prompt_interval=16 refresh.response_interval=8"
      "p50-r7-ratio0|tiny-llada|refresh.ratio=0"
    )
    common=(--task arith --policies dllm-cache --n "$N" --batch-size 1 --gen-length 64 --block-length 16
            --steps 64 --no-stop-at-eos --dtype float32)
  fi
  for setting in "${SETTINGS[@]}"; do
    IFS='|' read -r label model options <<< "$setting"
    sets=()
    for kv in $options; do sets+=(--set "$kv"); done
    polestar bench --model "$model" "${common[@]}" ${sets[@]+"${sets[@]}"} --quiet --overwrite \
      --json "$RAW/$part/$label.json" > /dev/null
  done
  python bench/side_by_side_table.py "$RAW/$part" | tee "$OUT/side-by-side-$part.txt"
done
