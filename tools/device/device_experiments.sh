#!/usr/bin/env bash
# The experiment grid of one GPU session (docs/journal/experiments.md), most needed first, each
# step under its own time cap so that a session cut short keeps every finished cell:
#   1. the CUDA build (setup.py build_ext --inplace, LRMOE_CUDA=1);
#   2. the CUDA-graph checks the last session could not re-run (test_layer_gpu.py -k
#      graph) and the Qwen3 layer's graph rows (lrmoe bench layer --cuda-graph);
#   3. with TTL=1 only (it ran in session 6: experiments/results/
#      gpu-small-time-to-loss-session6.tar.gz), time to loss of the best setting (lrm
#      importance, c = 0.3) against c = 0, seed 0, each cell alone on the device
#      (experiments/time_to_loss.py, --jobs 1): its MoE-layer times and tokens/s are
#      comparable only within one session;
#   4. the SFT grid for SFT_SEEDS (default "1 2"; seed 0 is committed in
#      experiments/results/sft-gpu-small-seed0.tar.gz: to analyse all seeds, unpack it
#      and the returned sft_runs.tar.gz into one folder and run experiments/sft.py
#      --analyse-only there; the base is the same, base seed 0): first the cells that
#      decide (lrm top-k and importance at c = 0.2 and 0.3: the paper's "C20 is free" is
#      a difference of hundredths of a percent), then random at c = 0.3, then the rest;
#   5. the from-scratch grid (experiments/full_grid.py, 300 steps, seeds 0 1 2), which
#      skips the cells given in GRID_FROM (a results tarball unpacked first).
# Usage: bash tools/device/device_experiments.sh OUTDIR
# One device call allows 600 s: the script stops starting work at BUDGET seconds (540)
# and keeps its runs in WORK (/tmp/lrmoe-device), so the same command in the next call
# continues them where the machine is still warm (the runners skip finished cells and
# resume interrupted ones; a fresh machine starts over, the files under OUTDIR are
# what survives). Per SFT seed about 11 minutes of H200 at JOBS=6 (evaluation every 20
# steps is most of it), the base once per machine (85 s).
# Needs LRMOE_GCIDE_DIR (Debian dict-gcide files) and SFT_DATA_GZ (the gzipped output of
# `lrmoe data wordnet-alpaca`); both travel in an ignored folder named in the device
# call's carry. Writes at most 8 files: log.txt, gpu_tests.txt, layer_bench.md,
# ttl_report.md, sft_report.md, sft_runs.tar.gz, grid_report.md, grid_runs.tar.gz (the
# time-to-loss runs join grid_runs.tar.gz under ttl/).
# Environment: PYTHON (python3), SFT (1; 0: skip step 4, e.g. to give a call to step 5), MAX_JOBS (16), BUDGET (540), WORK, CAP_TESTS (40),
# CAP_BENCH (90), TTL (0), SKIP_CHECKS (1: no tests and bench, e.g. in a continuing call), JOBS (4
# cells at once: a gpu-small cell peaks near 21 GiB of GPU memory and writes 7.5 GB
# checkpoints; six cells with two checkpoints each filled the machine's 64 GiB disk in
# session 6, and one gpu-small run already keeps the H200 busy, so more cells only overlap
# start-up and evaluation), GRID_FROM (default
# experiments/results/gpu-small-300-steps.tar.gz).
set -uo pipefail
out_arg="${1:?usage: tools/device/device_experiments.sh OUTDIR}"
: "${LRMOE_GCIDE_DIR:?set LRMOE_GCIDE_DIR to the dict-gcide files (carry them)}"
: "${SFT_DATA_GZ:?set SFT_DATA_GZ to wordnet_alpaca.jsonl.gz (carry it)}"
# shellcheck source=tools/device/device_common.sh
source "$(dirname "$0")/device_common.sh"
device_setup "$out_arg" "${WORK:-/tmp/lrmoe-device}"
seeds="${SFT_SEEDS:-1 2}"
jobs="${JOBS:-4}"
disk_free() { echo "disk free $(df -h --output=avail "$work" | tail -1 | tr -d ' ')"; }
left() {  # seconds to the budget, at most $1
  local l=$(( ${BUDGET:-540} - ($(date +%s) - t0) ))
  (( l > ${1:-100000} )) && l=$1
  (( l < 1 )) && l=1
  echo "$l"
}
pack() {  # a recipe's runs without checkpoints or weights, and its report
  local name="$1" dir="$2"
  [[ -d "$dir" ]] || return 0
  cp "$dir/report.md" "$out/${name}_report.md" 2>/dev/null
  tar czf "$out/${name}_runs.tar.gz" --exclude='checkpoints' --exclude='*.pt' \
    --exclude='*.safetensors' --exclude='*.png' -C "$(dirname "$dir")" "$(basename "$dir")"
}

