"""Popularity drift of a real multi-step routing trace (issue 30; docs/simulation.md,
"Popularity drift"): per-step expert counts, TV distance at lags 1 / 5 / 20, the
sampling floor, lag-1 correlation of log-popularity per layer and window, and an AR(1)
fit of log-popularity on the last window (lrmoe.workload.drift.fit_ar1), the drift that
``lrmoe sim --drift fitted`` replays.

    LRMOE_GCIDE_DIR=/work/main/data/gcide lrmoe train --preset tiny \\
        --set model.num_experts=32 --set model.num_experts_per_tok=4 --steps 1200 \\
        --set run.trace_every=1 --set run.eval_every=200 --set run.checkpoints=false \\
        --set run.export=false --record-trace trace.npz --out runs/drift --device cpu
    python experiments/trace_drift.py trace.npz --windows 0 50 200 600 1200 \\
        --counts experiments/results/drift/gcide-tiny-e32-counts.npz \\
        --summary experiments/results/drift/gcide-tiny-e32-drift.json \\
        --fit lrmoe/configs/drift/gcide-tiny-e32.json

The counts file (int32 (S, Lyr, E) ``count_SLE``, ``steps_S``, ``layers_L``) is small
enough to commit; the trace itself (the (T, K) ids of every record) is not.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from lrmoe.workload.drift import drift_summary, fit_ar1, trace_counts


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", help="routing trace .npz (lrmoe train --record-trace), or a "
                    "counts .npz written by --counts")
    ap.add_argument("--windows", nargs="+", type=int, required=True,
                    help="window edges in recorded-step indices (e.g. 0 50 200 600 1200)")
    ap.add_argument("--min-count", type=float, default=32.0,
                    help="fit_ar1: series with a mean count >= this enter the fit")
    ap.add_argument("--counts", default=None, help="write the per-step counts here (.npz)")
    ap.add_argument("--summary", default=None, help="write the summary here (.json)")
    ap.add_argument("--fit", default=None, help="write the last window's fit here (.json)")
    ap.add_argument("--note", default="", help="provenance written into --fit and --summary")
    a = ap.parse_args(argv)
    d = np.load(a.trace)
    if "count_SLE" in d.files:
        steps, layers, count = d["steps_S"], d["layers_L"], d["count_SLE"].astype(np.int64)
    else:
        steps, layers, count = trace_counts(a.trace)
    edges = a.windows
    if len(edges) < 2 or edges != sorted(edges) or edges[-1] > len(steps) or edges[0] < 0:
        raise SystemExit(f"--windows must be increasing edges within [0, {len(steps)}], got "
                         f"{edges}")
    windows = list(zip(edges[:-1], edges[1:]))
    summ = drift_summary(count, steps, windows, min_count=a.min_count)
    last = windows[-1]
    fit = fit_ar1(count[last[0]:last[1]], min_count=a.min_count)
    out = dict(note=a.note, trace=str(a.trace), steps=len(steps), layers=layers.tolist(),
               experts=int(count.shape[2]), pairs_per_step=int(count[0, 0].sum()),
               windows=summ, fit=dict(phi=fit["phi"], sigma=fit["sigma"],
                                      jitter=fit["jitter"],
                                      window=[int(steps[last[0]]), int(steps[last[1] - 1])],
                                      min_count=a.min_count, detail=fit))
    for k, w in summ.items():
        print(f"window {k} (steps {w['steps'][0]}-{w['steps'][1]}): AR(1) phi "
              f"{w['ar1']['phi']:.3f} sigma {w['ar1']['sigma']:.3f} noise var "
              f"{w['ar1']['noise_var']:.4f} (predicted {w['ar1']['noise_var_predicted']:.4f}, "
              f"jitter {w['ar1']['jitter']:.3f})")
        for l, r in enumerate(w["layers"]):
            print("  layer %d: " % l + "  ".join(f"{n} {v:.3f}" for n, v in r.items()))
    print(f"fit (last window): phi {fit['phi']:.4f} sigma {fit['sigma']:.4f} jitter "
          f"{fit['jitter']:.4f}")
    if a.counts:
        Path(a.counts).parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(a.counts, count_SLE=count.astype(np.int32), steps_S=steps,
                            layers_L=layers)
    for path, obj in ((a.summary, out), (a.fit, dict(note=a.note, fit=out["fit"]))):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(json.dumps(obj, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
