"""Does hysteresis pay once a moved replica has a price? (issue 30; docs/simulation.md,
"Hysteresis and the price of a move"). Per drift, replica model and threshold, the mean
per-layer time of ultraep and lrmoe over several seeds, each threshold paired per seed
with the same seed's ``off`` run.

The layer's time here is fwd + bwd + broadcast (ms, simulated, over the plans that fit):
with ``--resident-replicas`` the refresh of every replica after the optimizer step is a
step term (``broadcast_ms``) that the kept and the moved placements pay alike, and the
moved replicas' fetch is inside fwd (``move_ms``); with streamed replicas broadcast is 0
(symi is left out: hysteresis does not apply to it; fixed has no replicas to move).

    python experiments/sim_hysteresis.py --seeds 0 1 2 --drift fitted counts:600 \\
        --out experiments/results/sim_hysteresis

Every run is ``lrmoe sim --costs configs/costs/h200.json --gpus 8 --steps S --layers L
--pressure --seed K --drift D [--resident-replicas] [--replan-threshold T]
--policies ultraep lrmoe`` with the figures' planner flags (lrmoe.sim.report.FIGURE_FLAGS;
lrmoe's joint plan with its derived replica cost). Writes OUT/sim_hysteresis.json
(strict JSON) and prints the table.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

import analysis

from lrmoe import cli
from lrmoe.sim.report import FIGURE_FLAGS, run_sim, strict_json

COUNTS = str(Path(__file__).resolve().parent / "results" / "drift" / "gcide-tiny-e32-counts.npz")
POLS = ("ultraep", "lrmoe")
THRESHOLDS = ("off", "0.02", "0.05", "0.1")


def _one(a, drift, seed, resident, t):
    src = (["--counts", COUNTS, "--counts-start", drift.split(":")[1]]
           if drift.startswith("counts:") else ["--drift", drift])
    tag = f"{drift.replace(',', '_').replace(':', '_')}-{'res' if resident else 'str'}-{t}-{seed}"
    argv = ["sim", "--costs", a.costs, "--gpus", "8", "--steps", str(a.steps), "--layers",
            str(a.layers), "--skew", str(a.skew), "--pressure", "--seed", str(seed), *src,
            "--threads", "2", *FIGURE_FLAGS, "--policies", *POLS, "--out", f"{a.out}/{tag}"]
    if resident:
        argv.append("--resident-replicas")
    if t != "off":
        argv += ["--replan-threshold", t]
    out = run_sim(cli.build_parser().parse_args(argv))
    return {p: out["policies"][p] for p in POLS}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--drift", nargs="+", default=["fitted", "counts:600"])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--skew", type=float, default=2.0)
    ap.add_argument("--costs", default="configs/costs/h200.json")
    ap.add_argument("--out", default="experiments/results/sim_hysteresis")
    a = ap.parse_args(argv)
    table = {}
    for d in a.drift:
        for resident in (False, True):
            runs = {t: [_one(a, d, k, resident, t) for k in a.seeds] for t in THRESHOLDS}
            key = f"{d} {'resident' if resident else 'streamed'}"
            table[key] = {}
            for p in POLS:
                ms = {t: [r[p]["fwd_ms"] + r[p]["bwd_ms"] + r[p]["broadcast_ms"] for r in runs[t]]
                      for t in THRESHOLDS}
                row = {}
                for t in THRESHOLDS:
                    gap = (np.array(ms[t]) / np.array(ms["off"]) - 1).tolist()
                    m, lo, hi, _ = analysis.mean_interval(ms[t])
                    gm, glo, ghi, _ = analysis.mean_interval(gap)
                    row[t] = dict(ms=m, lo=lo, hi=hi, seeds=ms[t], over_off=gm, over_off_lo=glo,
                                  over_off_hi=ghi,
                                  kept=float(np.mean([r[p].get("kept_previous", 0.0)
                                                      for r in runs[t]])),
                                  moved=float(np.mean([r[p].get("moved_replicas", 0.0)
                                                       for r in runs[t]])),
                                  move_ms=float(np.mean([r[p]["move_ms"] for r in runs[t]])),
                                  feasible=float(np.mean([r[p]["feasible"] for r in runs[t]])))
                    print(f"{key:28s} {p:8s} {t:5s} {m:8.4f} ({lo:.4f}-{hi:.4f})  vs off "
                          f"{100 * gm:+.3f} % ({100 * glo:+.3f} to {100 * ghi:+.3f})  kept "
                          f"{row[t]['kept']:.2f} moved/layer {row[t]['moved']:.2f} move_ms "
                          f"{row[t]['move_ms']:.4f} feasible {row[t]['feasible']:.2f}",
                          flush=True)
                table[key][p] = row
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "sim_hysteresis.json").write_text(
        strict_json(dict(args=vars(a), table=table), indent=1) + "\n")
    return table


if __name__ == "__main__":
    main()
