"""Reports of ``lrmoe bench layer``: records -> markdown, JSON and PNG, and the targets.

A record is one method on one case (a dict): ``method`` (``lrmoe``, ``dropless``,
``transformers``, ``torchtitan``), ``rate`` (the LRMoE recalibration rate, None for a
baseline), ``label`` (display name, :func:`lrmoe.bench.method.label`), the case
(``shape``, ``tokens`` or ``tokens_per_rank``, ``routing``), times in ms (``fwd_ms``,
``bwd_ms``, ``fwd_bwd_ms``; None where the method failed its agreement check),
``phases_ms`` and, for baselines, ``agreement``.

The pass/fail targets are data: ``targets.json`` beside this file (package data), read
by :func:`load_targets`; its ``about`` field describes the format.
"""
from __future__ import annotations

import json
import math
from importlib import resources
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from lrmoe.moe.stats import max_over_mean
from lrmoe.utils.phases import A2A_PHASES, PHASES_BWD, PHASES_FWD

BYTES_FWD = ("counts", "forward_dispatch", "forward_combine")
BYTES_BWD = ("backward_grad", "backward_index", "backward_dx")
FAILED = "failed agreement check"
_OPS = {"<=": lambda v, lim: v <= lim, ">=": lambda v, lim: v >= lim}


def _f(v, nd: int = 1) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{nd}f}"


