"""The common runner of the experiment recipes: a grid of ``lrmoe train`` runs.

A grid is a list of :class:`Cell` s, each one ``lrmoe train`` run with its own flags in its
own run directory ``<root>/<cell.name>/``. :func:`run_grid` runs the cells one after the
other (or ``jobs`` at a time), in a subprocess each (``python -m lrmoe train ...``), and is
safe to interrupt and re-run:

* a cell whose ``summary.json`` says it reached its steps is skipped (its numbers are
  kept, never recomputed);
* a cell that has a checkpoint continues from it (``--resume``; exact on the CPU, see
  docs/training.md "Stopping and resuming");
* a cell that failed or was killed before its first checkpoint starts over
  (``--overwrite``), its old log kept beside the new one;
* a cell that fails does not stop the grid: the failure is recorded and the next cell runs;
  the exit status of the runner is non-zero when any cell failed.

Ctrl-C stops the running cell the way ``lrmoe train`` stops (it finishes the step and saves
a checkpoint), then the runner; running the same command again continues.

:func:`collect` reads every cell's ``metrics.jsonl`` and ``summary.json`` into one results
file ``<root>/results.json`` that the recipes analyse and plot.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

RESULTS_FILE = "results.json"
LOG_DIR = "logs"


@dataclasses.dataclass(frozen=True)
class Cell:
    """One run of a grid.

    Attributes:
        name: directory name of the run under the grid root (letters, digits, ``-_.=``).
        args: extra ``lrmoe train`` arguments of this cell, e.g. ``("-c", "0.2",
            "--metric", "lrm", "--set", "seed=1")``.
        labels: what the recipes group and plot by, e.g. ``{"rate": 0.2, "seed": 1}``.
    """

    name: str
    args: Sequence[str]
    labels: Mapping[str, Any]

    def __post_init__(self) -> None:
        bad = [ch for ch in self.name if not (ch.isalnum() or ch in "-_.=")]
        if not self.name or bad:
            raise ValueError(f"Cell.name {self.name!r} must be a non-empty directory name of "
                             "letters, digits and -_.= only")


def default_cell_name(rate: float, seed: int) -> str:
    """The name of the cell with the paper's LRMoE settings (metric ``lrm``, selection
    ``topk``, quota rule ``proportional``, each passed explicitly) at ``rate`` and
    ``seed``: every recipe names that cell alike, so recipes run into one ``--out`` run it
    once."""
    return f"c{rate:g}-s{seed}"


def _read_json(path: Path) -> Optional[dict]:
    """The JSON object in ``path``; None if it is missing, unreadable or not an object."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


class CorruptRun(ValueError):
    """A cell's files cannot be read as a run (the message names the file and line)."""


def read_metrics(run_dir: Path) -> List[dict]:
    """The records of ``run_dir/metrics.jsonl``; [] when there is no such file.

    A torn last line (a run killed while writing it) is ignored; any other line that is
    not a JSON object raises, since the records after it would be lost silently.

    Raises:
        CorruptRun: a line before the last that is not a JSON object.
    """
    path = run_dir / "metrics.jsonl"
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    out: List[dict] = []
    for i, line in enumerate(lines):
        try:
            rec = json.loads(line)
        except ValueError:
            if i == len(lines) - 1:
                break  # torn by a kill mid-write: the run's numbers end before it
            rec = None
        if not isinstance(rec, dict):
            raise CorruptRun(f"{path}:{i + 1} is not a JSON object record ({line[:60]!r})")
        out.append(rec)
    return out


def _steps(summary: Optional[Mapping[str, Any]]) -> Optional[int]:
    """A summary's ``steps`` if it is an integer, else None."""
    v = (summary or {}).get("steps")
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _completed_steps(summary: Optional[Mapping[str, Any]]) -> Optional[int]:
    """The steps of a run that ended by itself (its summary's integer ``steps``, not
    interrupted), else None: the one test behind :func:`cell_state` and :func:`finished`."""
    n = _steps(summary)
    return n if n is not None and not summary.get("interrupted") else None


