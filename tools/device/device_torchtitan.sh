#!/usr/bin/env bash
# lrmoe.integrations.torchtitan on a CUDA machine (the lent H200, torch 2.11 with its own
# triton, no package index): installs torchtitan and its four light dependencies from the
# wheels carried in .whl/ (requirements/torchtitan.txt's pins; fetch them on a machine
# with an index: pip download --no-deps -d .whl -r requirements/torchtitan.txt) with
# --no-deps into a target folder beside the image's torch, builds the extension with
# CUDA in place, and runs the torchtitan tests (GPU tests included) and the torchtitan
# baseline check of lrmoe bench. Logs go to $OUT (device tool) or ./titan-logs.
# Usage (device tool: carry [".whl"]): bash tools/device/device_torchtitan.sh [pytest args]
set -uo pipefail
source "$(dirname "$0")/device_common.sh"
device_setup "${OUT:-titan-logs}" "${WORK:-/tmp/lrmoe-titan}"
device_torchtitan_install
device_build
"$py" -c "import torch, triton, torchtitan; from lrmoe.integrations.torchtitan import require_torchtitan; require_torchtitan(); print('torch', torch.__version__, 'triton', triton.__version__)" \
  2>&1 | tee -a "$out/log.txt"
"$py" -m pytest -q -ra -p no:cacheprovider tests/python/integrations/test_torchtitan.py \
    "tests/python/bench/test_bench.py::test_torchtitan_moe_matches_lrmoe" "$@" 2>&1 \
  | tee "$out/pytest.log"
rc="${PIPESTATUS[0]}"
log "pytest exit $rc"
exit "$rc"
