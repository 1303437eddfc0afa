#!/usr/bin/env bash
# Set up a development environment in the repo root, idempotently:
#   1. .venv (created if missing) with the pinned packages of requirements/test.txt (and
#      requirements/torchtitan.txt, --no-deps);
#   2. the compiled extension lrmoe._C built in place (incrementally, with ninja);
#   3. a .pth file so that `import lrmoe` works from the venv anywhere, and the `lrmoe`
#      console script in the venv's bin/.
# A second run with nothing changed installs and compiles nothing (a few seconds).
#
# Usage: bash scripts/bootstrap.sh
# Environment:
#   PYTHON        interpreter to create the venv from (default: python3.11, else python3)
#   LRMOE_VENV    venv location (default: <repo>/.venv)
#   LRMOE_DEPS    pinned | system | auto (default auto)
#                   pinned: a plain venv with requirements/test.txt (torch==2.13.0; on our
#                           CPU machines pip takes its CPU build from disk);
#                   system: a venv that sees PYTHON's own packages (a GPU image whose
#                           python3 holds a CUDA torch and cannot reach a registry); only
#                           packages that are missing are installed, at their pins;
#                   auto:   system when PYTHON already imports a CUDA build of torch,
#                           else pinned.
#   MAX_JOBS      parallel compile jobs (default: number of cores)
#   LRMOE_CUDA, LRMOE_CUDA_ARCH   passed to setup.py (README.md, "Building for GPU")
#   LRMOE_SKIP_BUILD=1            set up the venv only
set -euo pipefail
shopt -s nullglob

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${LRMOE_VENV:-$ROOT/.venv}"
VPY="$VENV/bin/python"
LOGDIR="$ROOT/build/logs"
mkdir -p "$LOGDIR"
log() { echo "[bootstrap] $*" >&2; }
die() { echo "[bootstrap] error: $*" >&2; exit 1; }
now() { date +%s; }
T0=$(now)

# ---- interpreter and mode ------------------------------------------------------------
if [[ -z "${PYTHON:-}" ]]; then
  if command -v python3.11 >/dev/null 2>&1; then PYTHON=python3.11; else PYTHON=python3; fi
fi
command -v "$PYTHON" >/dev/null 2>&1 || die "no interpreter '$PYTHON'; install Python >= 3.10 or set PYTHON"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
  || die "$PYTHON is $("$PYTHON" -V 2>&1); lrmoe needs Python >= 3.10 (set PYTHON)"

MODE="${LRMOE_DEPS:-auto}"
if [[ "$MODE" == auto ]]; then
  if "$PYTHON" -c 'import sys, torch; sys.exit(torch.version.cuda is None)' >/dev/null 2>&1; then
    MODE=system
  else
    MODE=pinned
  fi
fi
[[ "$MODE" == pinned || "$MODE" == system ]] || die "LRMOE_DEPS must be pinned, system or auto; got '$MODE'"

# ---- venv ----------------------------------------------------------------------------
# A venv made here carries .lrmoe-mode; one made in the other mode is made anew. A venv
# made some other way (no marker) is used as it is.
if [[ -x "$VPY" && -f "$VENV/.lrmoe-mode" && "$(cat "$VENV/.lrmoe-mode")" != "$MODE" ]]; then
  log "venv was made for LRMOE_DEPS=$(cat "$VENV/.lrmoe-mode"), now $MODE: recreating $VENV"
  rm -rf "$VENV"
fi
if [[ ! -x "$VPY" ]]; then
  log "creating $VENV from $("$PYTHON" -V 2>&1) ($MODE packages)"
  venv_args=()
  [[ "$MODE" == system ]] && venv_args+=(--system-site-packages)
  venv_err="$(mktemp)"
  if ! "$PYTHON" -m venv "${venv_args[@]}" "$VENV" 2>"$venv_err"; then
    # Debian's own python3 needs the python3-venv package for ensurepip.
    if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null 2>&1; then
      log "venv failed; installing python3-venv with apt-get"
      rm -rf "$VENV"
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
      "$PYTHON" -m venv "${venv_args[@]}" "$VENV"
    else
      cat "$venv_err" >&2; die "could not create $VENV"
    fi
  fi
  rm -f "$venv_err"
  if [[ "$MODE" == system ]]; then
    # When PYTHON is itself a venv (the GPU image's /opt/torch/.venv), --system-site-packages
    # reaches only its base interpreter: add PYTHON's own site-packages explicitly.
    "$PYTHON" - "$VENV" <<'PY'
