"""Fig. 6 (batch pressure) of ``lrmoe sim`` over several seeds, per activation mode
(issue 30; docs/simulation.md, "Fig. 6 with the whole model's activations"): per batch
multiplier and policy the effective throughput relative to LRMoE's at the same multiplier
(LRMoE's time over the policy's, both at m x the base batch with the micro-batches each
needs) as mean +- sd over the seeds with the 95 % t interval (lo-hi), the micro-batch counts (min-max over seeds), and
the first multiplier at which a policy no longer fits in one pass. Simulated numbers.

    python experiments/sim_fig6_seeds.py --activations keep recompute --seeds 0 1 2 3 4 \\
        --out /tmp/fig6

Every run is ``lrmoe sim --costs configs/costs/h200.json --steps 1 --activations A
--resident-gib R --seed K --joint --ultraep-refine --spare-capacity-split ultraep
[--sim-args] --out OUT/A-rR-sK`` (lrmoe.sim.report.FIGURE_FLAGS: LRMoE's joint plan, UltraEP
refined, the all-to-alls deduplicated over the model's top_k; --steps only sizes Figs.
7/8; Fig. 6 draws its own 2 steps x 4 layers from the seed); an existing
OUT/.../sim.json is read, not rerun. The tables are printed as Markdown and written to
OUT/sim_fig6_seeds_rR.json (strict JSON: an interval of one seed is null).
"""
from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

import numpy as np

import analysis

from lrmoe import cli
from lrmoe.sim.report import FIGURE_FLAGS, run_sim, strict_json

POLS = ("fixed", "ultraep", "symi", "lrmoe")


def one(args, mode: str, seed: int) -> dict:
    """The ``pressure`` block of one run's sim.json (run if absent)."""
    out = Path(args.out) / f"{mode}-r{args.resident_gib:g}-s{seed}"
    f = out / "sim.json"
    if not f.is_file():
        run_sim(cli.build_parser().parse_args(
            ["sim", "--costs", args.costs, "--steps", "1", "--activations", mode,
             "--resident-gib", str(args.resident_gib), "--seed", str(seed), *FIGURE_FLAGS,
             *shlex.split(args.sim_args), "--out", str(out)]))
    return json.loads(f.read_text())["pressure"]


def summarize(runs: list) -> dict:
    """Per policy: rel (mean, sample sd) per multiplier, micro-batches (min, max), the first
    multiplier needing more than one pass per seed, and the activation GiB of LRMoE."""
    ms = [r["multiplier"] for r in runs[0]["policies"]["lrmoe"]]
    out = {"multipliers": ms, "policies": {}}
    for p in POLS:
        rel, micro, first = [], [], []
        for run in runs:
            rows, ref = run["policies"][p], run["policies"]["lrmoe"]
            rel.append([(b["time_ms"] / a["time_ms"]) if a["time_ms"] and b["time_ms"] else 0.0
                        for a, b in zip(rows, ref)])
            micro.append([a["micro_batches"] for a in rows])
            first.append(next((a["multiplier"] for a in rows if a["micro_batches"] != 1), None))
        rel, micro = np.array(rel), np.array(micro)
        out["policies"][p] = dict(rel_mean=rel.mean(0).tolist(), rel_sd=rel.std(0, ddof=1 if len(rel) > 1 else 0).tolist(),
                                  micro_min=micro.min(0).tolist(), micro_max=micro.max(0).tolist(),
                                  first_multi_pass=first)
        # The 95 % Student t interval of the mean per multiplier (analysis.mean_interval;
        # NaN with one seed), beside the sd: the sd alone says nothing of the mean's error.
        iv = [analysis.mean_interval(rel[:, j]) for j in range(rel.shape[1])]
        out["policies"][p]["rel_lo"] = [x[1] for x in iv]
        out["policies"][p]["rel_hi"] = [x[2] for x in iv]
    out["activation_GiB_lrmoe"] = [r["activation_GiB"] for r in runs[0]["policies"]["lrmoe"]]
    out["balanced_uncompressed_stops_fitting_at"] = [
        r["balanced_uncompressed_stops_fitting_at"] for r in runs]
    return out


def table(s: dict, show=None) -> str:
    """Markdown rows ``m | fixed | UltraEP | SYMI | LRMoE`` with [micro-batches]."""
    lines = ["| m | fixed | UltraEP | SYMI | LRMoE |", "|---|---|---|---|---|"]
    for j, m in enumerate(s["multipliers"]):
        if show is not None and m not in show:
            continue
        cells = []
        for p in POLS:
            v = s["policies"][p]
            lo, hi = v["micro_min"][j], v["micro_max"][j]
            mb = f"[{lo}]" if lo == hi else f"[{lo}-{hi}]"
            cells.append("1 " + mb if p == "lrmoe" else
                         f"{v['rel_mean'][j]:.3f} +- {v['rel_sd'][j]:.3f} "
                         f"({v['rel_lo'][j]:.3f}-{v['rel_hi'][j]:.3f}) {mb}")
        lines.append(f"| {m:g} | " + " | ".join(cells) + " |")
    lines.append("| first m not in one pass (per seed) | " + " | ".join(
        ", ".join("-" if x is None else f"{x:g}" for x in s["policies"][p]["first_multi_pass"])
        for p in POLS) + " |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--activations", nargs="+", default=["keep", "recompute"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    ap.add_argument("--resident-gib", type=float, default=64.0)
    ap.add_argument("--costs", default="configs/costs/h200.json")
    ap.add_argument("--out", default="experiments/results/sim_fig6_seeds",
                    help="folder of the per-seed runs and the summary (default %(default)s)")
    ap.add_argument("--sim-args", default="", metavar="'FLAGS'",
                    help="more `lrmoe sim` flags, after the figures' own "
                         f"({' '.join(FIGURE_FLAGS)}; all-to-alls deduplicated over the "
                         "model's top_k), e.g. '--no-joint --dedup-top-k 1'; use another --out")
    args = ap.parse_args(argv)
    res = {}
    for mode in args.activations:
        res[mode] = summarize([one(args, mode, s) for s in args.seeds])
        print(f"\n--activations {mode}, --resident-gib {args.resident_gib:g} (simulated; "
              f"LRMoE's activations {res[mode]['activation_GiB_lrmoe'][0]:.2f} GiB at 1x)")
        print(table(res[mode]))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"sim_fig6_seeds_r{args.resident_gib:g}.json").write_text(
        strict_json(res, indent=1) + "\n")
    return res


if __name__ == "__main__":
    main()
