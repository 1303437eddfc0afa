"""What the ``lrmoe`` policy's balance target buys and costs, simulated (docs/simulation.md,
"The balance target").

    python experiments/sim_balance.py --costs configs/costs/h200.json

For each cluster (W GPUs, synthetic per-layer max/mean expert load), the Qwen3-30B-A3B
layer at 32k tokens per GPU, 80 GiB with 64 GiB resident, 2 replica slots: UltraEP and
SYMI (exact backward), and ``lrmoe`` at c = 0.3 with the balance target off and at
slack 0 / 0.05 / 0.2 (``balance_slack``: aim at most (1 + slack) x the mean retained
rows per rank; the planner meets it by cutting demand first, then replicas,
docs/planner.md). Printed per cell: forward + backward ms per layer (mean over layers
and steps), the fraction of routed pairs kept (c = 0.3 alone keeps 0.70; below that the
target cut more) and the replicas per layer. Every number is simulated.
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

import numpy as np

from lrmoe.sim import simulate as S
from lrmoe.sim.costs import Costs
from lrmoe.sim.links import Links
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
    args = p.parse_args(argv)
    shape = SHAPES["qwen3-30b-a3b"]
    costs = Costs.from_file(args.costs, "qwen3-30b-a3b")
    links = Links.from_file()
    mem = S.memory_model(shape, 80 * GiB, 64 * GiB)
    print("| GPUs | max/mean | policy | balance slack | fwd+bwd ms | kept | replicas |")
    print("|---|---|---|---|---|---|---|")
    for W, skew in CLUSTERS:
        load = cluster_loads(W, shape.num_experts, 32768, shape.top_k, args.steps,
                               args.layers, max_over_mean=skew, seed=0)
        for policy, c, slack in CELLS:
            r = S.simulate(load, policy, mem, costs, links, shape.hidden_size, c,
                           balance_slack=slack, threads=args.threads)
            ms = float(np.nanmean(r["fwd_ms"] + r["bwd_ms"]))
            kept = float(r["retained"].sum() / r["pairs"].sum())
            print(f"| {W} | {skew:g} | {policy} | {'off' if slack is None else slack} | "
                  f"{ms:.1f} | {kept:.3f} | {float(r['replicas'].mean()):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
