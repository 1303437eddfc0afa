"""Metric ablation: which pair score loses least (the paper's Table 2).

    python experiments/metric_ablation.py --preset tiny --steps 300 --seeds 0 1 2

Grid: c = 0 once per seed (the baseline), and every metric of ``--metrics`` (lrm, grad_sq,
grad_abs, random) at every rate of ``--rates`` (default 0.3) per seed. Report: dPPL per
(metric, rate) against c = 0 of the same seed, mean and spread over seeds, and
``metric_dppl.png``; and each other metric against ``lrm`` at the same rate and seed
(:func:`vs_lrm`: the paired difference that says whether lrm's lead is more than noise).
"""
from __future__ import annotations

import sys

import analysis
import plots
import recipe
from grid import Cell, default_cell_name

RECIPE = "metric_ablation"


def cells(args):
    """c = 0 per seed, then (metric, rate, seed)."""
    out = [Cell(default_cell_name(0, s), ["-c", "0", "--set", f"seed={s}"],
                {"metric": "none", "rate": 0.0, "seed": s}) for s in args.seeds]
    out += [Cell(default_cell_name(c, s) if (m, args.selection) == ("lrm", "topk")
                 else f"{m}-{args.selection}-c{c:g}-s{s}",
                 ["-c", f"{c:g}", "--metric", m, "--selection", args.selection,
                  "--set", f"seed={s}"],
                 {"metric": m, "rate": c, "seed": s})
            for c in args.rates for m in args.metrics for s in args.seeds]
    return out


COLUMNS = ["metric", "rate", "ppl", "ppl_sd", "dppl_pct", "dppl_pct_sd", "dppl_pct_lo",
           "dppl_pct_hi", "dppl_abs", "seeds"]


def vs_lrm(records, last_evals):
    """Every other metric's dPPL against ``lrm`` of the same rate and seed.

    Args:
        records: the recipe's run records (``labels``: metric, rate, seed).
        last_evals: evaluations averaged into each run's final perplexity.

    Returns:
        :func:`analysis.dppl_table` rows (``dppl_pct``: 100 x (ppl / ppl of lrm - 1), mean
        over the seeds with both runs, its 95 % t interval ``dppl_pct_lo`` / ``_hi``), lrm's
        own rows left out; none for a rate without an lrm run.
    """
    rows = []
    for c in sorted({r["labels"]["rate"] for r in records if r["labels"]["rate"] != 0}):
        at_c = [r for r in records if r["labels"]["rate"] == c]
        if any(r["labels"]["metric"] == "lrm" for r in at_c):
            rows += [r for r in analysis.dppl_table(
                at_c, ["metric", "rate"], lambda r: r["labels"]["metric"] == "lrm",
                last_evals) if r["metric"] != "lrm"]
    return rows


def analyse(records, out, args) -> str:
    rows = analysis.dppl_table(records, ["metric", "rate"],
                               lambda r: r["labels"]["rate"] == 0, args.last_evals)
    rows = [r for r in rows if r["rate"] != 0]
    plots.bars(rows, lambda r: f"{r['metric']} c={r['rate']:g}", "dppl_pct",
               "dppl_pct_sd", out / "metric_dppl.png", ylabel="dPPL vs c = 0 (%)",
               title=f"{args.preset}: dPPL per metric ({args.selection})")
    text = ("## Metric ablation\n\n" + analysis.markdown_table(rows, COLUMNS)
            + "\n\n![dPPL per metric](metric_dppl.png)")
    paired = vs_lrm(records, args.last_evals)
    if paired:
        text += ("\n\n## Against lrm (same rate and seed; dPPL > 0: worse than lrm)\n\n"
                 + analysis.markdown_table(paired, COLUMNS))
    return text


if __name__ == "__main__":
    p = recipe.parser(RECIPE, __doc__)
    p.add_argument("--metrics", nargs="+", default=["lrm", "grad_sq", "grad_abs", "random"])
    p.add_argument("--rates", type=float, nargs="+", default=[0.3])
    p.add_argument("--selection", default="topk")
    a = p.parse_args()
    if any(c <= 0 for c in a.rates):
        p.error("--rates are the dropping rates to compare (> 0); c = 0 always runs")
    sys.exit(recipe.main(RECIPE, a, cells(a), analyse))
