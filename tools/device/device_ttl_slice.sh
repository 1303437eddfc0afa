#!/usr/bin/env bash
# Time to quality at the expert-dominated shape (issue 29, item 4): lrm importance at
# c = 0.3 / 0.5 against c = 0 on the qwen3-slice preset (the Qwen3-30B-A3B layer in
# 4 layers, 32k tokens a step), each cell alone on the GPU (experiments/time_to_loss.py,
# --jobs 1), seed by seed so that a call cut short keeps whole seeds. No checkpoints or
# export (a 2.56 B-parameter checkpoint is ~30 GB and the disk is 64 GiB); the validation
# split is the same for every seed (data.split_seed = 0).
# Runs stay in WORK (/tmp/lrmoe-ttl): the same command in the next call, while the machine
# is warm, skips the finished cells. Stops starting seeds at BUDGET seconds (540).
# Writes log.txt, ttl_report.md, ttl_runs.tar.gz (metrics, summaries, configs) under $OUT.
# run.compile stays off (TTL_COMPILE=true turns it on): the committed cells of
# 2026-12-04..07 ran eager, and a cell's wall time is compared with theirs.
# Usage: LRMOE_GCIDE_DIR=data/gcide bash tools/device/device_ttl_slice.sh
#   (STEPS=200 SEEDS="0 1 2" TARGETS="5.0 4.6 4.3" RATES="0.3 0.5" BUDGET=540 TTL_COMPILE=false)
set -uo pipefail
source "$(dirname "$0")/device_common.sh"
device_setup "${OUT:-ttl-out}" "${WORK:-/tmp/lrmoe-ttl}"
export LRMOE_GCIDE_DIR="$(cd "${LRMOE_GCIDE_DIR:?set LRMOE_GCIDE_DIR (carry data/gcide)}" && pwd)"
device_build
steps="${STEPS:-200}"
budget="${BUDGET:-540}"
# shellcheck disable=SC2086
args=(--preset qwen3-slice --device cuda --steps "$steps" --eval-every 25 --rates ${RATES:-0.3 0.5}
      --selection importance --metric lrm --targets ${TARGETS:-5.0 4.6 4.3} --jobs 1
      --set "data.cache_dir=$work/cache" --set run.checkpoints=false --set run.export=false
      --set "run.compile=${TTL_COMPILE:-false}" --out "$work/ttl")
for s in ${SEEDS:-0 1 2}; do
  left=$(( budget - ($(date +%s) - t0) ))
  (( left > 60 )) || { log "budget spent: seed $s not started"; break; }
  log "seed $s ($left s left)"
  timeout "$left" "$py" experiments/time_to_loss.py "${args[@]}" --seeds "$s" >> "$out/log.txt" 2>&1
  log "seed $s rc $?"
done
# shellcheck disable=SC2046
"$py" experiments/time_to_loss.py "${args[@]}" --seeds ${SEEDS:-0 1 2} --analyse-only \
  >> "$out/log.txt" 2>&1
cp "$work/ttl/"*.md "$out/ttl_report.md" 2>/dev/null
(cd "$work" && tar czf "$out/ttl_runs.tar.gz" --exclude=checkpoints --exclude='*.pt' ttl) 2>/dev/null
log "done"
tail -30 "$out/log.txt"
