#!/usr/bin/env bash
# The whole training step at the qwen3-slice shape on one GPU (issue 28): the CUDA build,
# then `lrmoe bench step` at c in {0, 0.3, 0.5} for each attention implementation, the
# first cell profiled. GCIDE: LRMOE_GCIDE_DIR (carry data/gcide). TITAN=1 adds the
# torchtitan cells (--titan: torchtitan's Qwen3 MoE model with its own MoE and with LRMoE
# at each c; torchtitan from the wheels in .whl/, carry it: device_common.sh). Writes
# log.txt, step.md, step.json under $OUT (device tool) or ./step-out.
# COMPILE="off on" runs every lrmoe cell eager and with run.compile (each profiled first).
# Usage: [TITAN=1] [COMPILE="off"] [RATES="0 0.3 0.5"] [STEPS=12] [STEP_BUDGET=480] LRMOE_GCIDE_DIR=data/gcide
#   bash tools/device/device_step.sh [ATTENTION...]
set -uo pipefail
source "$(dirname "$0")/device_common.sh"
device_setup "${OUT:-step-out}" "${WORK:-/tmp/lrmoe-step}"
export LRMOE_GCIDE_DIR="$(cd "${LRMOE_GCIDE_DIR:?set LRMOE_GCIDE_DIR (carry data/gcide)}" && pwd)"
titan=()
if [[ "${TITAN:-0}" == 1 ]]; then device_torchtitan_install; titan=(--titan); fi
device_build
attn=("${@:-sdpa flex_attention}")
# shellcheck disable=SC2068
# shellcheck disable=SC2086
timeout "${STEP_BUDGET:-480}" "$py" -m lrmoe bench step --preset qwen3-slice --rates ${RATES:-0 0.3 0.5} \
  --attention ${attn[@]} --steps "${STEPS:-12}" --warmup 4 --profile --compile ${COMPILE:-off} \
  --set "data.cache_dir=$work/cache" --out "$work/step" "${titan[@]}" >> "$out/log.txt" 2>&1
log "bench step rc $?"
cp "$work/step/step.md" "$work/step/step.json" "$out/" 2>/dev/null
tail -40 "$out/log.txt"
