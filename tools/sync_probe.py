"""Which calls synchronise the host with the GPU in a training step (issue 28).

Trains a preset for 5 steps with ``torch.cuda.set_sync_debug_mode(1)`` on during steps 3-4
(after warm-up) and writes every distinct synchronising call site (torch's warning and the
Python stack that led to it), most frequent first. Needs CUDA.

Usage: python tools/sync_probe.py RATE PRESET OUT_FILE [--set key=value ...]
  e.g. LRMOE_GCIDE_DIR=data/gcide python tools/sync_probe.py 0.5 gpu-small sync.txt
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback
import warnings

import torch

# run as a script from any directory: the repository's package first on the path
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lrmoe.training import train as T  # noqa: E402 (after the path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("rate", type=float)
    p.add_argument("preset")
    p.add_argument("out")
    p.add_argument("--set", action="append", default=[], dest="sets")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("tools/sync_probe.py needs a CUDA device")
    seen: dict = {}

    def record(message, category, filename, lineno, file=None, line=None):
        stack = "".join(traceback.format_stack(limit=16)[:-2])
        key = f"{message}"[:100] + "\n" + stack[-900:]
        seen[key] = seen.get(key, 0) + 1

    warnings.showwarning = record
    warnings.simplefilter("always")  # every occurrence, not the first per line

    def callback(trainer, step):
        if step in (2, 4):
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode(1 if step == 2 else 0)

    cfg = T.build_config(args.preset, sets=[
        f"lrmoe.recalibration_rate={args.rate}", "run.steps=5", "run.eval_every=0",
        "run.checkpoints=false", "run.export=false", "run.progress=none",
        f"run.out_dir=/tmp/sync-probe-{args.preset}-{args.rate}", *args.sets])
    T.train(cfg, overwrite=True, step_callback=callback)
    with open(args.out, "w") as f:
        f.write(f"{len(seen)} distinct synchronising call sites over steps 3-4 "
                f"({args.preset}, c = {args.rate})\n")
        for key, n in sorted(seen.items(), key=lambda kv: -kv[1]):
            f.write(f"\n=== {n} x\n{key}\n")
    print(f"{len(seen)} distinct synchronising call sites -> {args.out}")


if __name__ == "__main__":
    main()
