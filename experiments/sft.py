"""The SFT setting: pre-train one model on real text, then fine-tune it on Alpaca-format
instruction data under each planned backward (the paper's fine-tuning protocol: every
fine-tune starts from one base).

    lrmoe data wordnet-alpaca --out data/wordnet_alpaca.jsonl     # apt-get install wordnet-base
    python experiments/sft.py --preset gpu-small --device cuda --pretrain-steps 300 \\
        --sft-data data/wordnet_alpaca.jsonl --sft-steps 300 --eval-every 25 --seeds 0 1 2

Stage 1, the base (one cell, ``base-c0-s<base seed>``): ``--pretrain-data`` (default
``gcide``) for ``--pretrain-steps`` at c = 0, seed ``--base-seed``. Its checkpoints are
kept (``--prune-checkpoints`` prunes only the fine-tunes): the fine-tunes start from its
last one.

Stage 2, the fine-tunes: ``--init-from`` the base's last checkpoint (its weights and its
``tokenizer.json``, so the token ids are the ones the embeddings were trained on) on
``alpaca:--sft-data`` for ``--sft-steps`` at ``--sft-lr`` (warm-up ``--sft-warmup``, cosine
to ``--sft-min-lr``); c = 0 per seed, and (setting, c) for setting in ``--settings``
(``METRIC:SELECTION[:QUOTA_RULE]``, default ``lrm:topk lrm:importance random:topk``, quota
rule ``proportional`` unless named) and c in ``--rates`` (default 0.2 0.3 0.5), per seed;
with ``--targets``, also the adaptive rate (``-c --cap --retained-mass-target RHO``) for
each setting in ``--adaptive-settings`` and RHO in ``--targets``. Seeds vary the
fine-tune (batch order, the random selection, the hash split of the fine-tuning data),
never the base. Validation is on the held-out instruction records of the fine-tuning data.

Report (``report.md`` in ``--out``): dPPL against the c = 0 fine-tune of the same seed
(``experiments/analysis.py``) and the dropped share of the pairs (mean over the logged
steps: c itself for a fixed rate, what the target chose for an adaptive one),
``sft_dppl.png`` (bars) and ``sft_curves_<setting>.png``
(validation perplexity per rate). ``--steps`` sets both stages' steps unless
``--pretrain-steps`` / ``--sft-steps`` are given. Re-running the same command skips
finished cells and resumes interrupted ones, the base included.
"""
from __future__ import annotations

import argparse
import copy
import json
import re
import sys
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import adaptive_rate
import analysis
import grid as _grid
import plots
import recipe
from grid import Cell
# what lrmoe train accepts for each field of a setting, from the library itself
from lrmoe.ops import METRICS, QUOTA_RULES, SELECTIONS

RECIPE = "sft"
#: Records which base the fine-tunes of a grid directory were started from.
BASE_FILE = "base.json"


def base_cell(args) -> Cell:
    """The pre-training run every fine-tune starts from."""
    return Cell(f"base-c0-s{args.base_seed}",
                ["-c", "0", "--set", f"seed={args.base_seed}",
                 "--set", f"data.source={args.pretrain_data}"],
                {"stage": "base", "rate": 0.0, "seed": args.base_seed})


def base_checkpoint(out: Path, args) -> Path:
    """The base's checkpoint at ``--pretrain-steps`` (it need not exist yet)."""
    return out / base_cell(args).name / "checkpoints" / f"step-{args.pretrain_steps:08d}"


