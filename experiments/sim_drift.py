"""What popularity drift costs each policy in ``lrmoe sim`` (issue 30; docs/simulation.md,
"Popularity drift"): the same EP group simulated with ``--drift off`` and each given
drift over several seeds; per policy the mean per-layer fwd + bwd time (ms, simulated)
with its spread over the seeds, and SYMI's gap to UltraEP and LRMoE. ``symi_nolag`` is
the control: SYMI planned from each step's *own* loads (every step simulated alone, so
the simulator has no previous step to hand it), on the same loads: symi - symi_nolag is
what the one-step lag costs, apart from what drift does to the skew.

    python experiments/sim_drift.py --seeds 0 1 2 3 4 --drift off fitted 0.715,1.523 \\
        --steps 32 --layers 8 --out /tmp/sim-drift

``--drift counts:N`` replays the committed GCIDE counts (experiments/results/drift/
gcide-tiny-e32-counts.npz) from recorded step N (``lrmoe sim --counts FILE
--counts-start N``) instead of a synthetic drift. Its matched-skew controls
(``lrmoe sim --counts-control``, lrmoe.workload.loads.counts_popularity) keep each
step's recorded load multiset and change its persistence: ``counts-shuffled:N`` (each
step's expert ids permuted, seeded by the seed: no persistence), ``counts-frozen:N``
(step N repeated: its skew, a fixed popularity), ``counts-ranked:N`` (each step's own
loads in step N's ranking: the same skews, a fixed ranking).

Every run is ``lrmoe sim --costs configs/costs/h200.json --gpus 8 --steps S --layers L
--pressure --seed K --drift D --joint --ultraep-refine --spare-capacity-split ultraep
[--sim-args] --out OUT/D-K`` (no batch pressure: the per-layer figures only;
lrmoe.sim.report.FIGURE_FLAGS: LRMoE's joint plan, UltraEP refined, the all-to-alls
deduplicated over the model's top_k); the table is printed and written to
OUT/sim_drift.json (strict JSON: an interval of one seed is null).
"""
from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

import numpy as np

import analysis

from lrmoe import cli
from lrmoe.sim import report as R
from lrmoe.sim.costs import Costs
from lrmoe.sim.links import Links
from lrmoe.sim.report import FIGURE_FLAGS, run_sim, strict_json
from lrmoe.workload.loads import cluster_loads
from lrmoe.workload.shapes import MODELS

COUNTS = str(Path(__file__).resolve().parent / "results" / "drift" / "gcide-tiny-e32-counts.npz")
POLS = ("fixed", "ultraep", "symi", "lrmoe", "symi_nolag")


def symi_nolag(args) -> float:
    """Mean per-layer fwd + bwd (ms) of SYMI planning from each step's own loads: the
    loads of ``run_sim`` (same call of cluster_loads), one step per simulator call."""
    shape = MODELS[args.model]
    layers = args.layers or shape.moe_layers
    loads = cluster_loads(args.gpus, shape.num_experts, args.tokens_per_gpu, shape.top_k,
                          args.steps, layers, args.skew, args.trace, args.seed,
                          drift=args.drift_fit, counts=args.counts,
                          counts_start=args.counts_start, counts_control=args.counts_control)
    costs = Costs.from_file(args.costs, args.model)
    links = Links.from_file(args.links)
    t = []
    for s in range(args.steps):
        r = R._run(args, shape, costs, links, "symi", loads[s:s + 1])
        ok = r["feasible"] > 0  # as summarize: the mean over the plans that fit
        t.append((r["fwd_ms"] + r["bwd_ms"])[ok])
    return float(np.mean(np.concatenate(t)))


