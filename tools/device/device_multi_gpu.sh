#!/usr/bin/env bash
# The multi-GPU runs (docs/simulation.md "Validation") on a host with N >= 2 GPUs: the
# NCCL expert-parallel tests at every EP size the host allows; the all-to-all of the node
# measured (lrmoe bench a2a -> links.yaml); the expert-parallel layer benchmark at EP = N
# (Qwen3-30B-A3B, 32k tokens per GPU, skewed routing, c = 0, 0.2, 0.3, every placement
# policy next to the EP dropless baseline); the simulator re-run on the measured links
# and checked against that benchmark (lrmoe sim --validate); and `lrmoe train --preset
# gpu-small` at EP = N for a few minutes at c = 0 and c = 0.3. Logs and results go to
# $OUT (device tool) or ./multi-gpu-logs. GCIDE: dict-gcide installed, or LRMOE_GCIDE_DIR
# set.
# Usage: bash tools/device/device_multi_gpu.sh [train seconds per run, default 240]
# POLICIES: the placement policies trained (default "none lrmoe"; all: none fixed
# ultraep symi lrmoe), each at c = 0 and 0.3.
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-multi-gpu-logs}"; mkdir -p "$out"
secs="${1:-240}"
n=$(python3 -c "import torch; print(torch.cuda.device_count())")
(( n >= 2 )) || { echo "needs at least 2 GPUs, torch sees $n"; exit 2; }
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" LRMOE_CUDA=1 \
       MAX_JOBS="${MAX_JOBS:-16}" KINETO_LOG_LEVEL=5
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
nvidia-smi topo -m >> "$out/gpu.txt" 2>&1
python3 setup.py build_ext --inplace > "$out/build.log" 2>&1 || { tail -50 "$out/build.log"; exit 1; }
launch=(python3 -m torch.distributed.run --nproc-per-node "$n" --master-addr 127.0.0.1)

python3 -m pytest tests/python/parallel/test_expert_parallel.py tests/python/bench/test_bench_ep.py -q -rA \
  -p no:cacheprovider -k nccl 2>&1 | tee "$out/nccl_tests.log" | grep -E "PASSED|FAILED|passed|failed"

"${launch[@]}" -m lrmoe bench a2a --out "$out/a2a" 2>&1 | grep -v USDT | tee "$out/a2a.log" | tail -3

"${launch[@]}" -m lrmoe bench layer --ep "$n" --shapes qwen3-30b-a3b --tokens 32768 \
  --routing skewed --rates 0 0.2 0.3 --policies none fixed ultraep symi lrmoe \
  --out "$out/bench-ep$n" 2>&1 | grep -v USDT | tee "$out/bench.log" | tail -16

python3 -m lrmoe sim --costs configs/costs/h200.json --links "$out/a2a/links.yaml" \
  --model qwen3-30b-a3b --gpus "$n" --validate "$out/bench-ep$n/layer_bench_ep.json" \
  --out "$out/sim-ep$n" 2>&1 | tee "$out/sim.log" | grep validate

for policy in ${POLICIES:-none lrmoe}; do
  flag=(); [[ "$policy" == none ]] || flag=(--policy "$policy")
  for c in 0 0.3; do
    run="train-ep$n-$policy-c$c"
    timeout -s INT "$secs" "${launch[@]}" -m lrmoe train --preset gpu-small --ep "$n" -c "$c" \
      "${flag[@]}" --steps 100000 --out "$out/$run" --overwrite --set progress=lines \
      --set log_every=10 --set eval_every=500 --set eval_batches=16 --set save_every=100000 \
      > "$out/$run.log" 2>&1
    echo "train $policy c=$c (stopped by timeout after $secs s, Ctrl-C: checkpoint saved)"
    grep -E "expert parallel|validation|tokens/s|peak|wall" "$out/$run.log" | tail -8
    rm -rf "$out/$run/checkpoints"  # gpu-small checkpoints are GBs; the logs stay
  done
done
