#!/usr/bin/env bash
# LRMoE's experts in torchtitan 0.3.0's own Trainer (torchtitan.train.main through
# tools/titan_trainer_cpu.py), end to end on the CPU: torchrun, 2 gloo ranks, FSDP2
# (dp_shard 2) and EP 2 + FSDP2, a tiny Qwen3 MoE, GCIDE text and a locally trained BPE
# tokenizer, LRMoE only through --override.imports. Compares per-step losses, then a
# DCP save at step 5 + resume. Prints a table and writes $WORK/summary.json.
#
#   bash tools/titan_trainer_cpu.sh            # PYTHON=... WORK=... DEPS=... STEPS=10
#
# Needs torch (CPU build is fine) + requirements/torchtitan.txt (+ torchtitan-triton.txt on
# a CPU torch) in $PYTHON's environment; installs requirements/torchtitan-trainer.txt
# (torchdata, datasets, ...) with --no-deps into $DEPS, never into that environment.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python}
WORK=${WORK:-/tmp/titan_trainer_cpu}
DEPS=${DEPS:-$WORK/deps}
STEPS=${STEPS:-10}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
mkdir -p "$WORK"
if ! PYTHONPATH="$DEPS" "$PYTHON" -c "import torchdata, datasets" 2>/dev/null; then
    "$PYTHON" -m pip install -q --no-deps --target "$DEPS" -r "$REPO/requirements/torchtitan-trainer.txt"
fi
export PYTHONPATH="$REPO:$REPO/tools:$DEPS"
"$PYTHON" "$REPO/tools/titan_trainer_cpu.py" prepare "$WORK/prep"

COMMON=(--module titan_trainer_cpu --config qwen3_moe_tiny_cpu
        --hf-assets-path "$WORK/prep/tokenizer" --dataloader.dataset-path "$WORK/prep/corpus"
        --training.steps "$STEPS")
LRMOE=lrmoe.integrations.torchtitan_override.lrmoe_moe
REF32=titan_trainer_cpu.fp32_grouped_experts
launch() {  # name nproc args...: one torchtitan run, losses to $WORK/name.jsonl
    local name=$1 nproc=$2; shift 2
    rm -rf "$WORK/$name" "$WORK/$name.jsonl"
    local t0=$SECONDS
    if ! TITAN_CPU_LOSS_LOG="$WORK/$name.jsonl" "$PYTHON" -m torch.distributed.run \
            --nproc-per-node "$nproc" "$REPO/tools/titan_trainer_cpu.py" "${COMMON[@]}" \
            --dump-folder "$WORK/$name" "$@" > "$WORK/$name.log" 2>&1; then
        echo "FAILED: $name (log: $WORK/$name.log)"; tail -30 "$WORK/$name.log"; exit 1
    fi
    echo "ran $name ($((SECONDS - t0)) s)"
}
# torchtitan's own seed checkpoint (1 rank, unsharded init): DTensor's random init has no
# CPU support (torch.cpu lacks set_rng_state), so an FSDP2-sharded init on the CPU would
# give every rank's shard the same values (experts e and e+4 identical, tied router rows).
launch seed 1 --checkpoint.enable --checkpoint.create_seed_checkpoint \
    --parallelism.data_parallel_shard_degree 1
CK=(--checkpoint.enable --checkpoint.initial_load_path "$WORK/seed/checkpoint/step-0"
    --checkpoint.interval 5)
EP=(--parallelism.expert_parallel_degree 2 --training.disable_cuda_graphs)
launch fsdp_titan_fp32 2 "${CK[@]}" --override.imports "$REF32"
launch fsdp_lrmoe_c0_fp32 2 "${CK[@]}" --override.imports "$LRMOE={\"recalibration_rate\": 0.0, \"expert_dtype\": \"input\"}"
launch fsdp_titan_bf16 2 "${CK[@]}"
launch fsdp_lrmoe_c0_bf16 2 "${CK[@]}" --override.imports "$LRMOE={\"recalibration_rate\": 0.0}"
launch fsdp_lrmoe_c03 2 "${CK[@]}" --override.imports "$LRMOE={\"recalibration_rate\": 0.3}"
launch ep_titan_fp32 2 "${CK[@]}" "${EP[@]}" --override.imports "$REF32"
launch ep_lrmoe_c0_fp32 2 "${CK[@]}" "${EP[@]}" --override.imports "$LRMOE={\"recalibration_rate\": 0.0, \"expert_dtype\": \"input\"}"
launch ep_lrmoe_c03 2 "${CK[@]}" "${EP[@]}" --override.imports "$LRMOE={\"recalibration_rate\": 0.3, \"expert_dtype\": \"input\"}"
# resume: a fresh dump folder holding only fsdp_lrmoe_c0_fp32's DCP checkpoint of step 5;
# torchtitan's CheckpointManager loads the latest step of its folder (before initial_load_path)
rm -rf "$WORK/fsdp_lrmoe_c0_fp32_resumed"; mkdir -p "$WORK/fsdp_lrmoe_c0_fp32_resumed/checkpoint"
cp -r "$WORK/fsdp_lrmoe_c0_fp32/checkpoint/step-5" "$WORK/fsdp_lrmoe_c0_fp32_resumed/checkpoint/"
rm -f "$WORK/fsdp_lrmoe_c0_fp32_resumed.jsonl"
TITAN_CPU_LOSS_LOG="$WORK/fsdp_lrmoe_c0_fp32_resumed.jsonl" "$PYTHON" -m torch.distributed.run \
    --nproc-per-node 2 "$REPO/tools/titan_trainer_cpu.py" "${COMMON[@]}" \
    --dump-folder "$WORK/fsdp_lrmoe_c0_fp32_resumed" "${CK[@]}" \
    --override.imports "$LRMOE={\"recalibration_rate\": 0.0, \"expert_dtype\": \"input\"}" \
    > "$WORK/fsdp_lrmoe_c0_fp32_resumed.log" 2>&1 || { echo "FAILED: resume"; exit 1; }
