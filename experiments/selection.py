"""Selection and quota rule: top-k (the paper's) against importance sampling (unbiased),
proportional against water-level quotas.

    python experiments/selection.py --preset tiny --steps 300 --seeds 0 1 2

Grid: c = 0 per seed, and (selection, quota rule, rate) for selection in ``--selections``
(topk, importance), quota rule in ``--quota-rules`` (proportional, water_level), rate in
``--rates`` (0.3, 0.5), metric ``--metric`` (lrm), per seed. Report: dPPL against c = 0 of
the same seed (mean and spread) and ``selection_dppl.png``.
"""
from __future__ import annotations

import sys

import analysis
import plots
import recipe
from grid import Cell, default_cell_name

RECIPE = "selection"


def cells(args):
    """c = 0 per seed, then (selection, quota rule, rate, seed)."""
    out = [Cell(default_cell_name(0, s), ["-c", "0", "--set", f"seed={s}"],
                {"selection": "none", "quota_rule": "none", "rate": 0.0, "seed": s})
           for s in args.seeds]
    out += [Cell(default_cell_name(c, s)
                 if (sel, q, args.metric) == ("topk", "proportional", "lrm")
                 else f"{args.metric}-{sel}-{q}-c{c:g}-s{s}",
                 ["-c", f"{c:g}", "--metric", args.metric, "--selection", sel,
                  "--quota-rule", q, "--set", f"seed={s}"],
                 {"selection": sel, "quota_rule": q, "rate": c, "seed": s})
            for c in args.rates for sel in args.selections for q in args.quota_rules
            for s in args.seeds]
    return out


def analyse(records, out, args) -> str:
    rows = analysis.dppl_table(records, ["selection", "quota_rule", "rate"],
                               lambda r: r["labels"]["rate"] == 0, args.last_evals)
    rows = [r for r in rows if r["rate"] != 0]
    plots.bars(rows, lambda r: f"{r['selection']} {r['quota_rule']} c={r['rate']:g}",
               "dppl_pct", "dppl_pct_sd", out / "selection_dppl.png",
               ylabel="dPPL vs c = 0 (%)",
               title=f"{args.preset}: dPPL per selection and quota rule ({args.metric})")
    return ("## Selection and quota rule\n\n" + analysis.markdown_table(
        rows, ["selection", "quota_rule", "rate", "ppl", "ppl_sd", "dppl_pct",
               "dppl_pct_sd", "dppl_pct_lo", "dppl_pct_hi", "seeds"])
        + "\n\n![dPPL per selection](selection_dppl.png)")


if __name__ == "__main__":
    p = recipe.parser(RECIPE, __doc__)
    p.add_argument("--selections", nargs="+", default=["topk", "importance"])
    p.add_argument("--quota-rules", nargs="+", default=["proportional", "water_level"])
    p.add_argument("--rates", type=float, nargs="+", default=[0.3, 0.5])
    p.add_argument("--metric", default="lrm")
    a = p.parse_args()
    if any(c <= 0 for c in a.rates):
        p.error("--rates are the dropping rates to compare (> 0); c = 0 always runs")
    sys.exit(recipe.main(RECIPE, a, cells(a), analyse))
