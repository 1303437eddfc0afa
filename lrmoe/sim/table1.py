"""Table 1 of the paper beside the simulator: steps to a validation loss (measured, per
seed, from experiments' results.json files) times each policy's simulated MoE time per
step (``lrmoe sim --results ... --targets ...``; docs/simulation.md, "Table 1").
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any, Dict, List, Sequence


def steps_to_loss(results: Sequence[str], target: float, rate: float) -> Dict[int, float]:
    """Per seed, the step at which the validation loss of the results.json cell at
    ``rate`` (default LRMoE metric, any selection label but random) first reaches
    ``target``, linearly interpolated between the two evaluations around the crossing
    (so a 25-step evaluation grid does not round every answer up to its next evaluation);
    a cell already at or below the target at its first evaluation gives that step.

    Args:
        results: results.json files (a list of cells, or ``{"cells": [...]}``); cells with
            the same seed in two files: the later file wins.
        target: validation loss (nats). rate: the cell's ``labels.rate``.

    Returns:
        {seed: step (float)} for the seeds that reach ``target``; a seed whose run never
        reaches it (or stopped before) is absent.
    """
    found: Dict[int, float] = {}
    for path in ([results] if isinstance(results, str) else results):
        cells = json.loads(Path(path).read_text())
        if isinstance(cells, dict):
            cells = cells.get("cells", [])
        for c in cells:
            lab = c.get("labels", {})
            if abs(float(lab.get("rate", -1)) - rate) > 1e-9 \
                    or lab.get("metric", "lrm") != "lrm" or lab.get("selection") == "random":
                continue
            ev = sorted((float(e["step"]), float(e["val_loss"])) for e in c.get("evals", []))
            seed = int(lab.get("seed", 0))
            found.pop(seed, None)
            for i, (step, loss) in enumerate(ev):
                if loss <= target:
                    if i == 0:
                        found[seed] = step
                    else:
                        (s0, l0) = ev[i - 1]
                        found[seed] = s0 + (step - s0) * (l0 - target) / (l0 - loss)
                    break
    return found


def table1(results: Sequence[str], targets: List[float], rate: float, pol: dict) -> List[dict]:
    """Table 1: per target loss, the steps to it (measured, :func:`steps_to_loss`, per
    seed) times each policy's simulated MoE minutes per step: baselines take c = 0's
    steps, LRMoE the steps at ``rate``; a policy whose plans do not all fit is charged its
    micro-batched time (``moe_ms_per_step_microbatched``).

    Returns:
        One dict per target: ``steps_c0`` / ``steps_rate`` (means over the seeds that
        reach the target, None if none does), ``seeds_c0`` / ``seeds_rate`` (those seeds),
        per policy the mean minutes (None: unreached or infeasible), and
        ``lrmoe_over_<policy>``: LRMoE's minutes over that baseline's, paired by seed
        (seeds that reach the target at both c), as {mean, min, max, n}.
    """
    rows = []
    for t in targets:
        s0, sc = steps_to_loss(results, t, 0.0), steps_to_loss(results, t, rate)
        row: Dict[str, Any] = {
            "target_loss": t, "seeds_c0": sorted(s0), "seeds_rate": sorted(sc),
            "steps_c0": statistics.fmean(s0.values()) if s0 else None,
            "steps_rate": statistics.fmean(sc.values()) if sc else None}
        ms = {p: v.get("moe_ms_per_step_microbatched", v["moe_ms_per_step"])
              for p, v in pol.items()}
        for p in pol:
            steps = row["steps_rate"] if p == "lrmoe" else row["steps_c0"]
            row[p] = None if steps is None or math.isnan(ms[p]) else steps * ms[p] / 60000.0
        paired = sorted(set(s0) & set(sc))
        if "lrmoe" in pol and paired and not math.isnan(ms["lrmoe"]):
            for p in pol:
                if p == "lrmoe" or math.isnan(ms[p]):
                    continue
                r = [sc[s] * ms["lrmoe"] / (s0[s] * ms[p]) for s in paired]
                row[f"lrmoe_over_{p}"] = {"mean": statistics.fmean(r), "min": min(r),
                                          "max": max(r), "n": len(r)}
        rows.append(row)
    return rows
