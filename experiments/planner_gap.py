"""Each placement policy's gap to the exact optimum of the max rows per rank, over random
skewed instances at small sizes (docs/planner.md, "Lower bound and exact optimum").

    python experiments/planner_gap.py --instances 100

For each (W, E) in {4, 8} x {8, 16} and Zipf max/mean in {2, 4} (the synthetic loads of
`lrmoe plan`, lrmoe.workload.loads.synthetic_loads, `--pairs` per source rank, shuffled
over experts by the instance's seed), R = 2 replica slots, and a budget that never binds
(1 TiB: the gap is balance only), every policy plans the layer: fixed, ultraep, symi (its
previous step a second draw of the same popularity, as `lrmoe plan` does), lrmoe at c = 0
and at c = 0.3, both with the default balance target. The optimum is the exact one of the
instance (csrc/planner/exact.h, no memory): the smaller of the owners and free models'
optima (they hold every policy's placements), and for lrmoe's backward at c = 0.3 the
optimum of its own quotas. gap = policy's max rows per rank / optimum - 1; "optimal" is
the share of instances where gap = 0. Where a search stops at --max-nodes unproven, the
best placement it found stands in (an upper bound on the optimum, so the gap printed is
at most the true one); the count is printed.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Dict, List, Optional, Sequence

import numpy as np

from lrmoe.planner import plan as P
from lrmoe.workload.loads import synthetic_loads, trace_loads

# (row name, policy, c, joint): joint is lrmoe's one-objective refinement (csrc/planner/joint.h)
POLICIES = (("fixed", "fixed", 0.0, False), ("ultraep", "ultraep", 0.0, False),
            ("symi", "symi", 0.0, False), ("lrmoe c=0", "lrmoe", 0.0, False),
            ("lrmoe c=0.3", "lrmoe", 0.3, False), ("lrmoe joint c=0", "lrmoe", 0.0, True),
            ("lrmoe joint c=0.3", "lrmoe", 0.3, True), ("ultraep refined", "ultraep", 0.0, False))
MEMORY = P.MemoryModel(expert_weight_bytes=1, expert_grad_bytes=2, expert_optimizer_bytes=4,
                       forward_row_bytes=1, backward_row_bytes=1, budget_bytes=1 << 40,
                       resident_bytes=0)


def optimum(load: np.ndarray, slots: int, demand=None, max_nodes: int = 200_000):
    """(rows, proven): the instance optimum, min over the owners and free models."""
    pair = P.instance_optimum(load, slots, demand, max_nodes=max_nodes)
    return min(x.optimum for x in pair), all(x.proven for x in pair)


def cell(W: int, E: int, skew: float, n: int, pairs: int, slots: int, max_nodes: int,
         trace: Optional[str] = None) -> Dict:
    """Gaps of every policy over n instances of one (W, E, skew), or of a routing trace
    (``trace``: W x pairs / top_k tokens resampled from its records per seed)."""
    gaps: Dict[str, List[float]] = {name: [] for name, _, _, _ in POLICIES}
    gaps["lrmoe c=0.3 bwd"] = []
    gaps["lrmoe joint c=0.3 bwd"] = []
    unproven = 0
    for seed in range(n):
        if trace is not None:
            load, meta = trace_loads(trace, W, pairs // 2, seed=seed)
            prev, _ = trace_loads(trace, W, pairs // 2, seed=seed + 10_000)
        else:
            load = synthetic_loads(W, E, pairs, skew, seed=seed)
            prev = synthetic_loads(W, E, pairs, skew, seed=seed + 10_000, popularity_seed=seed)
        opt, proven = optimum(load, slots, max_nodes=max_nodes)
        unproven += not proven
        for name, policy, c, joint in POLICIES:
            p = P.plan(load, policy, MEMORY, recalibration_rate=c, replica_slots=slots,
                       previous_load_E=prev.sum(axis=0), joint=joint,
                       ultraep_refine=name == "ultraep refined")
            assert p.forward_bound <= opt <= p.max_forward_rows() or not proven, (name, seed)
            gaps[name].append(p.max_forward_rows() / opt - 1.0)
            if policy == "lrmoe" and c > 0:
                bopt, bproven = optimum(load, slots, p.quota_E.numpy(), max_nodes)
                unproven += not bproven
                gaps[name + " bwd"].append(p.max_backward_rows() / bopt - 1.0)
    return {"gaps": gaps, "unproven": unproven}


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--instances", type=int, default=100, help="random instances per cell")
    ap.add_argument("--pairs", type=int, default=4096, help="routed pairs per source rank")
    ap.add_argument("--slots", type=int, default=2, help="R, replica slots per rank (<= 2)")
    ap.add_argument("--max-nodes", type=int, default=200_000,
                    help="placements one exact search may visit")
    ap.add_argument("--ranks", default="4,8", help="W values, comma-separated (<= 8)")
    ap.add_argument("--experts", default="8,16", help="E values, comma-separated (<= 16)")
    ap.add_argument("--skews", default="2,4", help="Zipf max/mean values, comma-separated")
    ap.add_argument("--trace", default=None, metavar="PATH",
                    help="also a row per W from this routing trace (.npz of `lrmoe train "
                         "--record-trace`; its E must be <= 16 and a multiple of W)")
    args = ap.parse_args(argv)
    ints = lambda s, flag: [int(x) for x in s.split(",")]  # noqa: E731
    t0 = time.time()
    print(f"{args.instances} instances (seeds) per cell, {args.pairs} pairs per source rank, "
          f"R = {args.slots}, no memory limit; gap = max rows per rank / exact optimum - 1 "
          f"(mean, standard deviation and max over the seeds)\n")
    print("| W | E | loads | policy | mean gap | sd | max gap | optimal |")
    print("|---|---|---|---|---|---|---|---|")
    cells = [(W, E, f"Zipf {float(k):g}", float(k), None) for W in ints(args.ranks, "--ranks")
             for E in ints(args.experts, "--experts") for k in args.skews.split(",")]
    if args.trace:
        from lrmoe.workload.trace import load_trace
        E_tr = int(load_trace(args.trace)[0]["num_experts"])
        cells += [(W, E_tr, "trace", 0.0, args.trace) for W in ints(args.ranks, "--ranks")]
    for W, E, what, skew, trace in cells:
                r = cell(W, E, skew, args.instances, args.pairs, args.slots, args.max_nodes, trace)
                for name, g in r["gaps"].items():
                    g = np.asarray(g)
                    print(f"| {W} | {E} | {what} | {name} | {100 * g.mean():.2f} % | "
                          f"{100 * g.std():.2f} % | {100 * g.max():.2f} % | {(g <= 0).mean():.2f} |")
                if r["unproven"]:
                    print(f"| {W} | {E} | {what} | (searches stopped unproven: "
                          f"{r['unproven']}) | | | | |")
                sys.stdout.flush()
    print(f"\n{time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
