#!/usr/bin/env bash
# The runtime measurements of one GPU session, most needed first, each under its own time
# cap, so that a session cut short keeps what finished (docs/journal/performance.md records them):
#   1. the CUDA build (setup.py build_ext --inplace, LRMOE_CUDA=1; incremental when warm);
#   2. the GPU tests of the offload, the replicas (host syncs over NCCL at W = 1), the
#      CUDA-graph replay and the changed kernels;
#   3. `lrmoe calibrate --ep` (one torchrun process: the EP layer's own work too) ->
#      OUTDIR/costs.json (the simulator's cost file);
#   5. `lrmoe bench layer` at the Qwen3-30B-A3B and GLM-4.5-Air shapes, 32k tokens, skewed
#      routing, c in {0, 0.2, 0.3}: LRMoE eager and CUDA-graph rows, dropless, torchtitan
#      (where importable), with the per-method traces and where_time_goes;
#   4. experiments/offload_memory.py: gpu-small training with and without activation
#      offload at c = 0 and 0.3 (peak memory, tokens/s, bytes), and the Qwen3 layer
#      benchmark with and without offload.
# Usage: bash tools/device/device_measure.sh OUTDIR [STEPS]    (STEPS: offload train steps, 20)
# Writes at most 8 files: log.txt, costs.json, gpu_tests.txt, layer_bench.md,
# where_time_goes.md, offload_report.md, results.tar.gz (every json, the bench PNG and the
# offload runs' metrics), traces.tar.gz. Environment: PYTHON (python3), MAX_JOBS (16),
# CAP_TESTS / CAP_CALIBRATE / CAP_OFFLOAD / CAP_BENCH (seconds per step), GPU_TESTS (the
# test files), CAL_ITERS (calibration iterations per point), BENCH_METHODS (lrmoe dropless;
# torchtitan is added where importable), BENCH_ITERS.
set -uo pipefail
out_arg="${1:?usage: tools/device/device_measure.sh OUTDIR [STEPS]}"
steps="${2:-20}"
# shellcheck source=tools/device/device_common.sh
source "$(dirname "$0")/device_common.sh"
device_setup "$out_arg" "$(mktemp -d)"
pack() {  # everything so far into the two archives (re-made after each step)
  ( cd "$work" && tar czf "$out/results.tar.gz" --exclude='prof' --exclude='checkpoints' \
      --exclude='*.pt' --exclude='*.safetensors' . 2>/dev/null )
  [[ -d "$work/prof" ]] && ( cd "$work/prof" && tar czf "$out/traces.tar.gz" . )
  return 0
}

device_build pack

timeout "${CAP_TESTS:-120}" "$py" -m pytest -q -ra -p no:cacheprovider -m gpu \
  ${GPU_TESTS:-tests/python/moe/test_offload.py tests/python/parallel/test_replicas.py \
  tests/python/moe/test_layer_gpu.py tests/python/ops/test_cuda_ops_lrmoe.py \
  tests/python/ops/test_cuda_ops_movement.py} > "$out/gpu_tests.txt" 2>&1
log "gpu tests rc $? ($(grep -E 'passed|failed' "$out/gpu_tests.txt" | tail -1))"

timeout "${CAP_CALIBRATE:-240}" "$py" -m torch.distributed.run --nproc-per-node 1 \
  -m lrmoe calibrate --ep --device cuda --iters "${CAL_ITERS:-5}" --out "$out/costs.json" \
  > "$work/calibrate.txt" 2>&1
log "calibrate rc $?"
pack

timeout "${CAP_OFFLOAD:-220}" "$py" experiments/offload_memory.py --device cuda --steps "$steps" --prune-checkpoints \
  --bench-iters 5 \
  --out "$work/offload" > "$work/offload_stdout.txt" 2>&1
log "offload rc $?"
cp "$work/offload/report.md" "$out/offload_report.md" 2>/dev/null
pack
read -r -a methods <<< "${BENCH_METHODS:-lrmoe dropless}"
"$py" -c "import sys; from lrmoe.bench.baselines.torchtitan_moe import torchtitan_missing as m; \
sys.exit(m() is not None)" 2>/dev/null && methods+=(torchtitan)
timeout "${CAP_BENCH:-200}" "$py" -m lrmoe bench layer --shapes qwen3-30b-a3b glm-4.5-air \
  --tokens 32768 --routing skewed --rates 0 0.2 0.3 --methods "${methods[@]}" --cuda-graph \
  --iters "${BENCH_ITERS:-10}" --warmup 3 --profile-dir "$work/prof" --out "$work/bench" \
  > "$work/bench_stdout.txt" 2>&1
log "bench rc $? (methods ${methods[*]})"
cp "$work/bench/layer_bench.md" "$out/" 2>/dev/null
cp "$work/prof/where_time_goes.md" "$out/" 2>/dev/null
pack

log "done"
