"""What the recipes compute from a grid's ``results.json`` (see ``experiments/grid.py``).

Definitions (docs/journal/experiments.md states them with the results):

* **final perplexity** of a run: the mean validation perplexity of its last ``last_evals``
  evaluations after step 0 (the paper averages the perplexity of its last 1,000 of 10,000 steps; we
  evaluate every ``eval_every`` steps, so the last evaluations play that part).
* **dPPL** of a run against its baseline (c = 0, same seed): ``final_ppl / final_ppl_0 - 1``
  (relative; x100 for percent), and the absolute difference ``final_ppl - final_ppl_0``.
* **time to a target validation loss**: the first evaluation step whose ``val_loss`` is
  at or below the target; the wall time is the sum of the training steps' ``time_s`` up to
  it (evaluation excluded) and the MoE time the sum of their ``moe_time_ms`` (the forward
  and backward of the MoE layers only, when the run logged it).
* mean and spread over seeds: the sample mean and the sample standard deviation
  (``statistics.stdev``; 0 for one seed).
* the 95 % interval of a paired difference (a setting's dPPL against the c = 0 run of the
  same seed; the runs share their validation split, ``data.split_seed``): the Student t
  interval ``mean +- t_{0.975, n-1} sd / sqrt(n)`` over the n seeds (none for one seed).
"""
from __future__ import annotations

import math
import statistics
from collections import defaultdict
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple


def trained_evals(record: Mapping[str, Any]) -> List[Mapping[str, Any]]:
    """A run's evaluations after step 0 (the step-0 one is the untrained model's and is
    never part of a final perplexity)."""
    return [e for e in record.get("evals") or [] if e["step"] > 0]


def final_ppl(record: Mapping[str, Any], last_evals: int = 3) -> Optional[float]:
    """Mean validation perplexity over the last ``last_evals`` evaluations after step 0
    (fewer where the run has fewer; None if it has none).

    Raises:
        ValueError: ``last_evals < 1``.
    """
    if last_evals < 1:
        raise ValueError(f"last_evals must be >= 1, got {last_evals}")
    evals = trained_evals(record)
    if not evals:
        return None
    return statistics.fmean(e["val_ppl"] for e in evals[-last_evals:])


def dppl(record: Mapping[str, Any], baseline: Mapping[str, Any], last_evals: int = 3
         ) -> Optional[Tuple[float, float]]:
    """(relative dPPL, absolute dPPL) of ``record`` against ``baseline``; None if either
    run has no evaluation."""
    p, p0 = final_ppl(record, last_evals), final_ppl(baseline, last_evals)
    if p is None or p0 is None:
        return None
    return p / p0 - 1.0, p - p0


def time_to_loss(record: Mapping[str, Any], target: float) -> Optional[Dict[str, float]]:
    """Steps, wall seconds and MoE-layer seconds until the validation loss reaches
    ``target`` (None if it never does).

    Returns:
        ``{"step", "wall_s", "moe_s"}``; ``moe_s`` is NaN when the run did not log
        ``moe_time_ms``.
    """
    hit = next((e for e in record.get("evals") or [] if e["val_loss"] <= target), None)
    if hit is None:
        return None
    train = [r for r in record.get("train") or [] if r["step"] <= hit["step"]]
    moe = [r.get("moe_time_ms") for r in train]
    moe_s = (sum(moe) / 1e3 if train and all(m is not None for m in moe) else math.nan)
    return {"step": hit["step"], "wall_s": sum(r.get("time_s", 0.0) for r in train),
            "moe_s": moe_s}


def mean_spread(values: Iterable[float]) -> Tuple[float, float, int]:
    """(mean, sample standard deviation, n) of the finite values; (nan, nan, 0) if none."""
    v = [float(x) for x in values if x is not None and math.isfinite(x)]
    if not v:
        return math.nan, math.nan, 0
    return statistics.fmean(v), (statistics.stdev(v) if len(v) > 1 else 0.0), len(v)


def _check_confidence(confidence: float) -> None:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")