def parse_settings(items: Sequence[str], flag: str = "--settings"
                   ) -> List[Tuple[str, str, str]]:
    """``["lrm:topk", "lrm:importance:water_level"]`` ->
    ``[("lrm", "topk", "proportional"), ("lrm", "importance", "water_level")]``.

    Checked here, before the base pre-trains, rather than by the first fine-tune after it.

    Raises:
        ValueError: an item that is not ``METRIC:SELECTION[:QUOTA_RULE]`` or names an
            unknown metric, selection or quota rule (naming ``flag`` and the choices).
    """
    out = []
    for item in items:
        parts = item.split(":")
        if len(parts) not in (2, 3) or not all(parts):
            raise ValueError(f"{flag} {item!r}: expected METRIC:SELECTION[:QUOTA_RULE], e.g. "
                             "lrm:topk, random:topk or lrm:importance:water_level")
        metric, selection, quota = (*parts, "proportional")[:3]
        for value, choices, what in ((metric, METRICS, "metric"),
                                     (selection, SELECTIONS, "selection"),
                                     (quota, QUOTA_RULES, "quota rule")):
            if value not in choices:
                raise ValueError(f"{flag} {item!r}: unknown {what} {value!r}; choose from "
                                 f"{', '.join(choices)}")
        out.append((metric, selection, quota))
    return out


def setting_name(metric: str, selection: str, quota: str) -> str:
    """``lrm topk`` for the proportional rule (the names of the first grids),
    ``lrm importance water_level`` otherwise."""
    return f"{metric} {selection}" + ("" if quota == "proportional" else f" {quota}")


def sft_cells(args) -> List[Cell]:
    """c = 0 per seed, then (setting, rate, seed), then (adaptive setting, target, seed);
    labels ``setting``, ``metric``, ``selection``, ``quota_rule``, ``rate`` (the cap for an
    adaptive cell), ``target`` (1 for a fixed rate) and ``seed``.

    Cells of the proportional rule keep the names of the first grids
    (``sft-lrm-topk-c0.3-s0``), so a grid directory of those grows into a larger one.
    """
    out = [Cell(f"sft-c0-s{s}", ["-c", "0", "--set", f"seed={s}"],
                {"setting": "c=0", "metric": "none", "selection": "none",
                 "quota_rule": "none", "rate": 0.0, "target": 1.0, "seed": s})
           for s in args.seeds]

    def cell(m, sel, q, c, s, target=None):
        tag = "" if q == "proportional" else f"-{q}"
        rate = f"c{c:g}" if target is None else f"rho{target:g}-cap{c:g}"
        extra = [] if target is None else ["--retained-mass-target", f"{target:g}"]
        setting = setting_name(m, sel, q) + ("" if target is None else f" rho*={target:g}")
        return Cell(f"sft-{m}-{sel}{tag}-{rate}-s{s}",
                    ["-c", f"{c:g}", *extra, "--metric", m, "--selection", sel,
                     *(["--quota-rule", q] if tag else []), "--set", f"seed={s}"],
                    {"setting": setting, "metric": m, "selection": sel, "quota_rule": q,
                     "rate": c, "target": 1.0 if target is None else target, "seed": s})

    out += [cell(m, sel, q, c, s) for m, sel, q in parse_settings(args.settings)
            for c in args.rates for s in args.seeds]
    targets = getattr(args, "targets", None) or []
    adaptive = parse_settings(getattr(args, "adaptive_settings", None) or [],
                              "--adaptive-settings")
    out += [cell(m, sel, q, args.cap, s, t) for m, sel, q in adaptive for t in targets
            for s in args.seeds]
    return out


def base_perplexity(out: Path, args) -> str:
    """The base's final validation perplexity as the report states it: the mean of its last
    ``--last-evals`` evaluations after step 0 (:func:`analysis.final_ppl`, the definition
    every dPPL here uses), with the steps it averages and the last evaluation beside it;
    ``nan`` when the base has no evaluation after step 0 (not run yet)."""
    try:
        records = _grid.read_metrics(out / base_cell(args).name)
    except _grid.CorruptRun as err:
        return f"unreadable ({err})"
    run = {"evals": [r for r in records if r.get("kind") == "eval"]}
    final = analysis.final_ppl(run, args.last_evals)
    if final is None:
        return "nan"
    used = analysis.trained_evals(run)[-args.last_evals:]
    return (f"{final:.4g}, the mean of the evaluations at steps "
            f"{', '.join(str(e['step']) for e in used)}; {used[-1]['val_ppl']:.4g} at the "
            "last one")


