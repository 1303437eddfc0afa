"""Time to loss: steps, wall time and cumulative MoE-layer time to reach fixed validation
losses (the paper's Table 1), c = 0 against the rates of ``--rates``.

    python experiments/time_to_loss.py --preset gpu-small --device cuda --rates 0.2 0.3 \
        --targets 3.5 3.0 --seeds 0

The MoE-layer time is the ``moe_time_ms`` a run logs per step (the forward and backward
of the MoE layers only, timed with device events; ``experiments/analysis.py``); on a run
that did not log it the column is blank. Report: one row per (rate, target), mean and
spread over seeds, and ``time_to_loss.png``. Times come only from cells that ran alone on
the device (``--jobs 1``, the default; this recipe refuses more): a cell of a parallel
grid keeps its steps, its time columns are blank.
"""
from __future__ import annotations

import math
import sys

import analysis
import plots
import recipe
from grid import Cell, default_cell_name

RECIPE = "time_to_loss"


def cells(args):
    """(rate, seed) for c = 0 and each of ``--rates``."""
    rates = [0.0] + [c for c in args.rates if c != 0]
    return [Cell(default_cell_name(c, s) if (args.metric, args.selection) == ("lrm", "topk")
                 else f"{args.metric}-{args.selection}-c{c:g}-s{s}",
                 ["-c", f"{c:g}", "--metric", args.metric, "--selection",
                                  args.selection, "--set", f"seed={s}"],
                 {"rate": c, "seed": s}) for c in rates for s in args.seeds]


def _times_only_if_alone(hit, record):
    # jobs None: the runner's record of it is missing, so the cell may have shared the GPU
    jobs = record.get("jobs")
    if hit is not None and (jobs is None or jobs > 1):
        return {**hit, "wall_s": math.nan, "moe_s": math.nan}
    return hit


def analyse(records, out, args) -> str:
    rows = []
    for target in args.targets:
        for (rate,), runs in analysis.group(records, ["rate"]).items():
            # a cell that shared the device with others (grid --jobs > 1) has its steps,
            # not its times: those are of a shared GPU
            hits = [_times_only_if_alone(analysis.time_to_loss(r, target), r) for r in runs]
            reached = [h for h in hits if h is not None]
            row = {"target": target, "rate": rate, "reached": f"{len(reached)}/{len(runs)}"}
            for k in ("step", "wall_s", "moe_s"):
                m, sd, _ = analysis.mean_spread(h[k] for h in reached)
                row[k], row[k + "_sd"] = m, sd
            rows.append(row)
    base = {r["target"]: r for r in rows if r["rate"] == 0}
    for r in rows:
        b = base.get(r["target"])
        for k in ("wall_s", "moe_s"):
            ok = b and math.isfinite(r[k]) and math.isfinite(b[k]) and b[k] > 0
            r[k + "_vs_c0"] = r[k] / b[k] if ok else math.nan
    plots.bars(rows, lambda r: f"loss {r['target']:g} c={r['rate']:g}",
               "moe_s" if any(math.isfinite(r["moe_s"]) for r in rows) else "wall_s",
               "moe_s_sd" if any(math.isfinite(r["moe_s"]) for r in rows) else "wall_s_sd",
               out / "time_to_loss.png", ylabel="seconds to target (MoE layers, else wall)",
               title=f"{args.preset}: time to validation-loss targets")
    return ("## Time to loss\n\n" + analysis.markdown_table(
        rows, ["target", "rate", "reached", "step", "step_sd", "wall_s", "wall_s_sd",
               "wall_s_vs_c0", "moe_s", "moe_s_sd", "moe_s_vs_c0"])
        + "\n\n![time to loss](time_to_loss.png)")


if __name__ == "__main__":
    p = recipe.parser(RECIPE, __doc__)
    p.add_argument("--rates", type=float, nargs="+", default=[0.2, 0.3])
    p.add_argument("--targets", type=float, nargs="+", required=True,
                   help="validation-loss targets (nats per token)")
    p.add_argument("--metric", default="lrm")
    p.add_argument("--selection", default="topk")
    a = p.parse_args()
    bad = [t for t in a.targets if not (math.isfinite(t) and t > 0)]
    if bad:
        p.error(f"--targets must be finite validation losses > 0, got {bad}")
    if a.jobs != 1:
        p.error("--jobs must be 1 here: times measured on a shared device are not times to loss")
    sys.exit(recipe.main(RECIPE, a, cells(a), analyse))