grep -q "Loading the checkpoint from $WORK/fsdp_lrmoe_c0_fp32_resumed/checkpoint/step-5" \
    "$WORK/fsdp_lrmoe_c0_fp32_resumed.log" || { echo "FAILED: resume did not load step 5"; exit 1; }
echo "ran fsdp_lrmoe_c0_fp32_resumed (from step 5)"

WORK="$WORK" "$PYTHON" - <<'PY'
import json, os
W = os.environ["WORK"]

def read(name):
    rows = [json.loads(l) for l in open(f"{W}/{name}.jsonl")]
    losses = {r["step"]: r["loss"] for r in rows if "loss" in r}
    diag = next((r for r in rows if "diagnostics" in r), {})
    return losses, diag

def maxrel(a, b, steps=None):
    steps = sorted(set(a) & set(b)) if steps is None else steps
    return max(abs(a[s] - b[s]) / abs(b[s]) for s in steps)

runs = {n: read(n) for n in ["fsdp_titan_fp32", "fsdp_lrmoe_c0_fp32", "fsdp_titan_bf16",
                             "fsdp_lrmoe_c0_bf16", "fsdp_lrmoe_c03", "ep_titan_fp32",
                             "ep_lrmoe_c0_fp32", "ep_lrmoe_c03",
                             "fsdp_lrmoe_c0_fp32_resumed"]}
L = {n: r[0] for n, r in runs.items()}
kept = {n: {k: v.get("num_retained") for k, v in r[1].get("diagnostics", {}).items()}
        for n, r in runs.items()}
pairs = {n: {k: v.get("num_pairs") for k, v in r[1].get("diagnostics", {}).items()}
         for n, r in runs.items()}
res = sorted(L["fsdp_lrmoe_c0_fp32_resumed"])
rows = [
    ("FSDP2 c=0 fp32: lrmoe vs torchtitan fp32 experts, max rel over steps",
     maxrel(L["fsdp_lrmoe_c0_fp32"], L["fsdp_titan_fp32"])),
    ("FSDP2 c=0 bf16: lrmoe vs untouched torchtitan (bf16 experts)",
     maxrel(L["fsdp_lrmoe_c0_bf16"], L["fsdp_titan_bf16"])),
    ("FSDP2 c=0.3 vs c=0 (bf16), step 1", maxrel(L["fsdp_lrmoe_c03"], L["fsdp_lrmoe_c0_bf16"], [1])),
    ("FSDP2 c=0.3 vs c=0 (bf16), all steps", maxrel(L["fsdp_lrmoe_c03"], L["fsdp_lrmoe_c0_bf16"])),
    ("EP2+FSDP2 c=0 fp32: lrmoe vs torchtitan fp32 experts",
     maxrel(L["ep_lrmoe_c0_fp32"], L["ep_titan_fp32"])),
    ("EP2+FSDP2 c=0.3 vs c=0 (fp32), all steps", maxrel(L["ep_lrmoe_c03"], L["ep_lrmoe_c0_fp32"])),
    ("EP2 torchtitan fp32 vs FSDP2 torchtitan fp32", maxrel(L["ep_titan_fp32"], L["fsdp_titan_fp32"])),
    ("EP2+FSDP2 c=0.3 vs c=0 (fp32), step 1", maxrel(L["ep_lrmoe_c03"], L["ep_lrmoe_c0_fp32"], [1])),
    (f"DCP resume at step 5 (steps {res[0]}-{res[-1]}) vs uninterrupted",
     maxrel(L["fsdp_lrmoe_c0_fp32_resumed"], L["fsdp_lrmoe_c0_fp32"], res)),
]
print(f"\n{'comparison':78s} max rel diff")
for name, v in rows:
    print(f"{name:78s} {v:.2e}")
print("\nlosses (fsdp_titan_fp32):", [round(L['fsdp_titan_fp32'][s], 6) for s in sorted(L['fsdp_titan_fp32'])])
print("pairs kept, last step (c=0.3):", kept["fsdp_lrmoe_c03"], "EP:", kept["ep_lrmoe_c03"],
      "of", pairs["fsdp_lrmoe_c03"])
json.dump({"comparisons": dict(rows), "losses": L, "kept": kept, "pairs": pairs,
           "corpus": open(f"{W}/prep/SOURCE").read().strip()},
          open(f"{W}/summary.json", "w"), indent=1)
print(f"wrote {W}/summary.json")
PY