import os, site, sys, sysconfig
venv = sys.argv[1]
if sys.prefix != sys.base_prefix:
    dirs = [d for d in site.getsitepackages() if os.path.isdir(d)]
    target = sysconfig.get_paths(vars={"base": venv, "platbase": venv})["purelib"]
    with open(os.path.join(target, "zz_lrmoe_system_site.pth"), "w") as f:
        f.write("import site; " + "; ".join(f"site.addsitedir({d!r})" for d in dirs) + "\n")
PY
  fi
  echo "$MODE" > "$VENV/.lrmoe-mode"
fi
SITE="$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"

# ---- packages --------------------------------------------------------------------------
# Fast path: the requirements, mode and interpreter are those installed last time.
STAMP="$VENV/.lrmoe-deps.sha256"
want="$( { echo "$MODE"; "$VPY" -VV; cat requirements/base.txt requirements/test.txt \
          requirements/torchtitan.txt requirements/torchtitan-triton.txt; } | sha256sum | cut -d' ' -f1)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  log "packages up to date ($MODE)"
else
  t=$(now)
  if [[ "$MODE" == pinned ]]; then
    log "installing pinned packages (requirements/test.txt; a minute or two the first time)"
    "$VPY" -m pip install --disable-pip-version-check --no-input -r requirements/test.txt \
        > "$LOGDIR/pip.log" 2>&1 \
      || { tail -40 "$LOGDIR/pip.log" >&2; die "pip install failed (log: $LOGDIR/pip.log)"; }
  else
    "$VPY" -c 'import torch' 2>/dev/null || die "LRMOE_DEPS=system but $PYTHON has no torch"
    # Only what the interpreter lacks, at its pin; never torch (the image's CUDA torch is
    # the point of this mode).
    missing="$("$VPY" - <<'PY'
import importlib.util, re
modules = {"numpy": "numpy", "ninja": "ninja", "setuptools": "setuptools", "wheel": "wheel",
           "pyyaml": "yaml", "safetensors": "safetensors", "tokenizers": "tokenizers",
           "transformers": "transformers", "tqdm": "tqdm", "rich": "rich",
           "matplotlib": "matplotlib", "pytest": "pytest"}
pins = {}
for path in ("requirements/base.txt", "requirements/test.txt"):
    for line in open(path):
        m = re.match(r"([A-Za-z0-9_.-]+)==(\S+)", line.strip())
        if m:
            pins[m.group(1).lower()] = m.group(0)
print(" ".join(pins[n] for n, mod in modules.items() if importlib.util.find_spec(mod) is None))
PY
)"
    if [[ -n "$missing" ]]; then
      log "installing missing packages: $missing"
      # shellcheck disable=SC2086
      "$VPY" -m pip install --disable-pip-version-check --no-input $missing \
          > "$LOGDIR/pip.log" 2>&1 \
        || { tail -40 "$LOGDIR/pip.log" >&2; die "pip install failed (log: $LOGDIR/pip.log)"; }
    fi
  fi
  # torchtitan (lrmoe.integrations.torchtitan, the bench baseline): --no-deps, because its
  # declared requirements are its trainer's (requirements/torchtitan.txt); a CPU torch has
  # no triton, which torchtitan imports, so that one comes from torchtitan-triton.txt. The
  # GPU image (system mode) has no package index: tools/device/device_torchtitan.sh
  # installs carried wheels there instead.
  if [[ "$MODE" == pinned ]]; then
    log "installing torchtitan (requirements/torchtitan.txt, --no-deps)"
    titan=(-r requirements/torchtitan.txt)
    "$VPY" -c 'import triton' >/dev/null 2>&1 || titan+=(-r requirements/torchtitan-triton.txt)
    "$VPY" -m pip install --disable-pip-version-check --no-input --no-deps "${titan[@]}" \
        > "$LOGDIR/pip-torchtitan.log" 2>&1 \
      || { tail -40 "$LOGDIR/pip-torchtitan.log" >&2
           die "pip install of torchtitan failed (log: $LOGDIR/pip-torchtitan.log)"; }
  elif ! "$VPY" -c 'import torchtitan' >/dev/null 2>&1; then
    log "torchtitan not installed (system mode): its tests are skipped; see requirements/torchtitan.txt"
  fi
  echo "$want" > "$STAMP"
  log "packages installed in $(( $(now) - t )) s"
