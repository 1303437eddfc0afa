"""Activation offload: peak memory, tokens/s and host-device bytes, with and without it.

    python experiments/offload_memory.py --device cuda --steps 50 --out DIR
    python experiments/offload_memory.py --preset tiny --device cpu --steps 2 --seeds 0 \\
        --bench-shape smoke --bench-tokens 64 --out DIR        # the CPU check

Grid: ``lrmoe train --preset P`` (default ``gpu-small``) at c in ``--rates`` (default 0 and
0.3) x ``--offload none`` / ``activations``, one seed each (``--seeds``, default 0), the
preset's MoE layers offloading their saved expert rows (lrmoe/moe/offload.py). Per cell: the
peak device memory of the run (``peak_cuda_memory_gib`` of ``summary.json``; on the CPU
the process's max RSS, which the offload does not change), training tokens/s, and the
mean per-step bytes of the offload (``offload_h2d_bytes`` / ``offload_d2h_bytes`` of
``metrics.jsonl``: summed over the layers, one micro-batch). Then the layer benchmark
(``lrmoe bench layer``, :func:`lrmoe.bench.layer.bench_layer`) at ``--bench-shape``
(default the Qwen3-30B-A3B layer) with and without offload, LRMoE at the same rates
(skip it with ``--no-bench``).

Writes ``DIR/offload_memory.json`` (every number) and ``DIR/report.md`` (the tables, also
printed). Re-running skips the finished cells and benchmarks (``experiments/grid.py``).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from statistics import mean

import analysis
import recipe
from grid import Cell, read_metrics

RECIPE = "offload_memory"
MODES = ("none", "activations")


def cells(args):
    """One cell per (rate, offload mode, seed)."""
    return [Cell(f"c{c:g}-{mode}-s{s}",
                 ["-c", f"{c:g}", "--offload", mode, "--set", f"seed={s}"],
                 {"rate": c, "offload": mode, "seed": s})
            for c in args.rates for mode in MODES for s in args.seeds]


def _mean_key(train, key):
    values = [r[key] for r in train if r.get(key) is not None]
    return mean(values) if values else None


def train_rows(records, out: Path):
    """One row per finished cell: peak memory, tokens/s and the offload bytes per step."""
    rows = []
    for rec in records:
        s = rec["summary"]
        if s is None:
            continue
        train = [r for r in read_metrics(out / rec["name"]) if r.get("kind") == "train"]
        h2d = _mean_key(train, "offload_h2d_bytes")
        d2h = _mean_key(train, "offload_d2h_bytes")
        peak = s.get("peak_cuda_memory_gib")
        rows.append(dict(rate=rec["labels"]["rate"], offload=rec["labels"]["offload"],
                         seed=rec["labels"]["seed"], steps=s["steps"],
                         peak_gib=peak, max_rss_gib=s.get("max_rss_gib"),
                         tokens_per_s=s.get("tokens_per_s"),
                         h2d_mb_per_step=None if h2d is None else h2d / 1e6,
                         d2h_mb_per_step=None if d2h is None else d2h / 1e6))
    for r in rows:  # peak saved against the same rate and seed without offload
        base = [b for b in rows if (b["rate"], b["seed"], b["offload"])
                == (r["rate"], r["seed"], "none")]
        if base and r["peak_gib"] is not None and base[0]["peak_gib"]:
            r["peak_saved_gib"] = base[0]["peak_gib"] - r["peak_gib"]
    return rows


def bench(args, out: Path):
    """The layer benchmark with and without offload (skipped where its json exists)."""
    from lrmoe.bench.layer import bench_layer

    rows = []
    for mode in MODES:
        folder = out / f"bench-{mode}"
        path = folder / "layer_bench.json"
        if not path.is_file():
            bench_layer([args.bench_shape], [args.bench_tokens], ["uniform"],
                        rates=args.rates, methods=["lrmoe"],
                        device=None if args.device == "auto" else args.device,
                        iters=args.bench_iters, warmup=2, rotate=2, out_dir=str(folder),
                        offload=mode,
                        command=f"bench_layer offload={mode} (experiments/offload_memory.py)")
        for r in json.loads(path.read_text())["records"]:
            rows.append(dict(shape=r["shape"], tokens=r["tokens"], rate=r["rate"],
                             offload=mode, fwd_ms=r["fwd_ms"], bwd_ms=r["bwd_ms"],
                             peak_gib=None if r["peak_bytes"] is None
                             else r["peak_bytes"] / 2**30,
                             h2d_mb=None if r.get("offload_h2d_bytes") is None
                             else r["offload_h2d_bytes"] / 1e6,
                             d2h_mb=None if r.get("offload_d2h_bytes") is None
                             else r["offload_d2h_bytes"] / 1e6))
    return rows


def _table(rows, columns) -> str:
    """A markdown table; missing values print as ``-``."""
    return analysis.markdown_table([{c: "-" if r.get(c) is None else r[c] for c in columns}
                                    for r in rows], columns)


def analyse(records, out: Path, args) -> str:
    rows = train_rows(records, out)
    result = {"train": rows}
    text = (f"## Activation offload: {args.preset}, {args.steps} steps\n\n"
            + _table(rows, ["rate", "offload", "seed", "peak_gib", "peak_saved_gib",
                            "max_rss_gib", "tokens_per_s", "h2d_mb_per_step",
                            "d2h_mb_per_step"]))
    if not args.no_bench:
        from lrmoe.moe.offload import reload_path

        result["bench"] = bench(args, out)
        result["bench_reload_path"] = reload_path()  # train cells: see their logs
        text += (f"\n\n### Layer benchmark ({args.bench_shape}, {args.bench_tokens} tokens, "
                 "uniform routing)\n\n"
                 + _table(result["bench"], [
                     "rate", "offload", "fwd_ms", "bwd_ms", "peak_gib", "h2d_mb", "d2h_mb"])
                 + f"\n\nReload path: {result['bench_reload_path']}.")
    (out / "offload_memory.json").write_text(json.dumps(result, indent=1) + "\n")
    return text


if __name__ == "__main__":
    p = recipe.parser(RECIPE, __doc__)
    p.set_defaults(preset="gpu-small", steps=50, seeds=[0])
    p.add_argument("--rates", type=float, nargs="+", default=[0.0, 0.3])
    p.add_argument("--bench-shape", default="qwen3-30b-a3b",
                   help="lrmoe bench layer shape (smoke for the CPU check)")
    p.add_argument("--bench-tokens", type=int, default=16384)
    p.add_argument("--bench-iters", type=int, default=10)
    p.add_argument("--no-bench", action="store_true", help="train cells only")
    a = p.parse_args()
    if not a.no_bench:  # the benchmark runs after every training cell: check its shape now
        from lrmoe.workload.shapes import SHAPES
        if a.bench_shape not in SHAPES:
            p.error(f"--bench-shape {a.bench_shape!r}: choose from {sorted(SHAPES)}")
        if a.bench_tokens < 1 or a.bench_iters < 1:
            p.error(f"--bench-tokens and --bench-iters must be >= 1, got {a.bench_tokens}, "
                    f"{a.bench_iters}")
    sys.exit(recipe.main(RECIPE, a, cells(a), analyse))
