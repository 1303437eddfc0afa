"""LRMoE's experts in torchtitan 0.3.0's own Trainer, end to end on the CPU: runs
``tools/titan_trainer_cpu.sh`` (torchrun, 2 gloo ranks: FSDP2 and EP 2 + FSDP2, a tiny
Qwen3 MoE, 10 steps a cell, LRMoE through ``--override.imports``, a DCP save at step 5 and
resume) and checks its summary. About 90 s on 2 CPU cores.

Skipped unless torchtitan and the trainer's extra imports (torchdata, HF datasets:
requirements/torchtitan-trainer.txt, not installed in CI) import; the script installs
nothing then (it finds them on sys.path via PYTHONPATH).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import datasets  # noqa: F401
    import torchdata  # noqa: F401
    import torchtitan  # noqa: F401
    SKIP = None
except ImportError as exc:
    SKIP = (f"torchtitan's trainer needs torchdata and datasets "
            f"(requirements/torchtitan-trainer.txt): {exc}")
pytestmark = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")

REPO = Path(__file__).resolve().parents[3]
FP32 = 2e-7  # fp32 rounding of a loss ~6 (1 ulp = 4.8e-7 / 6), after 10 AdamW steps


def test_titan_trainer_cpu(tmp_path):
    deps = [p for p in sys.path if p and (Path(p) / "torchdata").is_dir()]
    env = dict(os.environ, PYTHON=sys.executable, WORK=str(tmp_path),
               DEPS=deps[0] if deps else str(tmp_path / "deps"))
    proc = subprocess.run(["bash", str(REPO / "tools" / "titan_trainer_cpu.sh")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    c = summary["comparisons"]
    get = lambda prefix: next(v for k, v in c.items() if k.startswith(prefix))  # noqa: E731
    assert get("FSDP2 c=0 fp32") <= FP32
    assert get("EP2+FSDP2 c=0 fp32") <= FP32
    assert get("FSDP2 c=0.3 vs c=0 (bf16), step 1") == 0.0
    assert get("EP2+FSDP2 c=0.3 vs c=0 (fp32), step 1") == 0.0
    assert get("FSDP2 c=0.3 vs c=0 (bf16), all steps") > 0  # the backward changed
    assert get("DCP resume") == 0.0
    assert get("FSDP2 c=0 bf16") <= 1e-4  # bf16 experts, different rounding
    for layers in (summary["kept"]["fsdp_lrmoe_c03"], summary["kept"]["ep_lrmoe_c03"]):
        assert layers and all(0 < k < 256 for k in layers.values())