def _ms(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def _offload_mb(r: dict) -> str:
    """``H2D / D2H`` MB of the activation offload (``-`` without it)."""
    if r.get("offload_h2d_bytes") is None:
        return "-"
    return f"{r['offload_h2d_bytes'] / 1e6:.1f} / {r['offload_d2h_bytes'] / 1e6:.1f}"


def _agreement(r: dict) -> str:
    a = r.get("agreement")
    if not a or (r.get("status") not in (None, FAILED) and r.get("fwd_ms") is None):
        # e.g. a CUDA-graph row whose capture failed, a method out of memory
        return r.get("status", "-")
    err = max(a["out_rel_err"], a["dx_rel_err"])
    return f"{err:.1e}" if a["passed"] else f"FAILED {err:.1e} > {a['tolerance']:.0e}"


# --------------------------------------------------------------------------- targets
def load_targets(path: Optional[str] = None) -> dict:
    """The targets (``case`` and ``targets``) from ``path`` or the packaged
    ``lrmoe/bench/targets.json``.

    Raises:
        ValueError: a target without ``name``/``value``, with an ``op`` other than
            ``<=``/``>=``, or an ``op`` without a ``limit`` (naming the file and target).
    """
    if path is None:
        text = resources.files("lrmoe.bench").joinpath("targets.json").read_text()
        where = "lrmoe/bench/targets.json"
    else:
        text, where = Path(path).read_text(), str(path)
    spec = json.loads(text)
    for i, t in enumerate(spec.get("targets", [])):
        name = t.get("name", f"#{i}")
        if "name" not in t or "value" not in t:
            raise ValueError(f"{where}: target {name} needs 'name' and 'value'")
        if "op" in t and (t["op"] not in _OPS or "limit" not in t):
            raise ValueError(f"{where}: target {name}: 'op' must be <= or >= and come with "
                             f"a 'limit', got op={t.get('op')!r}, limit={t.get('limit')!r}")
        if "op" not in t and not t.get("info"):
            raise ValueError(f"{where}: target {name} has no 'op'/'limit'; give them, or "
                             "mark it \"info\": true")
    return spec


def _key(method: str, rate) -> Tuple[str, Optional[float]]:
    return method, None if rate is None else round(float(rate), 6)


def _term(term: dict, sel: Dict[tuple, dict], ceilings: dict):
    if "ceiling" in term:
        return ceilings.get(term["ceiling"])
    rec = sel.get(_key(term["method"], term.get("rate")))
    if rec is None:
        return None
    if "phases" in term:
        return sum(rec["phases_ms"].get(k, 0.0) for k in term["phases"])
    v = rec.get(term["field"])
    return (v or {}).get(term["key"]) if "key" in term else v


def check_targets(records: List[dict], ceilings: dict, spec: Optional[dict] = None
                  ) -> List[dict]:
    """Evaluate the targets on the records of the targets' case.

    Args:
        records: the run's records. ceilings: :func:`lrmoe.bench.timing.measure_ceilings`.
        spec: :func:`load_targets` output (default: the packaged targets).

    Returns:
        One row per target whose terms the run has: ``target`` (name), ``value``,
        ``limit`` (e.g. ``"<= 1.05"``, ``"report"`` for a plain ratio), ``met`` (bool,
        None for a plain ratio), ``info`` (reported, not a pass/fail target).
    """
    spec = spec if spec is not None else load_targets()
    case = spec["case"]
    sel = {_key(r["method"], r.get("rate")): r for r in records
           if all(r.get(k) == v for k, v in case.items())}
    out = []
    for t in spec["targets"]:
        value = _term(t["value"], sel, ceilings)
        if "over" in t:
            over = _term(t["over"], sel, ceilings)
            value = value / over if value is not None and over else None
        if value is None:
            continue
        op = t.get("op")
        out.append(dict(target=t["name"], value=value,
                        limit=f"{op} {t['limit']:g}" if op else "report",
                        met=bool(_OPS[op](value, t["limit"])) if op else None,
                        info=bool(t.get("info"))))
    return out


def targets_title(spec: Optional[dict] = None) -> str:
    """``qwen3-30b-a3b, 32768 tokens, skewed routing``: the case the targets are read on."""
    c = (spec if spec is not None else load_targets())["case"]
    return f"{c['shape']}, {c['tokens']} tokens, {c['routing']} routing"


def _met(t: dict) -> str:
    word = "-" if t["met"] is None else "yes" if t["met"] else "NO"
    return f"{word} (info)" if t["info"] else word


# --------------------------------------------------------------------------- one device
def markdown(records: List[dict], ceilings: dict, targets: List[dict], meta: dict) -> str:
    """The run as a markdown section for docs/journal/performance.md."""
    lines = [f"### Layer benchmark, {meta['date']} ({meta['device']})", "",
             f"Command: `{meta['command']}`  ", f"torch {meta['torch']}; ceilings measured "
             f"in this run: copy {_f(ceilings.get('copy_GBps'))} GB/s, dense bf16 GEMM "
             f"{_f(ceilings.get('gemm_TFLOPs'))} TFLOP/s. Median of {meta['iters']} "
             "iterations, times in ms. Agreement: the largest relative error of output and "
             "input gradient against LRMoE at c = 0 (a baseline over its tolerance is not "
             "timed). Peak: the row's peak allocation above its start, weight gradients "
             "included.", "",
             "| shape | tokens | routing (max/mean) | method | fwd | bwd | fwd+bwd | "
             "vs dropless | GEMM TFLOP/s | peak GiB | bwd buffers GiB | "
             "offload H2D / D2H MB | agreement |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    base = {(r["shape"], r["tokens"], r["routing"]): r["fwd_bwd_ms"] for r in records
            if r["method"] == "dropless" and r["fwd_bwd_ms"]}
    for r in records:
        key = (r["shape"], r["tokens"], r["routing"])
        ratio = r["fwd_bwd_ms"] / base[key] if key in base and r["fwd_bwd_ms"] else None
        lines.append(
            f"| {r['shape']} | {r['tokens']} | {r['routing']} ({r['load_max_over_mean']:.2f}) "
            f"| {r['label']} | {_ms(r['fwd_ms'])} | {_ms(r['bwd_ms'])} | "
            f"{_ms(r['fwd_bwd_ms'])} | {_f(ratio, 3)} | {_f(r.get('gemm_TFLOPs'), 0)} | "
            f"{_f(r['peak_bytes'] / 2**30 if r.get('peak_bytes') else None, 2)} | "
            f"{_f(r['backward_buffer_bytes'] / 2**30 if r.get('backward_buffer_bytes') else None, 2)} "
            f"| {_offload_mb(r)} | {_agreement(r)} |")
    lines += ["", "Breakdown (ms of device time per phase, one profiled iteration):", "",
              "| shape | tokens | routing | method | " + " | ".join(PHASES_FWD + PHASES_BWD)
              + " |", "|---|---|---|---|" + "---|" * len(PHASES_FWD + PHASES_BWD)]
    for r in records:
        ph = r["phases_ms"]
        lines.append(f"| {r['shape']} | {r['tokens']} | {r['routing']} | {r['label']} | "
                     + " | ".join(_f(ph.get(k), 3) for k in PHASES_FWD + PHASES_BWD) + " |")
    if targets:
        lines += ["", f"Targets ({targets_title()}):", "",
                  "| target | value | limit | met |", "|---|---|---|---|"]
        lines += [f"| {t['target']} | {_f(t['value'], 3)} | {t['limit']} | {_met(t)} |"
                  for t in targets]
    return "\n".join(lines) + "\n"


def plot(records: List[dict], path: Path) -> None:
    """Stacked breakdown bars, one per timed method, one panel per case (PNG)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    records = [r for r in records if r["fwd_bwd_ms"] is not None]
    cases = sorted({(r["shape"], r["tokens"], r["routing"]) for r in records})
    cols = max(1, min(3, len(cases)))
    rows = max(1, math.ceil(len(cases) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4 * rows), squeeze=False)
    phases = PHASES_FWD + PHASES_BWD + ("other",)
    colors = plt.get_cmap("tab20").colors
    for ax, case in zip(axes.flat, cases):
        recs = [r for r in records if (r["shape"], r["tokens"], r["routing"]) == case]
        names = [r["label"] for r in recs]
        bottom = [0.0] * len(recs)
        for k, phase in enumerate(phases):
            if phase == "other":
                vals = [max(0.0, r["fwd_bwd_ms"] - sum(r["phases_ms"].get(p, 0.0)
                                                       for p in phases[:-1])) for r in recs]
            else:
                vals = [r["phases_ms"].get(phase, 0.0) for r in recs]
            ax.bar(names, vals, bottom=bottom, color=colors[k % len(colors)], label=phase)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_title(f"{case[0]}, {case[1]} tokens, {case[2]}")
        ax.set_ylabel("ms (fwd + bwd)")
        ax.tick_params(axis="x", rotation=30)
    for ax in list(axes.flat)[len(cases):]:
        ax.axis("off")
    if cases:
        axes.flat[0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- expert parallel
def markdown_ep(records: List[dict], meta: dict) -> str:
    """The expert-parallel run as a markdown section (for docs/journal/performance.md)."""
    lines = [f"### Layer benchmark, expert parallel W = {meta['world_size']}, {meta['date']} "
             f"({meta['device']})", "",
             f"Command: `{meta['command']}`  ",
             f"Hosts: {', '.join(meta['hosts'])}; backend {meta['backend']}"
             f"{' ' + meta['nccl'] if meta.get('nccl') else ''}; torch "
             f"{meta['torch']}. Tokens per rank; each rank its own routing and inputs. "
             f"Median of {meta['iters']} iterations per rank (barrier before each, untimed); "
             "times in ms, max over ranks (mean in the json). Phases: one profiled step, "
             f"{'device' if meta['backend'] == 'nccl' else 'CPU'} ms per range, max over "
             "ranks. Bytes: sent into each all-to-all, summed over ranks (MB = 1e6 B), "
             "rows a rank sends itself included. The dropless backward is autograd's: "
             "its all-to-alls are timed by their autograd nodes, its GEMMs have no range "
             "(json: `kernels_ms` on CUDA). An all-to-all's time includes waiting for the "
             "slowest peer. Agreement: largest relative error against LRMoE at c = 0, max "
             "over ranks.", ""]
    head = ("| shape | tokens/rank | routing (max/mean) | method | fwd | bwd | fwd+bwd | "
            "vs dropless | " + " | ".join(A2A_PHASES) + " | expert GEMM fwd | "
            "expert GEMM bwd | a2a MB fwd | a2a MB bwd | bwd bytes vs c=0 | agreement |")
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    timed = [r for r in records if r.get("status") != FAILED]
    for r in records:
        case = (f"| {r['shape']} | {r['tokens_per_rank']} | {r['routing']} "
                f"({r['load_max_over_mean']:.2f}) | {r['label']} |")
        if r.get("status") == FAILED:
            lines.append(case + " - |" * (head.count("|") - 6) + f" {_agreement(r)} |")
            continue
        ph = r["phases_ms"]
        lines.append(
            f"{case} {r['fwd_ms']:.2f} | {r['bwd_ms']:.2f} | {r['fwd_bwd_ms']:.2f} | "
            f"{_f(r['vs_dropless'], 3)} | "
            + " | ".join(_f(ph.get(k), 3) for k in A2A_PHASES)
            + f" | {_f(ph.get('expert_gemm_fwd'), 3)} | {_f(ph.get('expert_gemm_bwd'), 3)} | "
            f"{r['a2a_bytes_fwd'] / 1e6:.2f} | {r['a2a_bytes_bwd'] / 1e6:.2f} | "
            f"{_f(r['bwd_bytes_vs_c0'], 3)} | {_agreement(r)} |")
    keys = BYTES_FWD + BYTES_BWD
    lines += ["", "All-to-all bytes by payload (MB, summed over ranks):", "",
              "| shape | tokens/rank | routing | method | " + " | ".join(keys) + " |",
              "|---|---|---|---|" + "---|" * len(keys)]
    for r in timed:
        lines.append(f"| {r['shape']} | {r['tokens_per_rank']} | {r['routing']} | "
                     f"{r['label']} | "
                     + " | ".join(f"{r['a2a_bytes'][k] / 1e6:.3f}" for k in keys) + " |")
    placed = [r for r in timed if r.get("placement")]
    if placed:
        mib = 1 << 20
        lines += ["", "Placement policies (the plan of the profiled step; memory: the plan's "
                  "bytes per rank, max over ranks, MiB; replica MB: weights fetched for "
                  "the forward and gradients reduced to owners, summed over ranks; rows: "
                  "max/mean over ranks of the pairs each rank computes; peak: measured, "
                  "max over ranks):", "",
                  "| shape | tokens/rank | routing | method | replicas | remote | feasible | "
                  "base experts | replicas | fwd tokens | bwd tokens | plan total | "
                  "replica MB fetched | replica MB reduced | rows before | rows fwd | "
                  "rows bwd | peak MiB |", "|" + "---|" * 18]
        for r in placed:
            p, m = r["placement"], r["placement"]["memory_max_bytes"]
            lines.append(
                f"| {r['shape']} | {r['tokens_per_rank']} | {r['routing']} | {r['label']} | "
                f"{p['replicas']} | {p['remote_instances']} | {p['feasible']} | "
                + " | ".join(f"{m.get(k, 0) / mib:.1f}" for k in (
                    "base_experts", "replicas", "forward_tokens", "backward_tokens"))
                + f" | {(p['memory_total_max_bytes'] or 0) / mib:.1f} | "
                f"{p['weights_fetched'] / 1e6:.2f} | {p['grads_reduced'] / 1e6:.2f} | "
                + " | ".join(_f(max_over_mean(p[k]), 2) for k in (
                    "rows_before_W", "rows_forward_W", "rows_backward_W"))
                + f" | {_f(None if r['peak_bytes'] is None else r['peak_bytes'] / mib, 0)} |")
    if meta["backend"] == "nccl":
        lines += ["", "NCCL all-to-all kernels by name (ms per rank, sum over the step's "
                  "kernels; max over ranks):", "",
                  "| shape | tokens/rank | routing | method | fwd | bwd |",
                  "|---|---|---|---|---|---|"]
        for r in timed:
            k = r["a2a_kernels_ms"]
            lines.append(f"| {r['shape']} | {r['tokens_per_rank']} | {r['routing']} | "
                         f"{r['label']} | {k['fwd']['max']:.3f} | {k['bwd']['max']:.3f} |")
    return "\n".join(lines) + "\n"


def write_reports(result: dict, md: str, out_dir: str, stem: str,
                  append_md: Optional[str]) -> Path:
    """Write ``<stem>.json`` and ``<stem>.md`` under ``out_dir`` (created), append the
    markdown to ``append_md`` when given; returns the folder."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    (out / f"{stem}.md").write_text(md)
    if append_md:
        # check_output (lrmoe/utils/paths.py) let missing folders pass: make them
        Path(append_md).parent.mkdir(parents=True, exist_ok=True)
        with open(append_md, "a") as f:
            f.write("\n" + md)
    return out
