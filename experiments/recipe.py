"""The command line every recipe shares: run the grid, collect, analyse, report.

``python experiments/<recipe>.py [--preset tiny] [--steps 300] [--seeds 0 1 2]
[--device auto] [--out DIR] [--set KEY=VALUE ...] [--analyse-only]``

The grid runs under ``--out`` (default ``runs/experiments/<recipe>-<preset>``); re-running
the same command skips finished cells and resumes interrupted ones (``experiments/grid.py``).
The report (``report.md``, PNGs, ``results.json``) is written next to the runs; the command
line that made it is its first line.
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Callable, List, Optional, Sequence

import grid as _grid  # experiments/ is on sys.path when a recipe runs as a script

Analyse = Callable[[List[dict], Path, argparse.Namespace], str]


def parser(recipe: str, description: str) -> argparse.ArgumentParser:
    """The shared options; a recipe adds its own (``--rates``, ``--metrics``...)."""
    p = argparse.ArgumentParser(prog=f"experiments/{recipe}.py", description=description)
    p.add_argument("--preset", default="tiny", help="lrmoe train preset (tiny, gpu-small)")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps of every run")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                   help="seeds (each cell runs once per seed)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--eval-every", type=int, default=None,
                   help="validation cadence in steps (default: the preset's)")
    p.add_argument("--last-evals", type=int, default=3,
                   help="evaluations averaged into a run's final perplexity")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="passed to every run as lrmoe train --set KEY=VALUE")
    p.add_argument("--out", default=None, help="grid directory")
    p.add_argument("--analyse-only", action="store_true",
                   help="do not run anything: analyse the runs already in --out")
    p.add_argument("--prune-checkpoints", action="store_true",
                   help="delete each finished cell's checkpoints (large models)")
    p.add_argument("--jobs", type=int, default=1,
                   help="cells run at the same time on the device (a small model leaves a "
                        "GPU idle between launches; losses are unaffected, times are not: "
                        "time-to-loss needs --jobs 1; jobs x one run's peak memory must fit "
                        "on the device: gpu-small peaks near 21 GiB, so 6 on an H200)")
    p.add_argument("--dry-run", action="store_true", help="print the cells and exit")
    return p


def base_args(args: argparse.Namespace) -> List[str]:
    """``lrmoe train`` arguments shared by every cell of the grid."""
    # every step logged: time to loss sums the steps' times (experiments/analysis.py)
    out = ["--preset", args.preset, "--device", args.device, "--set", "progress=lines",
           "--set", "log_every=1", "--set", "run.time_moe=true"]
    if args.eval_every is not None:
        out += ["--set", f"eval_every={args.eval_every}"]
    for s in args.sets:
        out += ["--set", s]
    return out


def usage_error(args: argparse.Namespace, out: Path) -> Optional[str]:
    """The first bad shared option as one line naming the flag (``--steps`` < 1, no or
    repeated seeds, ``--jobs`` < 1, ``--last-evals`` < 1, an ``--out`` that is a file, or
    ``--analyse-only`` of an ``--out`` that does not exist), or None."""
    if args.steps < 1:
        return f"--steps must be >= 1, got {args.steps}"
    if not args.seeds:
        return "--seeds needs at least one seed"
    if len(set(args.seeds)) != len(args.seeds):
        return f"--seeds lists a seed twice ({' '.join(map(str, args.seeds))}); list each once"
    if args.jobs < 1:
        return f"--jobs must be >= 1, got {args.jobs}"
    if args.last_evals < 1:
        return f"--last-evals must be >= 1, got {args.last_evals}"
    if out.exists() and not out.is_dir():
        return f"--out {out} is a file; name a folder for the grid's runs and report"
    if getattr(args, "analyse_only", False) and not out.is_dir():
        return (f"--out {out}: no grid there to analyse; run the command without "
                "--analyse-only first (or name the folder that holds the runs)")
    return None


def interrupted(recipe: str) -> int:
    """The one line of a grid stopped by Ctrl-C; returns the exit status 130 (128 +
    SIGINT, the shell's convention)."""
    print(f"experiments/{recipe}.py: interrupted by Ctrl-C; run the same command again to "
          "continue (finished cells are kept, the others resume from their last "
          "checkpoint)", file=sys.stderr)
    return 130


def main(recipe: str, args: argparse.Namespace, cells: Sequence[_grid.Cell],
         analyse: Analyse, argv: Optional[Sequence[str]] = None) -> int:
    """Run ``cells`` (unless ``--analyse-only``), collect and analyse; returns the exit
    status (1 when a cell failed, 2 on a usage error, 130 after a Ctrl-C, 0 otherwise).

    A usage error (``--steps`` < 1, no seeds, ``--last-evals`` < 1, ``--jobs`` < 1, an
    ``--out`` that is a file) is one line on stderr naming the flag, before any run.
    """
    out = Path(args.out or f"runs/experiments/{recipe}-{args.preset}")
    usage = usage_error(args, out)
    if usage is not None:
        # the recipes' __main__ blocks pass this status to sys.exit: no traceback
        print(f"experiments/{recipe}.py: error: {usage}", file=sys.stderr)
        return 2
    if args.dry_run:
        for c in cells:
            print(c.name, " ".join(c.args))
        return 0
    try:
        return _run_and_report(recipe, args, cells, analyse, argv, out)
    except KeyboardInterrupt:
        return interrupted(recipe)


def _run_and_report(recipe: str, args: argparse.Namespace, cells: Sequence[_grid.Cell],
                    analyse: Analyse, argv: Optional[Sequence[str]], out: Path) -> int:
    """The body of :func:`main` after its checks: run, collect, analyse, report."""
    status = {}
    if not args.analyse_only:
        status = _grid.run_grid(cells, out, base_args(args), args.steps,
                                 prune_checkpoints=args.prune_checkpoints,
                                 jobs=args.jobs)
    records = _grid.collect(cells, out)
    command = "python " + " ".join(shlex.quote(a) for a in
                                   [f"experiments/{recipe}.py", *(argv or sys.argv[1:])])
    # only cells that reached their steps enter the tables: a failed or cut-short run's
    # last evaluations are not its final perplexity
    done = [r for r in records if _grid.finished(r, args.steps)]
    missing = sorted(r["name"] for r in records if not _grid.finished(r, args.steps))
    body = analyse(done, out, args)
    if missing:
        body += (f"\n\nNot finished (left out of the tables above; re-run the command to "
                 f"run them): {', '.join(missing)}")
    (out / "report.md").write_text(f"Command: `{command}`\n\n{body}\n")
    print(body)
    failed = {k: v for k, v in status.items() if v.startswith("failed")}
    if failed:
        print(f"[grid] failed cells (logs in {out / _grid.LOG_DIR}): {failed}",
              file=sys.stderr)
        return 1
    return 0