def sft_args(args, checkpoint: Path) -> argparse.Namespace:
    """``args`` for the fine-tune grid: its steps, and the ``--set`` items that point every
    fine-tune at the base checkpoint, the instruction data and the fine-tuning schedule
    (``--sft-set`` items last, so they win)."""
    ft = copy.copy(args)
    ft.steps = args.sft_steps
    ft.sets = [*args.sets, f"model.init_from={checkpoint}",
               f"data.source=alpaca:{args.sft_data}", f"optim.lr={args.sft_lr:g}",
               f"optim.min_lr={args.sft_min_lr:g}", f"optim.warmup_steps={args.sft_warmup}",
               *args.sft_sets]
    return ft


def fine_tune_problem(ft: argparse.Namespace, cells: Sequence[Cell], out: Path
                      ) -> Optional[str]:
    """Why the fine-tunes could not start, found before the base pre-trains (minutes on a
    GPU) rather than by every fine-tune after it: the ``--sft-data`` file read as the
    fine-tunes will read it, and the first fine-tune's ``lrmoe train`` configuration
    composed and validated (:func:`recipe.config_problem`, which does not need the base's
    checkpoint to exist yet). None when both are fine."""
    from lrmoe.data.sources import read_alpaca

    try:
        read_alpaca(Path(ft.sft_data))
    except ValueError as err:
        return f"--sft-data: {err}"
    problem = recipe.config_problem(ft, cells[:1], out)
    if problem is not None:
        return (f"the fine-tunes would not start: {problem} (set by --sft-set, --sft-lr, "
                "--sft-min-lr, --sft-warmup or --set)")
    return None


def check_base(out: Path, checkpoint: Path, cells: Sequence[Cell]) -> None:
    """Refuse a grid directory whose fine-tunes were started from another base than
    ``checkpoint`` (``out/base.json``): mixing them would compare fine-tunes of different
    models.

    Raises:
        ValueError: naming both bases and the fix.
    """
    path = out / BASE_FILE
    if not path.is_file():
        return
    try:
        record = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError):
        record = None
    if not isinstance(record, dict):
        raise ValueError(f"{path} is not the record this recipe writes ({{\"checkpoint\": "
                         f"PATH}}); restore it, or delete it if every fine-tune in {out} is "
                         "of the base there")
    before = record.get("checkpoint")
    started = [c.name for c in cells if (out / c.name).exists()]
    if not before:  # a base.json without its checkpoint records nothing to compare
        return
    # the base always lives in --out, so its cell and step name it whatever the working
    # folder was when base.json was written (an --out given relative, then absolute)
    if Path(before).parts[-3:] != checkpoint.parts[-3:] and started:
        raise ValueError(f"{out} holds fine-tunes ({', '.join(started[:3])}, ...) of the base "
                         f"{before}, not of {checkpoint} (--pretrain-steps or --base-seed "
                         f"changed); use another --out")