device_build

if [[ "${SKIP_CHECKS:-0}" != 1 ]]; then
  timeout "$(left "${CAP_TESTS:-40}")" "$py" -m pytest -q -ra -p no:cacheprovider -m gpu \
    tests/python/moe/test_layer_gpu.py -k graph > "$out/gpu_tests.txt" 2>&1
  log "graph tests rc $? ($(grep -E 'passed|failed' "$out/gpu_tests.txt" | tail -1))"
  timeout "$(left "${CAP_BENCH:-90}")" "$py" -m lrmoe bench layer --shapes qwen3-30b-a3b \
    --tokens 32768 --routing skewed --rates 0 0.2 0.3 --methods lrmoe --cuda-graph --iters 8 \
    --warmup 3 --out "$work/bench" > "$work/bench_stdout.txt" 2>&1
  log "graph bench rc $?"
  cp "$work/bench/layer_bench.md" "$out/" 2>/dev/null
fi

if [[ "${TTL:-0}" == 1 ]]; then
  T="--preset gpu-small --device cuda --steps 300 --seeds 0 --eval-every 25 --prune-checkpoints"
  # shellcheck disable=SC2086
  (( $(left) > 60 )) && timeout -s INT "$(left)" "$py" experiments/time_to_loss.py $T \
    --jobs 1 --rates 0.3 --selection importance --targets 4.3 4.1 4.0 --out "$work/ttl" \
    > "$work/ttl_stdout.txt" 2>&1
  log "time to loss rc $?"
  cp "$work/ttl/report.md" "$out/ttl_report.md" 2>/dev/null
fi

[[ -f "$work/wordnet_alpaca.jsonl" ]] || gunzip -c "$SFT_DATA_GZ" > "$work/wordnet_alpaca.jsonl"
S="--preset gpu-small --device cuda --pretrain-steps 300 --sft-data $work/wordnet_alpaca.jsonl"
S="$S --sft-steps 200 --eval-every 20 --prune-checkpoints --jobs $jobs --out $work/sft"
[[ "${SFT:-1}" == 0 ]] && parts=() || parts=("lrm:topk lrm:importance|0.2 0.3" "random:topk|0.3" \
            "lrm:topk lrm:importance random:topk|0.2 0.3 0.5")
for part in "${parts[@]}"; do
  (( $(left) > 60 )) || break
  # shellcheck disable=SC2086  # seeds, settings and rates are words
  timeout -s INT "$(left)" "$py" experiments/sft.py $S --seeds $seeds \
    --settings ${part%|*} --rates ${part#*|} >> "$work/sft_stdout.txt" 2>&1
  log "sft rc $? (seeds $seeds, settings ${part%|*}, rates ${part#*|}; $(disk_free))"
done
# shellcheck disable=SC2086
"$py" experiments/sft.py --preset gpu-small --pretrain-steps 300 \
  --sft-steps 200 --seeds $seeds --out "$work/sft" --analyse-only > /dev/null 2>&1
pack sft "$work/sft"

from="${GRID_FROM:-experiments/results/gpu-small-300-steps.tar.gz}"
[[ -d "$work/grid" ]] || { mkdir -p "$work/grid" && [[ -f "$from" ]] && tar xzf "$from" -C "$work/grid"; }
A="--preset gpu-small --device cuda --steps 300 --seeds 0 1 2 --eval-every 25 --prune-checkpoints"
# shellcheck disable=SC2086
(( $(left) > 60 )) && timeout -s INT "$(left)" "$py" experiments/full_grid.py $A --jobs "$jobs" \
  --out "$work/grid" > "$work/grid_stdout.txt" 2>&1
log "grid rc $? ($(disk_free))"
# shellcheck disable=SC2086
"$py" experiments/full_grid.py $A --out "$work/grid" --analyse-only > /dev/null 2>&1
[[ -d "$work/ttl" ]] && { rm -rf "$work/grid/ttl"; cp -r "$work/ttl" "$work/grid/ttl"; }
pack grid "$work/grid"
log "done"