fi

# Make the checkout importable from the venv (like an editable install, without pip).
echo "$ROOT" > "$SITE/lrmoe-checkout.pth"
# The `lrmoe` console script ([project.scripts] in pyproject.toml), written as pip would.
printf '#!%s\nimport sys\nfrom lrmoe.cli import main\nsys.exit(main())\n' "$VPY" > "$VENV/bin/lrmoe"
chmod +x "$VENV/bin/lrmoe"

# ---- extension ------------------------------------------------------------------------
if [[ "${LRMOE_SKIP_BUILD:-0}" == 1 ]]; then
  log "LRMOE_SKIP_BUILD=1: not building lrmoe._C"
  exit 0
fi
# Rebuild when a source, header or setup.py is newer than the library, when a source
# file was added or removed, or when the torch build, the CUDA switches or the arch list
# changed (then from scratch: objects compiled against another torch must not be
# linked). torch's version is read without importing torch, to keep this path fast.
sos=(lrmoe/_C*.so)
so="${sos[0]:-}"
srcs=(csrc/ops/*.cpp csrc/ops/*.cu csrc/python/*.cpp)
src_list="$(printf '%s\n' "${srcs[@]}" | sha256sum | cut -d' ' -f1)"
BSTAMP="build/.lrmoe-build-stamp"
torch_id="$("$VPY" - <<'PY'
import importlib.metadata, importlib.util, os
loc = importlib.util.find_spec("torch").submodule_search_locations[0]
print(importlib.metadata.version("torch"), loc)
print(open(os.path.join(loc, "version.py")).read())
PY
)"
bwant="$(printf '%s\n%s|%s|%s\n' "$torch_id" "${LRMOE_CUDA:-auto}" "${LRMOE_CUDA_ARCH:-}" \
         "$(command -v nvcc || true)" | sha256sum | cut -d' ' -f1)"
reason=""
if [[ -z "$so" ]]; then
  reason="no lrmoe/_C*.so yet"
elif [[ "$(cat "$BSTAMP" 2>/dev/null || true)" != "$bwant" ]]; then
  reason="torch or build switches changed: clean build"
  rm -rf build/temp.* build/lib.* lrmoe/_C*.so
elif [[ -n "$(find csrc setup.py -newer "$so" \( -name '*.cpp' -o -name '*.cu' -o -name '*.h' \
              -o -name '*.cuh' -o -name setup.py \) -print -quit)" ]]; then
  reason="sources changed"
elif [[ "$(cat build/.lrmoe-sources 2>/dev/null || true)" != "$src_list" ]]; then
  reason="source files added or removed"
fi
if [[ -z "$reason" ]]; then
  log "lrmoe._C up to date ($so)"
else
  export MAX_JOBS="${MAX_JOBS:-$(nproc 2>/dev/null || echo 2)}"
  log "building lrmoe._C ($reason; MAX_JOBS=$MAX_JOBS; log: build/logs/build.log)"
  t=$(now)
  # --force: the checks above already decided; ninja still recompiles only the objects
  # whose sources or headers changed (setuptools alone misses header-only edits).
  if ! "$VPY" setup.py build_ext --inplace --force > "$LOGDIR/build.log" 2>&1; then
    grep -E "error" "$LOGDIR/build.log" | head -30 >&2 || true
    tail -30 "$LOGDIR/build.log" >&2
    die "extension build failed (full log: $LOGDIR/build.log)"
  fi
  echo "$bwant" > "$BSTAMP"
  echo "$src_list" > build/.lrmoe-sources
  sos=(lrmoe/_C*.so)
  log "built ${sos[0]:-?} in $(( $(now) - t )) s"
fi
versions="$("$VPY" -c 'import torch, lrmoe.ops; print("torch", torch.__version__, "cuda", torch.version.cuda)' \
            2>"$LOGDIR/import.log")" \
  || { cat "$LOGDIR/import.log" >&2; die "'import lrmoe.ops' fails (stale build? rm -rf build lrmoe/_C*.so)"; }
log "ready in $(( $(now) - T0 )) s: $VPY ($versions)"
