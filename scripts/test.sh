#!/usr/bin/env bash
# The whole test suite: environment (scripts/bootstrap.sh), the GoogleTests of the
# plain-C++ core (tests/cpp, through CMake and ctest), then pytest on tests/python
# (GPU tests run where CUDA is available and are skipped elsewhere).
# Exits non-zero if anything fails -- including pytest collecting no tests (exit 5).
#
# Usage: bash scripts/test.sh [extra pytest arguments]
# Environment: everything bootstrap.sh reads; LRMOE_SKIP_CPP=1 skips the GoogleTests,
# LRMOE_SKIP_WHEEL=1 the wheel smoke (scripts/wheel_smoke.sh).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VPY="${LRMOE_VENV:-$ROOT/.venv}/bin/python"
log() { echo "[test] $*" >&2; }
now() { date +%s; }
T0=$(now)

bash scripts/bootstrap.sh
JOBS="${MAX_JOBS:-$(nproc 2>/dev/null || echo 2)}"

# ---- GoogleTests (tests/cpp) ----------------------------------------------------------
cpp_rc=0
if [[ "${LRMOE_SKIP_CPP:-0}" != 1 ]]; then
  need=()
  command -v cmake >/dev/null 2>&1 || need+=(cmake)
  command -v g++ >/dev/null 2>&1 || need+=(g++)
  [[ -f /usr/include/gtest/gtest.h ]] || need+=(libgtest-dev)
  if (( ${#need[@]} )); then
    if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null 2>&1; then
      log "installing ${need[*]} with apt-get"
      apt-get update -qq
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
    else
      log "error: missing ${need[*]}; install them (Debian: apt-get install ${need[*]})"
      exit 1
    fi
  fi
  t=$(now)
  gen=()
  # Ninja when there is one (the venv has it), else CMake's default.
  if command -v ninja >/dev/null 2>&1 || [[ -x "$(dirname "$VPY")/ninja" ]]; then
    gen=(-G Ninja)
    command -v ninja >/dev/null 2>&1 || gen+=(-DCMAKE_MAKE_PROGRAM="$(dirname "$VPY")/ninja")
  fi
  # A build dir made by another generator cannot be reused: start it over.
  if [[ -f build/cpp/CMakeCache.txt ]] && \
     ! grep -q "CMAKE_GENERATOR:INTERNAL=${gen[1]:-Unix Makefiles}\$" build/cpp/CMakeCache.txt; then
    rm -rf build/cpp
  fi
  log "building GoogleTests (tests/cpp -> build/cpp)"
  if cmake -S tests/cpp -B build/cpp "${gen[@]}" > build/logs/cmake.log 2>&1 \
     && cmake --build build/cpp -j "$JOBS" >> build/logs/cmake.log 2>&1; then
    log "built in $(( $(now) - t )) s"
    (cd build/cpp && ctest --output-on-failure) || cpp_rc=$?
    log "GoogleTests $( ((cpp_rc == 0)) && echo passed || echo "FAILED (ctest exit $cpp_rc)" );" \
        "$(( $(now) - T0 )) s so far; now pytest"
  else
    tail -40 build/logs/cmake.log >&2
    log "error: GoogleTest build failed (log: build/logs/cmake.log)"
    cpp_rc=1
  fi
fi

# ---- install like a user (scripts/wheel_smoke.sh) ---------------------------------------
# sdist + wheel from a clean checkout of HEAD, a fresh venv, the commands from an empty
# folder; LRMOE_SKIP_WHEEL=1 skips it (a few minutes: the wheel compiles lrmoe._C anew)
wheel_rc=0
if [[ "${LRMOE_SKIP_WHEEL:-0}" != 1 ]]; then
  t=$(now)
  mkdir -p build/logs
  if bash scripts/wheel_smoke.sh > build/logs/wheel.log 2>&1; then
    log "wheel smoke passed in $(( $(now) - t )) s (log: build/logs/wheel.log)"
  else
    wheel_rc=1
    tail -30 build/logs/wheel.log >&2
    log "error: wheel smoke FAILED (log: build/logs/wheel.log)"
  fi
fi

# ---- pytest (tests/python) ------------------------------------------------------------
# On success pytest's summary line is the last line printed (CI reads the closing lines).
py_rc=0
"$VPY" -m pytest tests/python -q -ra "$@" || py_rc=$?
if (( cpp_rc != 0 || py_rc != 0 || wheel_rc != 0 )); then
  (( py_rc == 5 )) && log "error: pytest collected no tests in tests/python"
  log "FAILED: GoogleTests $( ((cpp_rc == 0)) && echo ok || echo "failed (ctest exit $cpp_rc)" )," \
      "wheel smoke $( ((wheel_rc == 0)) && echo ok || echo failed )," \
      "pytest $( ((py_rc == 0)) && echo ok || echo "failed (pytest exit $py_rc)" );" \
      "$(( $(now) - T0 )) s"
  exit 1
fi