def cell_state(run_dir: Path, steps: int) -> str:
    """``done`` (summary at >= ``steps``), ``resume`` (has a checkpoint), ``short`` (a
    finished run of fewer steps whose checkpoints are gone, e.g. pruned: it cannot be
    extended, and starting it over would replace its results) or ``fresh``."""
    n = _completed_steps(_read_json(run_dir / "summary.json"))
    if n is not None and n >= steps:
        return "done"
    ckpts = run_dir / "checkpoints"
    if ckpts.is_dir() and any(p.name.startswith("step-") for p in ckpts.iterdir()):
        return "resume"
    return "short" if n is not None else "fresh"


def _keep_previous(run_dir: Path, root: Path) -> None:
    """Move a cell's run files aside (``root/logs/<cell>.previous/``) before it starts
    over: a run that died before its first checkpoint leaves metrics worth reading."""
    files = [run_dir / f for f in ("metrics.jsonl", "summary.json")
             if (run_dir / f).is_file()]
    if not files:
        return
    keep = root / LOG_DIR / f"{run_dir.name}.previous"
    keep.mkdir(parents=True, exist_ok=True)
    for f in files:
        os.replace(f, keep / f.name)


@contextlib.contextmanager
def _ctrl_c_raises():
    """A SIGINT raises KeyboardInterrupt in the runner even where SIGINT was ignored when
    it started. Python installs its handler only over SIGINT's default, and a shell starts
    a background job (``cmd &`` in a script) with SIGINT ignored: its cells (``lrmoe
    train`` installs its own handler) then saved and stopped on a Ctrl-C while the runner
    read their exits as normal ends ("no cell finished", exit 1 instead of 130;
    tests/python/experiments/test_experiments.py). The old disposition comes back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def _run(cmd: List[str], log_path: Path, prefix: str = "",
         procs: Optional[Dict[int, subprocess.Popen]] = None) -> int:
    """Run ``cmd``, its output appended to ``log_path`` and echoed (each line after
    ``prefix`` when several cells run at once), to the child's end; a Ctrl-C meanwhile is
    raised here as KeyboardInterrupt once the child has ended. ``procs`` registers the
    child while it runs.

    The child stays in the runner's process group, so a terminal's Ctrl-C (or ``timeout
    -s INT``, or ``kill -INT -PGID``) reaches it directly: the first makes the trainer save
    a checkpoint and stop, a second aborts it. The runner passes nothing on, so that each
    Ctrl-C is one SIGINT to the trainer; a SIGINT sent to the runner's pid alone does not
    reach the cells (send it to the group)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a") as log:
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, bufsize=1)
        if procs is not None:
            procs[proc.pid] = proc
        assert proc.stdout is not None
        interrupted = False
        try:
            while True:
                try:
                    for line in proc.stdout:
                        log.write(line)
                        sys.stdout.write(prefix + line)
                    break
                except KeyboardInterrupt:
                    # keep reading: leaving would close the pipe under the child, whose
                    # next line would then kill it before its checkpoint
                    interrupted = True
            rc = proc.wait()
        finally:
            if procs is not None:
                procs.pop(proc.pid, None)
        if interrupted:
            raise KeyboardInterrupt
        return rc


