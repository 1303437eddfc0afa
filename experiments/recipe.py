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
import math
import shlex
import sys
from pathlib import Path
from typing import Callable, List, Optional, Sequence

import grid as _grid  # experiments/ is on sys.path when a recipe runs as a script
from analysis import final_ppl, trained_evals

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
    repeated seeds, ``--jobs`` < 1, ``--last-evals`` or ``--eval-every`` < 1, an empty
    ``--out`` or one that is a file, or ``--analyse-only`` of an ``--out`` that does not
    exist), or None."""
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
    if getattr(args, "eval_every", None) is not None and args.eval_every < 1:
        return (f"--eval-every must be >= 1, got {args.eval_every}: the final perplexity "
                "is the mean of the last evaluations")
    if getattr(args, "out", None) == "":
        return "--out is empty; name a folder for the grid's runs and report"
    if out.exists() and not out.is_dir():
        return f"--out {out} is a file; name a folder for the grid's runs and report"
    if getattr(args, "analyse_only", False) and not out.is_dir():
        return (f"--out {out}: no grid there to analyse; run the command without "
                "--analyse-only first (or name the folder that holds the runs)")
    return None


def repeated_cells(cells: Sequence[_grid.Cell]) -> Optional[str]:
    """One line naming the cells a recipe's options list twice (a value repeated in
    ``--rates``, ``--metrics``...: each cell would count twice in the tables), or None."""
    names = [c.name for c in cells]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        return (f"the options list these cells twice: {', '.join(dup)}; give each value of "
                "--rates, --metrics, --selections, --quota-rules and --targets once")
    return None


def config_problem(args: argparse.Namespace, cells: Sequence[_grid.Cell], out: Path
                   ) -> Optional[str]:
    """Why some cell's ``lrmoe train`` would refuse to start (a rate outside [0, 1), an
    unknown metric, a bad ``--set`` or ``--preset``), found before any cell runs: each
    cell's command line is parsed and its config composed and validated in this process,
    as ``lrmoe train --print-config`` would. None when every cell's is fine."""
    import contextlib
    import io

    from lrmoe import cli
    from lrmoe.training import train as T

    parser = cli.build_parser()
    for cell in cells:
        argv = ["train", *base_args(args), *cell.args, "--steps", str(args.steps),
                "--out", str(out / cell.name)]
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                a = parser.parse_args(argv)
            T.build_config(a.preset, a.config, a.sets, cli.train_overrides(a))
        except SystemExit:  # argparse's own error (an unknown choice)
            why = (err.getvalue().strip().splitlines() or ["(no message)"])[-1]
            return f"cell {cell.name} would not start: {why}"
        except (ValueError, FileNotFoundError) as exc:
            return f"cell {cell.name} would not start: {exc}"
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

    A usage error (:func:`usage_error`, :func:`repeated_cells`, :func:`config_problem`;
    on a run also a finished cell that a changed ``--steps`` would retrain, an ``--out``
    that cannot be written) is one line on stderr naming the flag, before any run.
    """
    out = Path(args.out if args.out is not None else f"runs/experiments/{recipe}-{args.preset}")
    usage = usage_error(args, out) or repeated_cells(cells)
    if usage is None and not args.analyse_only and not args.dry_run:
        usage = config_problem(args, cells, out)
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
    def error(msg: str) -> int:
        print(f"experiments/{recipe}.py: error: {msg}", file=sys.stderr)
        return 2

    if args.analyse_only and not any((out / c.name).is_dir() for c in cells):
        return error(f"--out {out} holds no cell of this grid (e.g. {cells[0].name}/); name "
                     "the folder the grid ran into, with the options it ran with")
    status = {}
    try:
        if not args.analyse_only:
            status = _grid.run_grid(cells, out, base_args(args), args.steps,
                                     prune_checkpoints=args.prune_checkpoints,
                                     jobs=args.jobs)
        records = _grid.collect(cells, out)
    except ValueError as err:  # finished cells that a changed --steps would replace
        return error(str(err))
    except OSError as err:
        return error(f"--out {out}: {err.strerror or err} ({err.filename}); name a folder "
                     "you can write")
    command = "python " + " ".join(shlex.quote(a) for a in
                                   [f"experiments/{recipe}.py", *(argv or sys.argv[1:])])
    # only readable cells that reached exactly --steps enter the tables: a failed or
    # cut-short run's last evaluations are not its final perplexity, and a longer run's
    # are not the final perplexity of this command's schedule
    done = [r for r in records if _grid.finished(r, args.steps)
            and r["summary"]["steps"] == args.steps]
    other = sorted(f"{r['name']} ({r['summary']['steps']} steps)" for r in records
                   if _grid.finished(r, args.steps) and r["summary"]["steps"] != args.steps)
    corrupt = [r["corrupt"] for r in records if r.get("corrupt")]
    missing = sorted(r["name"] for r in records
                     if not _grid.finished(r, args.steps) and not r.get("corrupt"))
    few = [r["name"] for r in done if len(trained_evals(r)) < args.last_evals]
    if not done:
        print(f"experiments/{recipe}.py: no cell finished {args.steps} steps in {out}; "
              f"report.md not written" + (f" (other step counts: {', '.join(other)})"
                                          if other else ""), file=sys.stderr)
        for why in corrupt:
            print(f"  unreadable: {why}", file=sys.stderr)
        return 2 if args.analyse_only else 1
    body = analyse(done, out, args)
    finals = {r["name"]: final_ppl(r, args.last_evals) for r in done}
    diverged = [n for n, p in finals.items() if p is not None and not math.isfinite(p)]
    if diverged:
        body += ("\n\nNon-finite final perplexity (diverged; counted in no mean above): "
                 f"{', '.join(diverged)}")
    if few:
        body += (f"\n\nFewer than --last-evals {args.last_evals} evaluations after step 0 "
                 f"(their final perplexity is the mean of those there are): {', '.join(few)}")
    if other:
        body += (f"\n\nRan other than --steps {args.steps} (left out of the tables): "
                 f"{', '.join(other)}")
    if corrupt:
        body += "\n\nUnreadable (left out of the tables): " + "; ".join(corrupt)
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