def drift_source(d: str) -> list:
    """The ``lrmoe sim`` flags of one ``--drift`` choice: ``counts:N`` (the committed GCIDE
    counts from recorded step N), ``counts-CONTROL:N`` (CONTROL one of shuffled, frozen,
    ranked: ``--counts-control``), else ``--drift d``.

    Raises:
        ValueError: a ``counts...`` choice with an unknown control or a start that is not
            an integer >= 0, naming ``--drift``.
    """
    if not d.startswith("counts"):
        return ["--drift", d]
    head, _, start = d.partition(":")
    control = head[len("counts-"):] if head.startswith("counts-") else "real"
    if head not in ("counts", "counts-shuffled", "counts-frozen", "counts-ranked") or \
            not start.isdigit():
        raise ValueError(f"--drift {d}: a counts replay is counts:N, counts-shuffled:N, "
                         "counts-frozen:N or counts-ranked:N with N the first recorded step "
                         "(an integer >= 0)")
    return ["--counts", COUNTS, "--counts-start", start, "--counts-control", control]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    ap.add_argument("--drift", nargs="+", default=["off", "fitted"])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--skew", type=float, default=2.0)
    ap.add_argument("--costs", default="configs/costs/h200.json")
    ap.add_argument("--out", default="experiments/results/sim_drift",
                    help="folder of the per-seed runs and the summary (default %(default)s)")
    ap.add_argument("--sim-args", default="", metavar="'FLAGS'",
                    help="more `lrmoe sim` flags, after the figures' own "
                         f"({' '.join(FIGURE_FLAGS)}; all-to-alls deduplicated over the "
                         "model's top_k), e.g. '--no-joint --dedup-top-k 1'; use another --out")
    a = ap.parse_args(argv)
    table = {}
    for d in a.drift:
        per, feas = {p: [] for p in POLS}, {}
        for k in a.seeds:
            src = drift_source(d)
            args = cli.build_parser().parse_args(
                ["sim", "--costs", a.costs, "--gpus", "8", "--steps", str(a.steps), "--layers",
                 str(a.layers), "--skew", str(a.skew), "--pressure", "--seed", str(k),
                 *src, "--threads", "1", *FIGURE_FLAGS, *shlex.split(a.sim_args),
                 "--out", f"{a.out}/{d.replace(',', '_').replace(':', '_')}-{k}"])
            out = run_sim(args)
            per["symi_nolag"].append(symi_nolag(args))
            for p in POLS[:-1]:
                s = out["policies"][p]
                per[p].append(s["fwd_ms"] + s["bwd_ms"])  # over its plans that fit
                feas.setdefault(p, []).append(s["feasible"])
        row = {p: dict(mean=float(np.mean(v)), std=float(np.std(v, ddof=1)) if len(v) > 1
                       else 0.0, seeds=v) for p, v in per.items()}
        row["feasible"] = {p: float(np.mean(v)) for p, v in feas.items()}
        for ref in ("ultraep", "lrmoe", "symi_nolag"):  # paired per seed
            gap = np.array(per["symi"]) / np.array(per[ref]) - 1
            row[f"symi_over_{ref}"] = dict(mean=float(gap.mean()),
                                           std=float(gap.std(ddof=1)) if len(gap) > 1 else 0.0)
        # The 95 % Student t interval of each mean (analysis.mean_interval; NaN with one
        # seed) beside the sd, which alone says nothing of the mean's error.
        for p, v in per.items():
            row[p]["lo"], row[p]["hi"] = analysis.mean_interval(v)[1:3]
        for ref in ("ultraep", "lrmoe", "symi_nolag"):
            gap = np.array(per["symi"]) / np.array(per[ref]) - 1
            row[f"symi_over_{ref}"]["lo"], row[f"symi_over_{ref}"]["hi"] = \
                analysis.mean_interval(gap.tolist())[1:3]
        table[d] = row
        print(f"--drift {d}: " + "  ".join(
            f"{p} {row[p]['mean']:.3f} +- {row[p]['std']:.3f} ({row[p]['lo']:.3f}-{row[p]['hi']:.3f})"
            for p in POLS)
            + f"  symi/ultraep-1 {100 * row['symi_over_ultraep']['mean']:+.2f} % "
            f"+- {100 * row['symi_over_ultraep']['std']:.2f}  symi/lrmoe-1 "
            f"{100 * row['symi_over_lrmoe']['mean']:+.2f} % +- "
            f"{100 * row['symi_over_lrmoe']['std']:.2f}  lag symi/symi_nolag-1 "
            f"{100 * row['symi_over_symi_nolag']['mean']:+.2f} % +- "
            f"{100 * row['symi_over_symi_nolag']['std']:.2f}  feasible "
            + " ".join(f"{p} {v:.2f}" for p, v in row["feasible"].items()))
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "sim_drift.json").write_text(strict_json(dict(args=vars(a), table=table),
                                                           indent=1) + "\n")
    return table


if __name__ == "__main__":
    main()