def analyse(records, out: Path, args) -> str:
    """The report of a finished (or partly finished) grid: the dPPL table per setting and
    rate with the dropped share, ``sft_dppl.png`` and one curve plot per setting; returns
    the markdown written to ``report.md``."""
    rows = analysis.dppl_table(records, ["setting", "rate"],
                               lambda r: r["labels"]["rate"] == 0, args.last_evals)
    for row in rows:
        runs = [r for r in records if r["labels"]["setting"] == row["setting"]
                and r["labels"]["rate"] == row["rate"] and r["summary"]]
        row["dropped"], row["dropped_sd"], _ = analysis.mean_spread(
            adaptive_rate.mean_dropped(r) for r in runs)
    baseline = [r for r in rows if r["rate"] == 0]
    rows = [r for r in rows if r["rate"] != 0]
    plots.bars(rows, lambda r: f"{r['setting']} c={r['rate']:g}", "dppl_pct", "dppl_pct_sd",
               out / "sft_dppl.png", ylabel="dPPL vs c = 0 (%)",
               title=f"{args.preset} SFT: dPPL per setting and rate")
    figures = []
    zero = [r for r in records if r["labels"]["rate"] == 0]
    for setting in dict.fromkeys(r["labels"]["setting"] for r in records
                                 if r["labels"]["rate"] != 0):
        name = "sft_curves_" + re.sub(r"[^A-Za-z0-9_.-]+", "-", setting).strip("-") + ".png"
        plots.curves(zero + [r for r in records if r["labels"]["setting"] == setting],
                     "rate", out / name, label=lambda c: f"c={c:g}",
                     title=f"{args.preset} SFT: validation perplexity ({setting})")
        figures.append(f"![{setting}]({name})")
    return (f"## SFT setting\n\nBase: `{base_cell(args).name}` ({args.pretrain_data}, "
            f"{args.pretrain_steps} steps, final validation perplexity "
            f"{base_perplexity(out, args)}); fine-tunes on "
            f"{f'`alpaca:{args.sft_data}`' if args.sft_data else 'Alpaca-format data'}, "
            f"{args.sft_steps} steps, lr {args.sft_lr:g}.\n\n"
            + analysis.markdown_table(baseline + rows, [
                "setting", "rate", "dropped", "ppl", "ppl_sd", "dppl_pct", "dppl_pct_sd",
                "dppl_pct_lo", "dppl_pct_hi", "dppl_abs", "seeds"]) + "\n\n![dPPL per setting](sft_dppl.png)\n\n" + "\n".join(figures))


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run (or analyse) the SFT grid; returns the exit status (1: a cell failed).

    Raises:
        ValueError: a bad flag (named), a missing ``--sft-data`` file, a base that did not
            reach ``--pretrain-steps``, or an ``--out`` holding fine-tunes of another base.
    """
    p = recipe.parser(RECIPE, __doc__)
    p.add_argument("--pretrain-data", default="gcide",
                   help="lrmoe train --data spec of the base (gcide, text:PATH, alpaca:PATH)")
    p.add_argument("--pretrain-steps", type=int, default=None,
                   help="steps of the base (default: --steps)")
    p.add_argument("--base-seed", type=int, default=0, help="seed of the base")
    p.add_argument("--sft-data", default=None, metavar="PATH",
                   help="Alpaca JSON or JSONL file to fine-tune on (lrmoe data wordnet-alpaca "
                        "builds one; Stanford Alpaca's alpaca_data.json works as it is); "
                        "not needed with --analyse-only")
    p.add_argument("--sft-steps", type=int, default=None,
                   help="steps of every fine-tune (default: --steps)")
    p.add_argument("--sft-lr", type=float, default=3e-4, help="peak lr of the fine-tunes")
    p.add_argument("--sft-min-lr", type=float, default=3e-5,
                   help="final lr of the fine-tunes' cosine decay")
    p.add_argument("--sft-warmup", type=int, default=30, help="warm-up steps of the fine-tunes")
    p.add_argument("--sft-set", dest="sft_sets", action="append", default=[],
                   metavar="KEY=VALUE", help="like --set, for the fine-tunes only")
    p.add_argument("--settings", nargs="+", default=["lrm:topk", "lrm:importance",
                                                     "random:topk"],
                   help="METRIC:SELECTION[:QUOTA_RULE] settings fine-tuned at every rate "
                        "(quota rule proportional unless named)")
    p.add_argument("--rates", type=float, nargs="+", default=[0.2, 0.3, 0.5])
    p.add_argument("--targets", type=float, nargs="+", default=[],
                   help="adaptive rate: retained-mass targets rho* in (0, 1], each run at "
                        "-c --cap --retained-mass-target RHO (default: none)")
    p.add_argument("--adaptive-settings", nargs="+", default=["lrm:topk", "lrm:importance"],
                   help="settings run with each --targets value")
    p.add_argument("--cap", type=float, default=0.5,
                   help="the largest rate an adaptive target may pick")
    args = p.parse_args(argv)
    args.pretrain_steps = args.pretrain_steps if args.pretrain_steps is not None else args.steps
    args.sft_steps = args.sft_steps if args.sft_steps is not None else args.steps
    for name in ("pretrain_steps", "sft_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if any(not 0 < c < 1 for c in args.rates):
        p.error("--rates are the dropping rates to compare in (0, 1); c = 0 always runs")
    adaptive_rate.check(p, args)  # --targets and --cap, as that recipe checks them
    try:
        parse_settings(args.settings)
        parse_settings(args.adaptive_settings, "--adaptive-settings")
    except ValueError as e:
        p.error(str(e))
    out = Path(args.out or f"runs/experiments/{RECIPE}-{args.preset}")
    usage = recipe.usage_error(args, out)
    if usage is not None:  # before the base pretraining; repeated seeds before the cells
        p.error(usage)
    names = [c.name for c in sft_cells(args)]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:  # before the base pre-trains, not when the grid starts after it
        p.error(f"the same fine-tune is asked for twice ({', '.join(twice[:3])}): a setting, "
                "rate or target repeats (lrm:topk and lrm:topk:proportional are the same); "
                "list each once")
    # analysing finished runs reads only their metrics (a clone re-makes the tables of
    # experiments/results/ without the fine-tuning data)
    if not args.analyse_only and args.sft_data is None:
        p.error("--sft-data PATH is required to run the grid (an Alpaca JSON/JSONL file; "
                "`lrmoe data wordnet-alpaca --out data/wordnet_alpaca.jsonl` builds one)")
    if not args.analyse_only and Path(args.sft_data).is_dir():
        p.error(f"--sft-data {args.sft_data} is a folder; name the Alpaca JSON/JSONL file "
                "in it")
    if not args.analyse_only and not Path(args.sft_data).is_file():
        p.error(f"--sft-data {args.sft_data}: no such file; build it with `lrmoe data "
                f"wordnet-alpaca --out {args.sft_data}` or give an Alpaca JSON/JSONL file")
    args.out = str(out)
    checkpoint = base_checkpoint(out, args)
    cells = sft_cells(args)
    ft = sft_args(args, checkpoint)
    if args.dry_run:
        print(base_cell(args).name, " ".join(base_cell(args).args),
              f"(--steps {args.pretrain_steps})")
        print("fine-tunes:", " ".join(f"--set {x}" for x in ft.sets[len(args.sets):]),
              f"(--steps {args.sft_steps})")
    else:
        # fine-tunes of another base are refused, to run beside or to analyse with
        check_base(out, checkpoint, cells)
    if not args.dry_run and not args.analyse_only:
        try:
            # the base's own flags (--pretrain-data, --set) before it trains
            base_problem = recipe.config_problem(argparse.Namespace(
                **{**vars(args), "steps": args.pretrain_steps}), [base_cell(args)], out)
            problem = (fine_tune_problem(ft, cells, out) if base_problem is None else
                       f"the base would not start: {base_problem} (--pretrain-data, --set)")
            if problem is None:
                status = _grid.run_grid([base_cell(args)], out, recipe.base_args(args),
                                        args.pretrain_steps)
        except KeyboardInterrupt:
            return recipe.interrupted(RECIPE)
        if problem is not None:
            p.error(problem)
        if status[base_cell(args).name] not in ("done", "skipped"):
            print(f"[sft] the base failed ({status}); log: {out / _grid.LOG_DIR}",
                  file=sys.stderr)
            return 1
        if not checkpoint.is_dir():
            raise ValueError(f"the base {out / base_cell(args).name} has no checkpoint "
                             f"{checkpoint.name} (it ran to another step count?); use "
                             f"another --out or --pretrain-steps")
        (out / BASE_FILE).write_text(json.dumps({"checkpoint": str(checkpoint)}) + "\n")
    return recipe.main(RECIPE, ft, cells, analyse,
                       argv if argv is not None else sys.argv[1:])


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (ValueError, FileNotFoundError) as exc:
        print(f"experiments/{RECIPE}.py: error: {exc}", file=sys.stderr)
        sys.exit(2)
