"""Figs. 7 (memory per MoE layer) and 8 (forward / backward time per MoE layer) of
``lrmoe sim`` over several seeds (issue 30; docs/simulation.md, "The paper's EP8 figures,
simulated"): per policy the mean over seeds with the 95 % Student t interval
(analysis.mean_interval) and the per-seed values. Simulated numbers.

    python experiments/sim_figs_seeds.py --seeds 0 1 2 3 4

Every run is ``lrmoe sim --costs C --steps S --seed K --joint --ultraep-refine
--spare-capacity-split ultraep [--sim-args] --out OUT/sK`` (lrmoe.sim.report.FIGURE_FLAGS:
LRMoE's joint plan, UltraEP refined, the all-to-alls deduplicated over the model's top_k,
the planner aware of the link file's nodes; the default simulator otherwise); an existing
OUT/sK/sim.json is read, not rerun. Markdown is printed and the summary written to
OUT/sim_figs_seeds.json (strict JSON: an interval of one seed is null).
"""
from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

import analysis
from lrmoe import cli
from lrmoe.sim.report import FIGURE_FLAGS, run_sim, strict_json

POLS = ("fixed", "ultraep", "symi", "lrmoe")
# sim.json key -> (column, scale): memory in bytes -> GiB, times already in ms.
FIELDS = {"memory_peak": ("Fig. 7 peak GiB", 2.0 ** -30),
          "memory_forward_tokens": ("Fig. 7 forward tokens GiB", 2.0 ** -30),
          "memory_backward_tokens": ("Fig. 7 backward tokens GiB", 2.0 ** -30),
          "fwd_ms": ("Fig. 8 forward ms", 1.0), "bwd_ms": ("Fig. 8 backward ms", 1.0)}


def one(args, seed: int) -> dict:
    """The ``policies`` block of one run's sim.json (run if absent)."""
    out = Path(args.out) / f"s{seed}"
    f = out / "sim.json"
    if not f.is_file():
        run_sim(cli.build_parser().parse_args(
            ["sim", "--costs", args.costs, "--steps", str(args.steps), "--seed", str(seed),
             *FIGURE_FLAGS, *shlex.split(args.sim_args), "--out", str(out)]))
    return json.loads(f.read_text())["policies"]


def summarize(runs: list, seeds: list) -> dict:
    """Per policy and field: per-seed values (GiB or ms), mean, and t interval lo / hi
    (NaN with one seed)."""
    out = {"seeds": list(seeds), "policies": {}}
    for p in POLS:
        out["policies"][p] = {}
        for k, (_, scale) in FIELDS.items():
            v = [float(r[p][k]) * scale for r in runs]
            m, lo, hi, _ = analysis.mean_interval(v)
            out["policies"][p][k] = dict(values=v, mean=m, lo=lo, hi=hi)
    return out


def table(s: dict) -> str:
    """Markdown: policy rows, one column per field, ``mean (lo-hi)``."""
    lines = ["| policy | " + " | ".join(c for c, _ in FIELDS.values()) + " |",
             "|---|" + "---|" * len(FIELDS)]
    for p in POLS:
        lines.append(f"| {p} | " + " | ".join(
            f"{s['policies'][p][k]['mean']:.2f} ({s['policies'][p][k]['lo']:.2f}-"
            f"{s['policies'][p][k]['hi']:.2f})" for k in FIELDS) + " |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--costs", default="configs/costs/h200.json")
    ap.add_argument("--out", default="experiments/results/sim_figs_seeds",
                    help="folder of the per-seed runs and the summary (default %(default)s)")
    ap.add_argument("--sim-args", default="", metavar="'FLAGS'",
                    help="more `lrmoe sim` flags, after the figures' own "
                         f"({' '.join(FIGURE_FLAGS)}; all-to-alls deduplicated over the "
                         "model's top_k), e.g. '--no-joint --no-ultraep-refine "
                         "--spare-capacity-split none --dedup-top-k 1' for the figures of "
                         "before the planner options were wired in; use another --out")
    args = ap.parse_args(argv)
    res = summarize([one(args, k) for k in args.seeds], args.seeds)
    print(table(res))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "sim_figs_seeds.json").write_text(strict_json(res, indent=1) + "\n")
    return res


if __name__ == "__main__":
    main()
