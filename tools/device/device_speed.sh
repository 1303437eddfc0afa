#!/usr/bin/env bash
# Layer speed on one GPU, in one command (after the CUDA build, e.g. by
# tools/device/device_gpu_tests.sh or `LRMOE_CUDA=1 python3 setup.py build_ext --inplace`):
#   1. the GPU tests of the speed work: CUDA-graph replay == eager bitwise, the profile
#      of the smoke shape, the layer against its references, select / dispatch_rows /
#      gather_rows against the CPU op;
#   2. `lrmoe bench layer` on the Qwen3-30B-A3B layer, 32k tokens, skewed routing: eager
#      and CUDA-graph rows for every rate, dropless and (where importable) torchtitan, with
#      the per-method Chrome traces and the "where the time goes" tables.
# Writes 8 files under OUTDIR: gpu_tests.txt, bench_stdout.txt, layer_bench.{json,md,png},
# where_time_goes.{md,json}, traces.tar.gz (the Chrome traces; open one in
# https://ui.perfetto.dev).
# Usage: bash tools/device/device_speed.sh OUTDIR     (PYTHON: interpreter, default python3)
# The torchtitan row needs torchtitan importable (PYTHONPATH, e.g. the /tmp/site of
# docs/journal/performance.md, "How to run the layer benchmark with the torchtitan baseline").
# At most ~9.5 minutes (tests 200 s, bench 360 s timeouts); typically a few.
# LRMOE_SPEED_SMOKE=1: the same on the CPU with the smoke shape and no CUDA graphs (to
# check the script itself; the GPU tests skip there).
set -uo pipefail
out="${1:?usage: tools/device/device_speed.sh OUTDIR}"
cd "$(dirname "$0")/../.."
mkdir -p "$out"
out="$(cd "$out" && pwd)"
py="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
work="$(mktemp -d)"
start=$(date +%s)

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  "$py" -c "import torch; print('torch', torch.__version__, torch.version.cuda)"
  timeout 200 "$py" -m pytest -q -ra -p no:cacheprovider tests/python/moe/test_layer_gpu.py \
      tests/python/ops/test_cuda_ops_lrmoe.py tests/python/ops/test_cuda_ops_movement.py \
      -k "graph or profile or layer or select or dispatch or gather"
  echo "pytest rc $? after $(( $(date +%s) - start )) s"; } > "$out/gpu_tests.txt" 2>&1

methods=(lrmoe dropless)
"$py" -c "import sys; from lrmoe.bench.baselines.torchtitan_moe import torchtitan_missing as m; \
sys.exit(m() is not None)" 2>/dev/null && methods+=(torchtitan)
case_args=(--shapes qwen3-30b-a3b --tokens 32768 --cuda-graph)
[[ "${LRMOE_SPEED_SMOKE:-0}" == 1 ]] && case_args=(--smoke --device cpu --rates 0 0.3)
timeout 360 "$py" -m lrmoe bench layer "${case_args[@]}" --routing skewed \
    --methods "${methods[@]}" --profile-dir "$work/prof" --out "$work/bench" \
    > "$out/bench_stdout.txt" 2>&1
rc=$?
echo "bench rc $rc after $(( $(date +%s) - start )) s" >> "$out/bench_stdout.txt"
cp "$work"/bench/layer_bench.{json,md,png} "$out"/ 2>/dev/null
cp "$work"/prof/where_time_goes.{md,json} "$out"/ 2>/dev/null
( cd "$work/prof" 2>/dev/null && tar czf "$out/traces.tar.gz" --exclude='where_time_goes.*' . )
rm -rf "$work"
tail -30 "$out/bench_stdout.txt"
grep -E "passed|failed|error" "$out/gpu_tests.txt" | tail -3
exit "$rc"