def t_critical(confidence: float, df: int) -> float:
    """The two-sided Student t critical value: ``t`` with ``P(|T| <= t) = confidence`` for
    ``df`` degrees of freedom.

    ``P(|T| <= t)`` is the closed form for integer ``df`` (Abramowitz & Stegun, Handbook of
    Mathematical Functions, 26.7.3 for odd and 26.7.4 for even ``df``; theta =
    atan(t / sqrt(df))), inverted by bisection to 1e-12.

    Raises:
        ValueError: ``confidence`` outside (0, 1) or ``df < 1``.
    """
    _check_confidence(confidence)
    if isinstance(df, bool) or not isinstance(df, int) or df < 1:
        raise ValueError(f"df must be an int >= 1, got {df!r}")

    def inside(t: float) -> float:  # P(|T| <= t)
        th = math.atan(t / math.sqrt(df))
        c2 = math.cos(th) ** 2
        if df % 2 == 1:
            term, acc = math.cos(th), 0.0
            for k in range(1, (df - 1) // 2 + 1):  # cos th (1 + 2/3 c2 + 2*4/(3*5) c2^2 ...)
                acc += term
                term *= c2 * (2 * k) / (2 * k + 1)
            return 2.0 / math.pi * (th + math.sin(th) * acc)
        term, acc = 1.0, 0.0
        for k in range(1, df // 2 + 1):  # 1 + 1/2 c2 + 1*3/(2*4) c2^2 ...
            acc += term
            term *= c2 * (2 * k - 1) / (2 * k)
        return math.sin(th) * acc

    lo, hi = 0.0, 1.0
    while inside(hi) < confidence:
        hi *= 2.0
    while hi - lo > 1e-12 * max(1.0, hi):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if inside(mid) < confidence else (lo, mid)
    return 0.5 * (lo + hi)


def mean_interval(values: Iterable[float], confidence: float = 0.95
                  ) -> Tuple[float, float, float, int]:
    """(mean, low, high, n) of the finite values: the Student t interval
    ``mean +- t_critical(confidence, n - 1) * sd / sqrt(n)``; low and high are NaN for
    fewer than two values, everything NaN (n = 0) for none.

    Raises:
        ValueError: ``confidence`` outside (0, 1).
    """
    _check_confidence(confidence)
    m, sd, n = mean_spread(values)
    if n < 2:
        return m, math.nan, math.nan, n
    half = t_critical(confidence, n - 1) * sd / math.sqrt(n)
    return m, m - half, m + half, n


def group(records: Sequence[Mapping[str, Any]], keys: Sequence[str]
          ) -> Dict[Tuple, List[Mapping[str, Any]]]:
    """Records grouped by the values of ``labels[k]`` for ``k`` in ``keys`` (insertion
    order kept)."""
    out: Dict[Tuple, List[Mapping[str, Any]]] = defaultdict(list)
    for r in records:
        out[tuple(r["labels"].get(k) for k in keys)].append(r)
    return dict(out)


def dppl_table(records: Sequence[Mapping[str, Any]], keys: Sequence[str],
               is_baseline: Callable[[Mapping[str, Any]], bool], last_evals: int = 3
               ) -> List[Dict[str, Any]]:
    """dPPL of every non-baseline setting, mean and spread over seeds.

    Each run is compared with the baseline run of the same ``labels["seed"]``.

    Returns:
        One row per setting (``keys`` values): ``{**setting, "ppl", "ppl_sd",
        "dppl_pct", "dppl_pct_sd", "dppl_pct_lo", "dppl_pct_hi", "dppl_abs",
        "dppl_abs_sd", "seeds"}`` (``seeds``: the runs with a finite dPPL against their
        seed's baseline, the n of the mean; ``dppl_pct_lo`` / ``_hi``: the 95 % t interval
        of the paired differences, :func:`mean_interval`, NaN for one seed), plus one row
        for the baseline itself (dPPL 0 by definition).
    """
    base = {r["labels"].get("seed"): r for r in records if is_baseline(r)}
    rows = []
    for setting, runs in group(records, keys).items():
        rel, ab, ppl = [], [], []
        for r in runs:
            ppl.append(final_ppl(r, last_evals))
            b = base.get(r["labels"].get("seed"))
            d = dppl(r, b, last_evals) if b is not None else None
            if d is not None:
                rel.append(100.0 * d[0])
                ab.append(d[1])
        m, sd, _ = mean_spread(ppl)
        mr, sr, n = mean_spread(rel)  # seeds: the pairs the dPPL mean is over
        _, lo, hi, _ = mean_interval(rel)
        ma, sa, _ = mean_spread(ab)
        rows.append({**dict(zip(keys, setting)), "ppl": m, "ppl_sd": sd, "dppl_pct": mr,
                     "dppl_pct_sd": sr, "dppl_pct_lo": lo, "dppl_pct_hi": hi,
                     "dppl_abs": ma, "dppl_abs_sd": sa, "seeds": n})
    return rows


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> str:
    """A markdown table of ``rows`` (floats to 4 significant digits)."""
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return "-" if not math.isfinite(v) else f"{v:.4g}"
        return str(v)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)
