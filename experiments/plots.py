"""The recipes' figures (PNG, matplotlib's Agg backend, no pyplot state)."""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Sequence

from analysis import group, mean_spread


def _figure(width: float = 7.0, height: float = 4.2):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    tmp = Path(str(path) + ".tmp")
    fig.savefig(tmp, format="png")
    os.replace(tmp, path)
    return path


def curves(records: Sequence[Mapping[str, Any]], key: str, path: Path, *,
           label: Callable[[Any], str] = str, y: str = "val_ppl", title: str = "",
           log_y: bool = True) -> Path:
    """Validation curves, one line per value of ``labels[key]``: the mean over seeds at
    each evaluation step, with a band of +- one sample standard deviation."""
    fig = _figure()
    ax = fig.add_subplot(1, 1, 1)
    for (value,), runs in group(records, [key]).items():
        per_step: Dict[int, List[float]] = {}
        for r in runs:
            for e in r.get("evals") or []:
                per_step.setdefault(e["step"], []).append(e[y])
        steps = sorted(per_step)
        if not steps:
            continue
        stats = [mean_spread(per_step[s]) for s in steps]
        mean = [m for m, _, _ in stats]
        ax.plot(steps, mean, "o-", ms=3, lw=1.3,
                label=f"{label(value)} (n={max(n for _, _, n in stats)})")
        ax.fill_between(steps, [m - s for m, s, _ in stats], [m + s for m, s, _ in stats],
                        alpha=0.2)
    ax.set_xlabel("step")
    ax.set_ylabel({"val_ppl": "validation perplexity", "val_loss": "validation loss"}
                  .get(y, y))
    if log_y:
        ax.set_yscale("log")
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def bars(rows: Sequence[Mapping[str, Any]], label: Callable[[Mapping[str, Any]], str],
         value: str, err: str, path: Path, *, ylabel: str, title: str = "") -> Path:
    """A bar per row: ``row[value]`` with an error bar ``row[err]`` (one standard
    deviation over seeds); rows with a NaN value are drawn as missing."""
    fig = _figure(max(5.0, 0.55 * len(rows) + 2), 4.2)
    ax = fig.add_subplot(1, 1, 1)
    xs = list(range(len(rows)))
    vals = [r.get(value) for r in rows]
    errs = [r.get(err) or 0.0 for r in rows]
    ok = [v is not None and math.isfinite(v) for v in vals]
    ax.bar([x for x, k in zip(xs, ok) if k], [v for v, k in zip(vals, ok) if k],
           yerr=[e for e, k in zip(errs, ok) if k], capsize=3, color="tab:blue")
    ax.set_xticks(xs)
    ax.set_xticklabels([label(r) for r in rows], rotation=35, ha="right", fontsize=8)
    ax.axhline(0.0, color="black", lw=0.8)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)
