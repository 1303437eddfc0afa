#!/usr/bin/env bash
# Install lrmoe as a user would, and use it: build the sdist and the wheel from a clean
# checkout of HEAD (committed files only), install the wheel with its [all] extras into a
# fresh venv (the pins of requirements/base.txt as constraints, so the torch it runs is
# the one it was built against), then, from an empty folder with no repo on the path:
# lrmoe --version, lrmoe plan, lrmoe sim --steps 1 (the packaged cost and link files), a
# 3-step lrmoe train on a small text file, lrmoe export, and a check that the sdist holds
# every CUDA source and the package data.
#
# Usage: bash scripts/wheel_smoke.sh [WORKDIR]   (default: a new temporary folder, removed
# on success). Needs the repo's .venv (scripts/bootstrap.sh) for the build's torch.
# Environment: LRMOE_VENV as bootstrap.sh; MAX_JOBS for the compile.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VPY="${LRMOE_VENV:-$ROOT/.venv}/bin/python"
W="${1:-$(mktemp -d /tmp/lrmoe-wheel.XXXXXX)}"
log() { echo "[wheel] $*" >&2; }
now() { date +%s; }
T0=$(now)
[[ -x "$VPY" ]] || { log "error: $VPY missing; run scripts/bootstrap.sh first"; exit 1; }
mkdir -p "$W"

# ---- a clean checkout of HEAD, as CI or a user cloning the repository gets it
rm -rf "$W/src" && git -C "$ROOT" worktree prune
git clone -q --no-local "$ROOT" "$W/src"
cd "$W/src"

# ---- sdist: every source of the extension (CPU and CUDA) and the package data
"$VPY" setup.py -q sdist -d "$W/dist" > "$W/sdist.log" 2>&1 \
  || { tail -30 "$W/sdist.log" >&2; log "error: sdist failed"; exit 1; }
sdist=$(ls "$W"/dist/lrmoe-*.tar.gz)
want=$(git ls-files csrc lrmoe/configs | sort)
have=$(tar -tzf "$sdist" | sed 's|^[^/]*/||' | grep -E '^(csrc|lrmoe/configs)/' | grep -v '/$' | sort)
if [[ "$want" != "$have" ]]; then
  diff <(echo "$want") <(echo "$have") >&2 || true
  log "error: the sdist does not hold exactly the tracked csrc/ and lrmoe/configs/ files"
  exit 1
fi
log "sdist: $(basename "$sdist") holds all $(echo "$want" | wc -l) csrc/ and configs files"

# ---- wheel, against the venv's torch (the documented --no-build-isolation path)
t=$(now)
MAX_JOBS="${MAX_JOBS:-$(nproc 2>/dev/null || echo 2)}" "$VPY" -m pip wheel -q \
  --no-build-isolation --no-deps -w "$W/dist" . > "$W/wheel.log" 2>&1 \
  || { tail -30 "$W/wheel.log" >&2; log "error: pip wheel failed"; exit 1; }
whl=$(ls "$W"/dist/lrmoe-*.whl)
log "wheel: $(basename "$whl") in $(( $(now) - t )) s"

# ---- a fresh venv: the wheel and its extras, pinned like the repo's environment
t=$(now)
rm -rf "$W/venv" && "$VPY" -m venv "$W/venv"
U="$W/venv/bin"
"$U/python" -m pip install -q --disable-pip-version-check "${whl}[all]" \
  -c "$ROOT/requirements/base.txt" > "$W/install.log" 2>&1 \
  || { tail -30 "$W/install.log" >&2; log "error: pip install of the wheel failed"; exit 1; }
log "installed into a fresh venv in $(( $(now) - t )) s"

# ---- use it from an empty folder, no repo on the path
mkdir -p "$W/use" && cd "$W/use"
export PYTHONPATH= PYTHONNOUSERSITE=1
"$U/python" - "$ROOT" <<'EOF'
import sys
from pathlib import Path
import lrmoe
root = Path(sys.argv[1]).resolve()
where = Path(lrmoe.__file__).resolve()
assert root not in where.parents, f"lrmoe imported from the repo: {where}"
assert not any(Path(p or ".").resolve() == root for p in sys.path), "repo on sys.path"
print(f"[wheel] import lrmoe from {where.parent}", file=sys.stderr)
EOF
"$U/lrmoe" --version
"$U/lrmoe" plan --model qwen3-30b-a3b > plan.txt
costs=$("$U/python" -c "from importlib import resources; print(resources.files('lrmoe') / 'configs' / 'costs' / 'h200.json')")
"$U/lrmoe" sim --costs "$costs" --steps 1 --out sim > sim.txt
"$U/python" -c "
import random
random.seed(0)
words = 'the expert router sends each token to two of eight experts and trains them'.split()
open('text.txt', 'w').write('\n'.join(' '.join(random.choices(words, k=12)) for _ in range(400)))
"
"$U/lrmoe" train --steps 3 --data text:text.txt --out run --device cpu -c 0.3 \
  --set data.vocab_size=300 --set data.seq_len=32 --set data.batch_size=4 \
  --set model.max_position_embeddings=64 --set run.eval_every=0 --set run.eval_batches=1 \
  --set run.progress=none > train.txt
"$U/lrmoe" export run exported > export.txt
"$U/python" -c "
from transformers import AutoModelForCausalLM, AutoTokenizer
m = AutoModelForCausalLM.from_pretrained('exported'); t = AutoTokenizer.from_pretrained('exported')
print('[wheel] export loads in transformers:', type(m).__name__, len(t))"
log "ok in $(( $(now) - T0 )) s: version, plan, sim, train (3 steps), export from $whl"
[[ $# -ge 1 ]] || rm -rf "$W"
