"""Rate sweep: validation perplexity against the recalibration rate c (the paper's Fig. 5).

    python experiments/rate_sweep.py --preset tiny --steps 300 --seeds 0 1 2
    python experiments/rate_sweep.py --preset gpu-small --device cuda --rates 0 0.2 0.3

Grid: c in ``--rates`` (default 0, 0.1, 0.2, 0.3, 0.5, 0.7) x ``--seeds``, metric
``--metric`` (lrm), selection ``--selection`` (topk). Report: final perplexity and dPPL
against c = 0 of the same seed (mean and spread over seeds; ``experiments/analysis.py``
defines them), and ``rate_curves.png`` (validation perplexity per rate).
"""
from __future__ import annotations

import sys

import analysis
import plots
import recipe
from grid import Cell, default_cell_name

RECIPE = "rate_sweep"


def cells(args):
    """One cell per (rate, seed)."""
    return [Cell(default_cell_name(c, s) if (args.metric, args.selection) == ("lrm", "topk")
                 else f"{args.metric}-{args.selection}-c{c:g}-s{s}",
                 ["-c", f"{c:g}", "--metric", args.metric,
                                  "--selection", args.selection, "--set", f"seed={s}"],
                 {"rate": c, "seed": s})
            for c in args.rates for s in args.seeds]


def analyse(records, out, args) -> str:
    rows = analysis.dppl_table(records, ["rate"], lambda r: r["labels"]["rate"] == 0,
                               args.last_evals)
    plots.curves(records, "rate", out / "rate_curves.png", label=lambda c: f"c={c:g}",
                 title=f"{args.preset}: validation perplexity per rate "
                       f"({args.metric}, {args.selection})")
    return ("## Rate sweep\n\n" + analysis.markdown_table(
        rows, ["rate", "ppl", "ppl_sd", "dppl_pct", "dppl_pct_sd", "dppl_pct_lo",
               "dppl_pct_hi", "dppl_abs", "seeds"])
        + "\n\n![rate curves](rate_curves.png)")


if __name__ == "__main__":
    p = recipe.parser(RECIPE, __doc__)
    p.add_argument("--rates", type=float, nargs="+", default=[0, 0.1, 0.2, 0.3, 0.5, 0.7])
    p.add_argument("--metric", default="lrm")
    p.add_argument("--selection", default="topk")
    a = p.parse_args()
    if 0 not in a.rates:
        p.error("--rates must include 0 (the baseline every dPPL is measured against)")
    sys.exit(recipe.main(RECIPE, a, cells(a), analyse))
