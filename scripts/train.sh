#!/usr/bin/env bash
# The main job: train a small Qwen3-MoE model with LRMoE layers on real text -- the `tiny`
# preset (a few minutes on 2 CPU cores) on GCIDE dictionary definitions, recalibration
# rate c = 0.3 with the LRM metric and importance selection (the defaults
# docs/training.md "Defaults, and why" gives the evidence for). Sets up what it needs first:
#   1. GCIDE (Debian package dict-gcide) when /usr/share/dictd/gcide.index is missing and
#      no --data is given (apt-get, as root);
#   2. the environment (scripts/bootstrap.sh: .venv, pinned packages, lrmoe._C, the
#      `lrmoe` console script);
# then runs `lrmoe train --preset tiny --recalibration-rate 0.3 --metric lrm "$@"` (into
# runs/tiny; an earlier run there is replaced unless --resume is given).
#
# Usage: bash scripts/train.sh [lrmoe train options]   e.g. --steps 200, --resume,
#        --preset gpu-small, --data alpaca:my.jsonl, --set optim.lr=1e-3, --tensorboard
#        (docs/training.md; README.md, "The main job")
# Environment: everything bootstrap.sh reads (LRMOE_VENV, PYTHON, MAX_JOBS, ...).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
log() { echo "[train.sh] $*" >&2; }
now() { date +%s; }
T0=$(now)

has_arg() {  # has_arg NAME ARGS...: NAME or NAME=... among ARGS
  local name="$1"; shift
  local a
  for a in "$@"; do [[ "$a" == "$name" || "$a" == "$name="* ]] && return 0; done
  return 1
}

if [[ ! -f /usr/share/dictd/gcide.index ]] && ! has_arg --data "$@"; then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    log "installing GCIDE (dict-gcide) with apt-get"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dict-gcide >/dev/null
  else
    log "error: GCIDE is missing (/usr/share/dictd/gcide.index); install it with" \
        "'sudo apt-get install dict-gcide', or train on your own data with --data alpaca:PATH"
    exit 1
  fi
fi

bash scripts/bootstrap.sh
LRMOE="${LRMOE_VENV:-$ROOT/.venv}/bin/lrmoe"
[[ -x "$LRMOE" ]] || { log "error: $LRMOE missing after bootstrap.sh"; exit 1; }

extra=()
has_arg --resume "$@" || extra+=(--overwrite)
cmd=(train --preset tiny --recalibration-rate 0.3 --metric lrm "${extra[@]}" "$@")
log "setup took $(( $(now) - T0 )) s; starting: lrmoe ${cmd[*]}"
rc=0
"$LRMOE" "${cmd[@]}" || rc=$?
log "finished in $(( $(now) - T0 )) s (exit $rc)"
exit $rc
