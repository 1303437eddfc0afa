"""The adaptive rate: a retained-mass target rho* instead of a fixed rate c (beyond the
paper; docs/training.md "Options", ``--retained-mass-target``).

    python experiments/adaptive_rate.py --preset tiny --steps 300 --seeds 0 1 2
    python experiments/adaptive_rate.py --preset gpu-small --device cuda --targets 0.99 \
        --selections topk importance --cap 0.5

Grid: c = 0 per seed, and (selection, target rho*) per seed, each run with ``-c CAP
--retained-mass-target RHO`` (per layer and step the most pairs are dropped, at most the
cap, whose kept pairs still hold >= rho* of the score mass). Report: dPPL against c = 0 of
the same seed, and the dropping rate the target chose (mean over the run's logged steps of
``dropped_fraction``), mean and spread over seeds; ``adaptive_dppl.png``.
"""
from __future__ import annotations

import statistics
import sys

import analysis
import plots
import recipe
from grid import Cell, default_cell_name

RECIPE = "adaptive_rate"


def cell_name(metric: str, selection: str, target: float, cap: float, seed: int) -> str:
    """The name every recipe gives the adaptive cell (experiments/full_grid.py shares it)."""
    return f"{metric}-{selection}-rho{target:g}-cap{cap:g}-s{seed}"


def cells(args):
    """c = 0 per seed, then (selection, target, seed)."""
    out = [Cell(default_cell_name(0, s), ["-c", "0", "--set", f"seed={s}"],
                {"selection": "none", "target": 1.0, "rate": 0.0, "seed": s})
           for s in args.seeds]
    out += [Cell(cell_name(args.metric, sel, t, args.cap, s),
                 ["-c", f"{args.cap:g}", "--retained-mass-target", f"{t:g}", "--metric",
                  args.metric, "--selection", sel, "--set", f"seed={s}"],
                 {"selection": sel, "target": t, "rate": args.cap, "seed": s})
            for sel in args.selections for t in args.targets for s in args.seeds]
    return out


def mean_dropped(record) -> float:
    """Mean ``dropped_fraction`` over the run's logged training steps (NaN if none)."""
    vals = [t["dropped_fraction"] for t in record.get("train") or []
            if t.get("dropped_fraction") is not None]
    return statistics.fmean(vals) if vals else float("nan")


def analyse(records, out, args) -> str:
    rows = analysis.dppl_table(records, ["selection", "target"],
                               lambda r: r["labels"]["rate"] == 0, args.last_evals)
    rows = [r for r in rows if r["selection"] != "none"]
    if not rows:  # no adaptive cell has finished: no empty table or figure
        return "## Adaptive rate\n\nNo adaptive cell has finished yet."
    for row in rows:
        runs = [r for r in records if r["labels"].get("selection") == row["selection"]
                and r["labels"].get("target") == row["target"] and r["summary"]]
        row["dropped"], row["dropped_sd"], _ = analysis.mean_spread(mean_dropped(r)
                                                                    for r in runs)
    plots.bars(rows, lambda r: f"{r['selection']} rho*={r['target']:g}", "dppl_pct",
               "dppl_pct_sd", out / "adaptive_dppl.png", ylabel="dPPL vs c = 0 (%)",
               title=f"{args.preset}: adaptive rate (cap c = {args.cap:g}, {args.metric})")
    return ("## Adaptive rate\n\n" + analysis.markdown_table(
        rows, ["selection", "target", "dropped", "dropped_sd", "ppl", "ppl_sd", "dppl_pct",
               "dppl_pct_sd", "dppl_pct_lo", "dppl_pct_hi", "seeds"])
        + "\n\n![adaptive rate](adaptive_dppl.png)")


def add_arguments(p) -> None:
    """This recipe's own options (experiments/full_grid.py reuses them)."""
    p.add_argument("--targets", type=float, nargs="+", default=[0.99],
                   help="retained-mass targets rho* in (0, 1]")
    p.add_argument("--cap", type=float, default=0.5, help="the largest rate a target may pick")
    p.add_argument("--selections", nargs="+", default=["topk", "importance"])
    p.add_argument("--metric", default="lrm")


def check(p, a) -> None:
    if not all(0 < t <= 1 for t in a.targets):
        p.error(f"--targets must lie in (0, 1], got {a.targets}")
    if not 0 < a.cap < 1:
        p.error(f"--cap must lie in (0, 1), got {a.cap}")


if __name__ == "__main__":
    p = recipe.parser(RECIPE, __doc__)
    add_arguments(p)
    a = p.parse_args()
    check(p, a)
    sys.exit(recipe.main(RECIPE, a, cells(a), analyse))
