"""The whole grid of docs/journal/experiments.md in one command: rate sweep, metric ablation,
selection and quota rule, adaptive rate; each cell once (recipes share cells by name).

    python experiments/full_grid.py --preset gpu-small --device cuda --steps 300 \
        --seeds 0 1 2 --eval-every 25 --prune-checkpoints --jobs 6 --out runs/exp

Cells run in a fixed order of importance, so that a grid cut short by a time limit has the
cells that decide the main conclusions first: c = 0, then lrm importance and lrm top-k at
c = 0.3, importance at c = 0.5, random at c = 0.3 (each over all seeds); then, seed by
seed (every setting once before any setting twice), the rest of the rate sweep, the other
metrics, the water-level quota rule at c = 0.3, the adaptive rate and the water-level rule
at c = 0.5. The
report (``report.md`` next to the runs) holds each recipe's section, as the recipes
themselves write them (``--analyse-only`` re-writes it from the runs).
"""
from __future__ import annotations

import argparse
import sys
from typing import List

import adaptive_rate
import metric_ablation
import rate_sweep
import recipe
import selection
from grid import Cell

RECIPE = "full_grid"
RATES = [0.0, 0.1, 0.2, 0.3, 0.5, 0.7]


def namespaces(args):
    """Each recipe's arguments as its own command line would set them."""
    common = vars(args)
    return {
        "rate_sweep": argparse.Namespace(**common, rates=RATES, metric="lrm",
                                         selection="topk"),
        "metric_ablation": argparse.Namespace(**common, metrics=["lrm", "grad_sq", "grad_abs",
                                                                 "random"],
                                              rates=[0.3], selection="topk"),
        "selection": argparse.Namespace(**common, selections=["topk", "importance"],
                                        quota_rules=["proportional", "water_level"],
                                        rates=[0.3, 0.5], metric="lrm"),
        "adaptive_rate": argparse.Namespace(**common, targets=[0.99], cap=0.5,
                                            selections=["topk", "importance"], metric="lrm"),
    }


#: Ranks of ``_first`` below this run over all seeds before the next rank starts.
DECIDING = 5


def _first(cell: Cell) -> int:
    """Rank of a cell's setting in the order of importance (the module docstring)."""
    n = cell.name
    order = [lambda: n.startswith("c0-"), lambda: n.startswith("lrm-importance-proportional-c0.3-"),
             lambda: n.startswith("c0.3-"), lambda: n.startswith("lrm-importance-proportional-c0.5-"),
             lambda: n.startswith("random-topk-c0.3-"), lambda: n[:1] == "c",
             lambda: "-topk-c0.3-" in n, lambda: "water_level-c0.3-" in n,
             lambda: "-rho" in n]
    return next((i for i, test in enumerate(order) if test()), len(order))


def cells(spaces) -> List[Cell]:
    """The union of the recipes' cells, each name once, in the order of importance."""
    seen, out = set(), []
    for mod, key in ((rate_sweep, "rate_sweep"), (metric_ablation, "metric_ablation"),
                     (selection, "selection"), (adaptive_rate, "adaptive_rate")):
        for c in mod.cells(spaces[key]):
            if c.name not in seen:
                seen.add(c.name)
                out.append(c)
    def key(cell: Cell):
        rank = _first(cell)
        return (0, rank, 0) if rank < DECIDING else (1, cell.labels.get("seed", 0), rank)
    return sorted(out, key=key)  # stable: seeds stay in order within a rank


def analyse_all(spaces):
    """An ``analyse`` for recipe.main that writes every recipe's section."""
    def analyse(records, out, args) -> str:
        by_name = {r["name"]: r for r in records}
        parts = []
        for mod, key in ((rate_sweep, "rate_sweep"), (metric_ablation, "metric_ablation"),
                         (selection, "selection"), (adaptive_rate, "adaptive_rate")):
            mine = [by_name[c.name] | {"labels": dict(c.labels)}
                    for c in mod.cells(spaces[key]) if c.name in by_name]
            parts.append(mod.analyse(mine, out, spaces[key]))
        return "\n\n".join(parts)
    return analyse


if __name__ == "__main__":
    p = recipe.parser(RECIPE, __doc__)
    a = p.parse_args()
    spaces = namespaces(a)
    sys.exit(recipe.main(RECIPE, a, cells(spaces), analyse_all(spaces)))