def run_grid(cells: Sequence[Cell], root: str | os.PathLike, base_args: Sequence[str],
             steps: int, *, python: str = sys.executable,
             prune_checkpoints: bool = False, jobs: int = 1) -> Dict[str, str]:
    """Run every cell of the grid that has not finished (see the module docstring).

    Args:
        cells: the grid; names must be unique.
        root: grid directory; cell ``c`` runs in ``root/c.name``, logs go to
            ``root/logs/c.name.log``.
        base_args: ``lrmoe train`` arguments shared by every cell (preset, device, ...).
        steps: optimizer steps of every cell (``--steps``).
        python: the interpreter that runs ``-m lrmoe train``.
        prune_checkpoints: keep only a cell's newest checkpoint while it runs
            (``run.keep_checkpoints=1``) and delete its ``checkpoints/`` once it has
            finished (its metrics and summary stay; for grids of models too large to keep
            every checkpoint on disk). A pruned cell can no longer be extended to more
            steps.
        jobs: cells run at the same time (each its own process on the same device).
            Small models leave a GPU mostly idle between kernel launches, so several cells
            at once finish a grid sooner; their losses are unaffected (each run is
            deterministic in its own seed), but their times are of a shared device: the
            runner records ``jobs`` per cell (``root/logs/<cell>.json``, ``collect``
            copies it into the record) and timing claims must come from ``jobs = 1`` cells
            (experiments/time_to_loss.py refuses the others).

    Returns:
        ``{cell name: "done" | "skipped" | "failed (exit N)"}``.

    Raises:
        ValueError: duplicate cell names, ``steps < 1`` or ``jobs < 1``, or a cell that
            finished with fewer steps and has no checkpoint (``cell_state`` ``short``;
            nothing runs then).
        KeyboardInterrupt: Ctrl-C, after every running cell has ended (the Ctrl-C made
            each save a checkpoint and stop; a second one aborts them).
    """
    names = [c.name for c in cells]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"cells must have unique names; repeated: {dup}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    status: Dict[str, str] = {}
    todo = []
    for i, cell in enumerate(cells):
        state = cell_state(root / cell.name, steps)
        if state == "done":
            status[cell.name] = "skipped"
        else:
            todo.append((i, cell, state))
    short = [c.name for _, c, state in todo if state == "short"]
    if short:  # before any cell runs: a typo in --steps must not retrain a finished grid
        n = _steps(_read_json(root / short[0] / "summary.json"))
        raise ValueError(
            f"{len(short)} cell(s) finished with fewer steps than {steps} and have no "
            f"checkpoint to continue from (e.g. {short[0]}: {n} steps); starting them over "
            f"would replace their results. Use --steps {n} to analyse them, or another "
            "--out for the longer runs")
    with _ctrl_c_raises():
        return _run_cells(cells, todo, root, base_args, steps, python, prune_checkpoints,
                          jobs, status)


def _run_cells(cells, todo, root, base_args, steps, python, prune_checkpoints, jobs,
               status) -> Dict[str, str]:
    """The cells of :func:`run_grid` that have to run (``todo``), one or ``jobs`` at a time."""
    procs: Dict[int, subprocess.Popen] = {}

    def one(i: int, cell: Cell, state: str) -> None:
        run_dir = root / cell.name
        cmd = [python, "-m", "lrmoe", "train", *base_args, *cell.args,
               "--steps", str(steps), "--out", str(run_dir)]
        if prune_checkpoints:
            # a cell whose checkpoints go when it finishes needs only its newest one to
            # resume; two per cell (the trainer's default) filled the H200 machine's
            # 64 GiB at six gpu-small cells (7.5 GB a checkpoint, docs/journal/experiments.md)
            cmd += ["--set", "run.keep_checkpoints=1"]
        if state == "resume":
            cmd += ["--resume", str(run_dir)]
        elif run_dir.exists():
            _keep_previous(run_dir, root)
            cmd += ["--overwrite"]
        print(f"[grid] cell {i + 1}/{len(cells)} {cell.name}: {state}", flush=True)
        (root / LOG_DIR).mkdir(parents=True, exist_ok=True)
        (root / LOG_DIR / f"{cell.name}.json").write_text(json.dumps({"jobs": jobs}))
        t0 = time.time()
        rc = _run(cmd, root / LOG_DIR / f"{cell.name}.log",
                  prefix=f"[{cell.name}] " if jobs > 1 else "", procs=procs)
        status[cell.name] = "done" if rc == 0 else f"failed (exit {rc})"
        if rc == 0 and prune_checkpoints:
            shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
        print(f"[grid] cell {cell.name}: {status[cell.name]} in {time.time() - t0:.0f} s",
              flush=True)

    if jobs == 1:
        for item in todo:
            one(*item)
        return status
    # Worker threads only wait on their child processes; a Ctrl-C reaches every cell (one
    # process group) and the main thread, which starts no new cell and waits for them.
    pending = list(reversed(todo))
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                if not pending or stop.is_set():
                    return
                item = pending.pop()
            one(*item)

    stop = threading.Event()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(min(jobs, len(todo)))]
    for t in threads:
        t.start()
    try:
        while any(t.is_alive() for t in threads):
            for t in threads:
                t.join(timeout=0.2)
    except KeyboardInterrupt:
        stop.set()  # no new cell; the running ones got the Ctrl-C too (see _run)
        while True:
            try:
                for t in threads:
                    t.join()
                break
            except KeyboardInterrupt:  # a second one: it reached the cells as well
                continue
        raise
    return status


