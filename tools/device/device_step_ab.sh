#!/usr/bin/env bash
# A/B of the whole training step (issue 28): `lrmoe bench step` at the qwen3-slice shape on
# this tree (A), then with the files of BASE laid over it (B: a folder that mirrors repo
# paths, e.g. an older lrmoe/training/trainer.py; carry it), then A again (drift check),
# each variant in its own process, one GPU, one call, so every ratio is of the same card.
# GCIDE: LRMOE_GCIDE_DIR (carry data/gcide). Writes log.txt, ab.md (the three tables)
# and ab.json under $OUT. Stops starting variants at AB_BUDGET seconds (560).
# Usage: BASE=.scratch/ab_base [COMPILE=on] [RATES="0 0.5"] [STEPS=10] LRMOE_GCIDE_DIR=data/gcide
#   bash tools/device/device_step_ab.sh [ATTENTION]
set -uo pipefail
source "$(dirname "$0")/device_common.sh"
device_setup "${OUT:-ab-out}" "${WORK:-/tmp/lrmoe-ab}"
export LRMOE_GCIDE_DIR="$(cd "${LRMOE_GCIDE_DIR:?set LRMOE_GCIDE_DIR (carry data/gcide)}" && pwd)"
base="$(cd "${BASE:?set BASE (a folder of files mirroring repo paths)}" && pwd)"
device_build
cp -r "$PWD" "$work/tree-b" && cp -r "$base/." "$work/tree-b/"
log "B = this tree with: $(cd "$base" && find . -type f | tr '\n' ' ')"
budget="${AB_BUDGET:-560}"
for v in A B A2; do
  left=$(( budget - ($(date +%s) - t0) ))
  (( left > 90 )) || { log "budget spent: variant $v not started"; break; }
  dir="$PWD"; [[ $v == B ]] && dir="$work/tree-b"
  log "variant $v in $dir ($left s left)"
  # shellcheck disable=SC2086
  (cd "$dir" && PYTHONPATH="$dir" timeout "$left" "$py" -m lrmoe bench step --preset qwen3-slice \
     --rates ${RATES:-0 0.5} --attention "${1:-flex_attention}" --steps "${STEPS:-10}" --warmup 4 \
     --compile ${COMPILE:-on} --set "data.cache_dir=$work/cache" --out "$work/step-$v") \
     >> "$out/log.txt" 2>&1
  log "variant $v rc $?"
  { echo "## variant $v"; cat "$work/step-$v/step.md" 2>/dev/null; echo; } >> "$out/ab.md"
  [[ -f "$work/step-$v/step.json" ]] && cp "$work/step-$v/step.json" "$out/ab-$v.json"
done
cat "$out/ab.md"
