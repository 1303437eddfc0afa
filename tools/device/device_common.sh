# Shared by the one-call device scripts (device_measure.sh, device_experiments.sh):
# sourced, not run. After `device_setup OUTDIR WORKDIR` the caller has: $out (absolute),
# $work, $py (PYTHON or python3), $t0, the environment of a CUDA build (LRMOE_CUDA=1,
# MAX_JOBS default 16, PYTHONPATH with the repo), log() (timestamped, tee'd to
# $out/log.txt), and device_build [ON_FAIL] (machine header, then the in-place build;
# on failure: the build log's tail in log.txt, ON_FAIL run, exit 1), and
# device_torchtitan_install (torchtitan from the wheels carried in .whl/, or exit 1).

device_setup() {
  out="$1"
  work="$2"
  cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
  mkdir -p "$out" "$work"
  out="$(cd "$out" && pwd)"
  py="${PYTHON:-python3}"
  export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" LRMOE_CUDA=1
  export MAX_JOBS="${MAX_JOBS:-16}"
  t0=$(date +%s)
}

log() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a "$out/log.txt"; }

device_build() {
  { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    "$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; } \
    >> "$out/log.txt" 2>&1
  "$py" setup.py build_ext --inplace > "$work/build.log" 2>&1 \
    || { tail -40 "$work/build.log" >> "$out/log.txt"; log "build FAILED"; ${1:-true}; exit 1; }
  log "build done"
}

# torchtitan and its four light dependencies from the wheels carried in .whl/
# (requirements/torchtitan.txt's pins; fetch them on a machine with an index:
# pip download --no-deps -d .whl -r requirements/torchtitan.txt), --no-deps into
# $work/site beside the image's torch, which stays; never triton: the CUDA torch brings
# its own. A torchtitan already importable is kept.
device_torchtitan_install() {
  local site="$work/site"
  if "$py" -c "import torchtitan" 2>/dev/null; then
    log "torchtitan already importable: $("$py" -c 'import torchtitan, os; print(os.path.dirname(torchtitan.__file__))')"
    return 0
  fi
  local wheels=(.whl/*.whl)
  [[ -e "${wheels[0]}" ]] || { log "no wheels in .whl/ (carry it; see device_common.sh)"; exit 1; }
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$site" "${wheels[@]}" > "$work/pip.log" 2>&1 \
    || { tail -20 "$work/pip.log" >> "$out/log.txt"; log "pip install FAILED"; exit 1; }
  export PYTHONPATH="$PYTHONPATH:$site"
  log "installed $(ls .whl | tr '\n' ' ')into $site"
}