def finished(record: Mapping[str, Any], steps: int) -> bool:
    """Whether a :func:`collect` record is of a readable run that reached ``steps`` and
    was not interrupted (the same test as :func:`cell_state`'s ``done``)."""
    n = _completed_steps(record.get("summary"))
    return not record.get("corrupt") and n is not None and n >= steps


def collect(cells: Sequence[Cell], root: str | os.PathLike) -> List[dict]:
    """One record per cell: its labels, its summary, its eval curve and train records.

    Writes ``root/results.json`` (a list of the records) atomically and returns it. Cells
    without a summary (not run, failed) have ``summary: None``.

    Record keys: ``name``, ``labels``, ``summary`` (``summary.json``), ``corrupt`` (None,
    or why the cell's files cannot be read as a run: a bad line, an eval record without
    numbers, an unreadable summary, a log that ends before the summary's last evaluation;
    its evals and train records are then empty), ``jobs`` (cells that ran at the same
    time as it, its last run; None when unknown), ``evals`` (list of
    ``{step, val_loss, val_ppl}``), ``train`` (list of ``{step, loss, time_s,
    tokens_per_s, moe_time_ms?, dropped_fraction, retained_mass}``).
    """
    root = Path(root)
    out = []
    keep = ("step", "loss", "time_s", "tokens_per_s", "moe_time_ms", "dropped_fraction",
            "retained_mass")
    for cell in cells:
        run_dir = root / cell.name
        corrupt = None
        try:
            records = read_metrics(run_dir)
        except CorruptRun as err:
            records, corrupt = [], str(err)
        evals = [r for r in records if r.get("kind") == "eval"]
        bad = next((r for r in evals if not all(isinstance(r.get(k), (int, float))
                                                for k in ("step", "val_loss", "val_ppl"))),
                   None)
        if corrupt is None and bad is not None:
            corrupt = f"{run_dir / 'metrics.jsonl'}: an eval record without numbers ({bad})"
        summary = _read_json(run_dir / "summary.json")
        if (run_dir / "summary.json").exists() and summary is None and corrupt is None:
            corrupt = f"{run_dir / 'summary.json'} is not a readable JSON object"
        last = (summary or {}).get("last_val_step")
        if corrupt is None and isinstance(last, int) and evals and evals[-1]["step"] != last:
            corrupt = (f"{run_dir / 'metrics.jsonl'} ends at evaluation step "
                       f"{evals[-1]['step']} but summary.json says {last} (a truncated log?)")
        jobs = (_read_json(root / LOG_DIR / f"{cell.name}.json") or {}).get("jobs")
        out.append({
            "name": cell.name,
            "labels": dict(cell.labels),
            "summary": summary,
            "corrupt": corrupt,
            "jobs": jobs if isinstance(jobs, int) else None,
            "evals": [] if corrupt else [{k: r[k] for k in ("step", "val_loss", "val_ppl")}
                                         for r in evals],
            "train": [] if corrupt else [{k: r[k] for k in keep if k in r}
                                         for r in records if r.get("kind") == "train"],
        })
    tmp = root / (RESULTS_FILE + ".tmp")
    tmp.write_text(json.dumps(out, indent=1))
    os.replace(tmp, root / RESULTS_FILE)
    return out
