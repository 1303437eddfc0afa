"""What the ``lrmoe`` policy's balance target buys and costs, simulated (docs/simulation.md,
"The balance target").

    python experiments/sim_balance.py --costs configs/costs/h200.json --seeds 0 1 2 3 4 \
        --out experiments/results/sim_balance/sim_balance.json

For each cluster (W GPUs, synthetic per-layer max/mean expert load), the Qwen3-30B-A3B
layer at 32k tokens per GPU, 80 GiB with 64 GiB resident, 2 replica slots: UltraEP and
SYMI (exact backward), and ``lrmoe`` at c = 0.3 with the balance target off and at
slack 0 / 0.05 / 0.2 (``balance_slack``: aim at most (1 + slack) x the mean retained
rows per rank; the planner meets it with replicas, docs/planner.md). Printed per cell:
forward + backward ms per layer (mean over layers and steps; with several ``--seeds``
the mean and 95 % Student t interval over them), the fraction of routed pairs kept
(c = 0.3 alone keeps 0.70; below that the budget cut more) and the replicas per layer.
Every number is simulated.

The planner options are the figures' (``lrmoe sim``'s defaults,
lrmoe.sim.report.FIGURE_FLAGS): lrmoe's joint plan at the derived replica cost (kappa =
round(t_w / t_row) of each seed's loads, lrmoe.sim.simulate.derived_replica_cost_rows,
as ``lrmoe sim`` derives it; it ran at kappa = 0 before 2026-12-07), UltraEP's
refinement and spare-capacity split, the planner told the link file's node size, and the
all-to-alls deduplicated over the model's top_k. ``--legacy`` runs the sweep as it ran
before those (sequential lrmoe, unrefined UltraEP, flat planner, one row per pair).
``--out FILE`` also writes the cells as JSON.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from analysis import mean_interval
from lrmoe.sim import simulate as S
from lrmoe.sim.costs import Costs
from lrmoe.sim.links import Links
from lrmoe.sim.report import strict_json
from lrmoe.workload.loads import cluster_loads
from lrmoe.workload.shapes import SHAPES

GiB = 1 << 30
CLUSTERS = ((8, 2.0), (8, 4.0), (64, 2.0), (128, 2.0), (128, 8.0))
CELLS = (("ultraep", 0.0, None), ("symi", 0.0, None), ("lrmoe", 0.3, None),
         ("lrmoe", 0.3, 0.0), ("lrmoe", 0.3, 0.05), ("lrmoe", 0.3, 0.2))


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--costs", default="configs/costs/h200.json")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seeds", nargs="+", type=int, default=[0],
                   help="routing seeds (cluster_loads(seed=)); several: mean and 95 %% t "
                        "interval per cell")
    p.add_argument("--legacy", action="store_true",
                   help="the sweep before the figures' planner options and dedup")
    p.add_argument("--out", default=None, metavar="FILE.json")
    args = p.parse_args(argv)
    shape = SHAPES["qwen3-30b-a3b"]
    costs = Costs.from_file(args.costs, "qwen3-30b-a3b")
    links = Links.from_file()
    mem = S.memory_model(shape, 80 * GiB, 64 * GiB)
    many = len(args.seeds) > 1
    print("| GPUs | max/mean | policy | balance slack | fwd+bwd ms | kept | replicas | kappa |")
    print("|---|---|---|---|---|---|---|---|")
    cells = []
    for W, skew in CLUSTERS:
        loads = [cluster_loads(W, shape.num_experts, 32768, shape.top_k, args.steps,
                               args.layers, max_over_mean=skew, seed=k) for k in args.seeds]
        g = links.gpus_per_node
        for policy, c, slack in CELLS:
            opts = {} if args.legacy else dict(
                top_k=shape.top_k, joint=policy == "lrmoe",
                ultraep_refine=policy == "ultraep", spare_capacity_split=policy == "ultraep",
                gpus_per_node=g if g < W else None)  # as lrmoe.sim.report.planner_options
            per = dict(ms=[], kept=[], replicas=[], feasible=[], replica_cost_rows=[])
            for load in loads:
                # the joint plan's replica cost as lrmoe sim derives it from the run's
                # loads (lrmoe/sim/report.py _kappa); 0 where no joint plan reads it
                kappa = (S.derived_replica_cost_rows(shape, costs, links, load)
                         if opts.get("joint") else 0)
                r = S.simulate(load, policy, mem, costs, links, shape.hidden_size, c,
                               balance_slack=slack, threads=args.threads,
                               replica_cost_rows=kappa, **opts)
                per["replica_cost_rows"].append(int(kappa))
                per["ms"].append(float(np.nanmean(r["fwd_ms"] + r["bwd_ms"])))
                per["kept"].append(float(r["retained"].sum() / r["pairs"].sum()))
                per["replicas"].append(float(r["replicas"].mean()))
                per["feasible"].append(float(np.mean(r["feasible"])))
            cell = dict(gpus=W, skew=skew, policy=policy, rate=c, balance_slack=slack,
                        seeds=list(args.seeds), per_seed=per)
            for k, v in per.items():  # mean and 95 % Student t interval over the seeds
                if k == "replica_cost_rows":
                    cell[k] = v  # one per seed, as simulated
                    continue
                m, lo, hi, _ = mean_interval(v)
                cell[k] = dict(mean=m, lo=None if np.isnan(lo) else lo,
                               hi=None if np.isnan(hi) else hi)
            cells.append(cell)

            def fmt(k, d):
                x = cell[k]
                return (f"{x['mean']:.{d}f} ({x['lo']:.{d}f}-{x['hi']:.{d}f})" if many
                        else f"{x['mean']:.{d}f}")
            print(f"| {W} | {skew:g} | {policy} | {'off' if slack is None else slack} | "
                  f"{fmt('ms', 1)} | {fmt('kept', 3)} | {fmt('replicas', 1)} | "
                  f"{'/'.join(map(str, sorted(set(per['replica_cost_rows']))))} |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(strict_json(dict(args=vars(args), label="simulated",
                                                   cells=cells), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
