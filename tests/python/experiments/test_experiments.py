"""experiments/: the grid runner (skip, resume, restart, failure) and the analysis formulas.

The runner is driven with a stand-in interpreter that plays ``python -m lrmoe train`` (it
writes the files a run writes), so the orchestration is checked without training; the
formulas are checked against values computed by hand.
"""
import json
import math
import os
import stat
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "experiments"))

import analysis  # noqa: E402
import grid  # noqa: E402

# plays `python -m lrmoe train ... --steps N --out DIR [--resume DIR] [--overwrite]`:
# appends its argv to DIR/../calls.jsonl; FAIL=name in the env makes that cell fail
# after its first checkpoint; otherwise writes metrics, a checkpoint and a summary.
FAKE = textwrap.dedent("""\
    #!{python}
    import json, os, sys, time
    argv = sys.argv[1:]
    t0 = time.time()
    time.sleep(float(os.environ.get("SLEEP", "0")))
    out = argv[argv.index("--out") + 1]
    steps = int(argv[argv.index("--steps") + 1])
    name = os.path.basename(out)
    with open(os.path.join(os.path.dirname(out), "calls.jsonl"), "a") as f:
        f.write(json.dumps({{"name": name, "argv": argv, "t0": t0,
                             "t1": time.time()}}) + "\\n")
    os.makedirs(os.path.join(out, "checkpoints", "step-00000001"), exist_ok=True)
    with open(os.path.join(out, "metrics.jsonl"), "w") as f:
        for s in range(1, steps + 1):
            f.write(json.dumps({{"kind": "train", "step": s, "loss": 1.0, "time_s": 0.5,
                                 "moe_time_ms": 100.0}}) + "\\n")
        f.write(json.dumps({{"kind": "eval", "step": steps, "val_loss": 1.0,
                             "val_ppl": 2.718}}) + "\\n")
    if os.environ.get("FAIL") == name:
        sys.exit(3)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump({{"steps": steps}}, f)
""")


@pytest.fixture
def fake_python(tmp_path):
    path = tmp_path / "fake-python"
    path.write_text(FAKE.format(python=sys.executable))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def _calls(root):
    return [json.loads(l) for l in (root / "calls.jsonl").read_text().splitlines()]


def test_grid_runs_skips_resumes_and_records_failures(tmp_path, fake_python, monkeypatch,
                                                      capsys):
    root = tmp_path / "grid"
    cells = [grid.Cell("a", ["-c", "0"], {"rate": 0.0, "seed": 0}),
             grid.Cell("b", ["-c", "0.2"], {"rate": 0.2, "seed": 0})]
    monkeypatch.setenv("FAIL", "b")
    status = grid.run_grid(cells, root, ["--preset", "tiny"], 4, python=fake_python)
    assert status == {"a": "done", "b": "failed (exit 3)"}
    first = _calls(root)
    assert [c["name"] for c in first] == ["a", "b"]
    assert first[0]["argv"][:7] == ["-m", "lrmoe", "train", "--preset", "tiny", "-c", "0"]
    assert "--resume" not in first[1]["argv"] and "--overwrite" not in first[1]["argv"]
    assert (root / "logs" / "b.log").is_file()

    # second run: a is finished (skipped), b has a checkpoint (resumed)
    monkeypatch.delenv("FAIL")
    status = grid.run_grid(cells, root, ["--preset", "tiny"], 4, python=fake_python)
    assert status == {"a": "skipped", "b": "done"}
    second = _calls(root)[len(first):]
    assert [c["name"] for c in second] == ["b"]
    argv = second[0]["argv"]
    assert argv[argv.index("--resume") + 1] == str(root / "b")

    # more steps: both continue from their checkpoints
    status = grid.run_grid(cells, root, ["--preset", "tiny"], 6, python=fake_python)
    assert status == {"a": "done", "b": "done"}

    # a run directory without a checkpoint (killed during set-up) starts over
    (root / "c").mkdir()
    (root / "c" / "metrics.jsonl").write_text("")
    status = grid.run_grid([grid.Cell("c", [], {})], root, [], 2, python=fake_python)
    assert status == {"c": "done"}
    assert "--overwrite" in _calls(root)[-1]["argv"]

    # pruning: a finished cell loses its checkpoints, keeps its metrics and summary
    grid.run_grid([grid.Cell("d", [], {})], root, [], 2, python=fake_python,
                  prune_checkpoints=True)
    assert not (root / "d" / "checkpoints").exists()
    assert (root / "d" / "summary.json").is_file() and (root / "d" / "metrics.jsonl").is_file()
    assert grid.cell_state(root / "d", 2) == "done"
    # ... and while it ran it was told to keep only its newest checkpoint
    argv = _calls(root)[-1]["argv"]
    assert argv[argv.index("run.keep_checkpoints=1") - 1] == "--set"
    assert "run.keep_checkpoints=1" not in _calls(root)[-2]["argv"]  # not without pruning

    records = grid.collect(cells, root)
    assert json.loads((root / "results.json").read_text()) == records
    assert [r["name"] for r in records] == ["a", "b"]
    assert records[0]["summary"] == {"steps": 6}
    assert records[1]["labels"] == {"rate": 0.2, "seed": 0}
    assert len(records[0]["train"]) == 6 and records[0]["evals"][0]["val_ppl"] == 2.718


def test_grid_runs_cells_at_the_same_time_with_jobs(tmp_path, fake_python, monkeypatch):
    root = tmp_path / "grid"
    cells = [grid.Cell(n, [], {"seed": i}) for i, n in enumerate("abcd")]
    monkeypatch.setenv("SLEEP", "1.0")
    monkeypatch.setenv("FAIL", "c")
    status = grid.run_grid(cells, root, [], 2, python=fake_python, jobs=4)
    assert status == {"a": "done", "b": "done", "c": "failed (exit 3)", "d": "done"}
    calls = _calls(root)
    assert sorted(c["name"] for c in calls) == ["a", "b", "c", "d"]
    # all four were running at one moment: the last start precedes the first end
    assert max(c["t0"] for c in calls) < min(c["t1"] for c in calls)
    records = grid.collect(cells, root)
    assert [r["jobs"] for r in records] == [4, 4, 4, 4]
    # the re-run resumes only the failed cell, now alone, and records that
    monkeypatch.delenv("FAIL")
    monkeypatch.setenv("SLEEP", "0")
    status = grid.run_grid(cells, root, [], 2, python=fake_python, jobs=1)
    assert status == {"a": "skipped", "b": "skipped", "c": "done", "d": "skipped"}
    assert [r["jobs"] for r in grid.collect(cells, root)] == [4, 4, 1, 4]
    with pytest.raises(ValueError, match="jobs"):
        grid.run_grid(cells, root, [], 2, python=fake_python, jobs=0)


def test_grid_refuses_bad_cells(tmp_path):
    with pytest.raises(ValueError, match="Cell.name"):
        grid.Cell("a/b", [], {})
    cells = [grid.Cell("a", [], {}), grid.Cell("a", [], {})]
    with pytest.raises(ValueError, match="unique"):
        grid.run_grid(cells, tmp_path, [], 3)
    with pytest.raises(ValueError, match="steps"):
        grid.run_grid(cells[:1], tmp_path, [], 0)


def _rec(seed, ppls, losses=None, labels=None, train=None):
    evals = [{"step": 10 * (i + 1), "val_ppl": p,
              "val_loss": (losses[i] if losses else math.log(p))} for i, p in enumerate(ppls)]
    return {"labels": {"seed": seed, **(labels or {})}, "evals": evals,
            "train": train or []}


def test_final_ppl_and_dppl_by_hand():
    base = _rec(0, [50.0, 12.0, 10.0, 11.0])
    run = _rec(0, [60.0, 13.0, 11.0, 11.5])
    # last 3 evaluations: (12 + 10 + 11) / 3 = 11 and (13 + 11 + 11.5) / 3 = 11.8333...
    assert analysis.final_ppl(base, 3) == pytest.approx(11.0)
    rel, ab = analysis.dppl(run, base, 3)
    assert ab == pytest.approx(35.5 / 3 - 11.0)
    assert rel == pytest.approx((35.5 / 3) / 11.0 - 1.0)
    assert analysis.final_ppl({"evals": []}) is None
    with pytest.raises(ValueError, match="last_evals"):
        analysis.final_ppl(base, 0)


def test_dppl_table_pairs_each_run_with_its_seed():
    recs = [_rec(0, [10.0], labels={"rate": 0.0}), _rec(1, [20.0], labels={"rate": 0.0}),
            _rec(0, [11.0], labels={"rate": 0.3}), _rec(1, [23.0], labels={"rate": 0.3})]
    rows = analysis.dppl_table(recs, ["rate"], lambda r: r["labels"]["rate"] == 0, 1)
    row = next(r for r in rows if r["rate"] == 0.3)
    # seed 0: +10 %, seed 1: +15 % -> mean 12.5 %, sample sd = 5 / sqrt(2)
    assert row["dppl_pct"] == pytest.approx(12.5)
    assert row["dppl_pct_sd"] == pytest.approx(5 / math.sqrt(2))
    assert row["dppl_abs"] == pytest.approx(2.0) and row["seeds"] == 2
    assert next(r for r in rows if r["rate"] == 0.0)["dppl_pct"] == pytest.approx(0.0)


def test_time_to_loss_by_hand():
    train = [{"step": s, "time_s": 0.5, "moe_time_ms": 200.0} for s in range(1, 41)]
    rec = _rec(0, [9.0, 8.0, 7.0, 6.0], losses=[3.0, 2.6, 2.4, 2.0], train=train)
    hit = analysis.time_to_loss(rec, 2.5)      # first eval at or below 2.5: step 30
    assert hit == {"step": 30, "wall_s": pytest.approx(15.0), "moe_s": pytest.approx(6.0)}
    assert analysis.time_to_loss(rec, 1.0) is None
    rec["train"] = [{"step": s, "time_s": 1.0} for s in range(1, 41)]
    assert math.isnan(analysis.time_to_loss(rec, 2.5)["moe_s"])


def test_time_to_loss_keeps_only_steps_of_cells_that_shared_the_device():
    import time_to_loss
    train = [{"step": s, "time_s": 0.5, "moe_time_ms": 200.0} for s in range(1, 41)]
    rec = _rec(0, [9.0, 8.0], losses=[3.0, 2.0], train=train)
    alone = time_to_loss._times_only_if_alone(analysis.time_to_loss(rec, 2.5),
                                              {**rec, "jobs": 1})
    assert alone == {"step": 20, "wall_s": pytest.approx(10.0), "moe_s": pytest.approx(4.0)}
    for jobs in (3, None):  # None: the runner's record is missing, it may have shared
        shared = time_to_loss._times_only_if_alone(analysis.time_to_loss(rec, 2.5),
                                                   {**rec, "jobs": jobs})
        assert shared["step"] == 20 and math.isnan(shared["wall_s"]) \
            and math.isnan(shared["moe_s"])


def test_full_grid_holds_every_recipe_cell_once_most_important_first():
    import argparse
    import full_grid
    import rate_sweep
    args = argparse.Namespace(preset="tiny", steps=3, seeds=[0, 1], device="cpu",
                              eval_every=None, last_evals=3, sets=[], out=None,
                              analyse_only=False, prune_checkpoints=False, jobs=1,
                              dry_run=True)
    spaces = full_grid.namespaces(args)
    cells = full_grid.cells(spaces)
    names = [c.name for c in cells]
    assert len(names) == len(set(names))
    # by hand, per seed: 6 rates (lrm topk) + 3 other metrics at 0.3 + selection
    # 2 x 2 x 2 minus the lrm topk proportional pair (in the rate sweep) + 2 adaptive
    assert len(cells) == 2 * (6 + 3 + 6 + 2)
    assert names[:2] == ["c0-s0", "c0-s1"] and names[-1] == "lrm-importance-water_level-c0.5-s1"
    # after the deciding cells (all seeds), every other setting runs at seed 0 first
    first_s1 = next(i for i, n in enumerate(names) if n.endswith("-s1") and
                    not n.startswith(("c0-", "c0.3-", "random-topk-c0.3-",
                                      "lrm-importance-proportional-c0.3-",
                                      "lrm-importance-proportional-c0.5-")))
    assert names[first_s1 - 1] == "lrm-importance-water_level-c0.5-s0"
    assert all(n.endswith("-s1") for n in names[first_s1:])
    assert {c.name for c in rate_sweep.cells(spaces["rate_sweep"])} <= set(names)
    rho = next(c for c in cells if c.name == "lrm-importance-rho0.99-cap0.5-s1")
    assert list(rho.args) == ["-c", "0.5", "--retained-mass-target", "0.99", "--metric",
                              "lrm", "--selection", "importance", "--set", "seed=1"]


def test_adaptive_rate_mean_dropped_by_hand():
    import adaptive_rate
    rec = {"train": [{"dropped_fraction": 0.1}, {"dropped_fraction": 0.3}, {"loss": 1.0}]}
    assert adaptive_rate.mean_dropped(rec) == pytest.approx(0.2)
    assert math.isnan(adaptive_rate.mean_dropped({"train": []}))


def test_recipe_tables_leave_out_cells_that_did_not_finish(tmp_path, monkeypatch):
    import argparse
    import recipe
    root = tmp_path / "g"
    for name, summary, ppl in (("a", {"steps": 4}, 10.0), ("b", None, 99.0),
                               ("c", {"steps": 4, "interrupted": True}, 98.0),
                               ("d", {"steps": 2}, 97.0)):
        (root / name).mkdir(parents=True)
        (root / name / "metrics.jsonl").write_text(json.dumps(
            {"kind": "eval", "step": 2, "val_loss": 1.0, "val_ppl": ppl}) + "\n")
        if summary:
            (root / name / "summary.json").write_text(json.dumps(summary))
    cells = [grid.Cell(n, [], {"seed": 0}) for n in "abcd"]
    seen = []
    args = argparse.Namespace(steps=4, seeds=[0], last_evals=1, jobs=1, out=str(root),
                              dry_run=False, analyse_only=True)
    rc = recipe.main("t", args, cells, lambda recs, out, a: seen.extend(recs) or "body",
                     argv=["--analyse-only"])
    assert rc == 0 and [r["name"] for r in seen] == ["a"]
    assert (root / "report.md").read_text().endswith("run them): b, c, d\n")


@pytest.mark.parametrize("sigint_ignored_at_start", [False, True])
def test_ctrl_c_of_a_terminal_keeps_the_running_cells_checkpoint(tmp_path,
                                                                 sigint_ignored_at_start):
    """A terminal's Ctrl-C reaches the runner and its child `lrmoe train` (one process
    group), and the runner passes it on as well: the cell still saves, the log keeps the
    child's last lines, and the recipe exits 130 with one line instead of a traceback. (Two
    SIGINTs often coalesce in the child; that the trainer counts them as one when they do
    not is test_train.py::test_sigint_saves_and_resume_continues.)

    Also when the runner starts with SIGINT ignored, as a shell's background job does
    (``bash scripts/test.sh &``): this test failed so ("no cell finished", exit 1), since
    Python installs its SIGINT handler only over the default (issue 26)."""
    import signal
    import subprocess
    import time

    def ignore_sigint():
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    text = tmp_path / "text.txt"
    text.write_text((ROOT / "docs" / "algorithm.md").read_text())
    micro = ["model.hidden_size=32", "model.num_hidden_layers=1", "model.num_attention_heads=2",
             "model.num_key_value_heads=1", "model.head_dim=16", "model.intermediate_size=64",
             "model.moe_intermediate_size=16", "model.num_experts=4", "data.vocab_size=300",
             "data.seq_len=128", "data.batch_size=2", "run.eval_every=0", "run.save_every=0",
             "run.torch_threads=1", f"data.source=text:{text}", "run.progress=none"]
    out = tmp_path / "grid"
    cmd = [sys.executable, str(ROOT / "experiments" / "rate_sweep.py"), "--device", "cpu",
           "--steps", "100000", "--seeds", "0", "--rates", "0", "--out", str(out),
           *[x for s in micro for x in ("--set", s)]]
    env = dict(os.environ, LRMOE_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=env,  # its own group: our "terminal"
                            preexec_fn=ignore_sigint if sigint_ignored_at_start else None)
    metrics = out / "c0-s0" / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None and \
            (not metrics.is_file() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()
    os.killpg(proc.pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and "run the same command again" in stderr, stderr
    assert list((out / "c0-s0" / "checkpoints").iterdir()), "the cell lost its checkpoint"
    assert "interrupted at step" in (out / grid.LOG_DIR / "c0-s0.log").read_text()


def test_a_finished_cell_is_never_retrained_by_a_changed_steps(tmp_path, fake_python):
    """A pruned cell finished at 2 steps: --steps 3 would have started it over and
    replaced its results; the runner refuses before running any cell, files intact."""
    root = tmp_path / "grid"
    cells = [grid.Cell("a", [], {}), grid.Cell("b", [], {})]
    grid.run_grid(cells[:1], root, [], 2, python=fake_python, prune_checkpoints=True)
    before = (root / "a" / "metrics.jsonl").read_text()
    assert grid.cell_state(root / "a", 3) == "short"
    with pytest.raises(ValueError, match=r"--steps 2"):
        grid.run_grid(cells, root, [], 3, python=fake_python)
    assert (root / "a" / "metrics.jsonl").read_text() == before
    assert not (root / "b").exists() and len(_calls(root)) == 1  # nothing else ran


def test_a_cell_started_over_keeps_its_earlier_files(tmp_path, fake_python):
    """A run that died before its first checkpoint (summary marked interrupted) starts
    over; its metrics and summary move to logs/<cell>.previous/ first."""
    root = tmp_path / "grid"
    (root / "a").mkdir(parents=True)
    (root / "a" / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n')
    (root / "a" / "summary.json").write_text('{"steps": 1, "interrupted": true}')
    grid.run_grid([grid.Cell("a", [], {})], root, [], 2, python=fake_python)
    kept = root / "logs" / "a.previous"
    assert (kept / "metrics.jsonl").read_text() == '{"kind": "train", "step": 1}\n'
    assert json.loads((kept / "summary.json").read_text())["interrupted"] is True
    assert json.loads((root / "a" / "summary.json").read_text()) == {"steps": 2}


def _cell_files(root, name, lines, summary):
    (root / name).mkdir(parents=True)
    (root / name / "metrics.jsonl").write_text("".join(l + "\n" for l in lines))
    (root / name / "summary.json").write_text(summary)


def test_collect_marks_unreadable_cells_instead_of_reading_part_of_them(tmp_path):
    ev = lambda s, p: json.dumps({"kind": "eval", "step": s, "val_loss": 1.0, "val_ppl": p})
    root = tmp_path / "g"
    _cell_files(root, "good", [ev(10, 5.0), ev(20, 4.0), '{"kind": "ev'],  # torn last line
                '{"steps": 20, "last_val_step": 20}')
    _cell_files(root, "midbad", [ev(10, 5.0), "garbage", ev(20, 4.0)], '{"steps": 20}')
    _cell_files(root, "cut", [ev(10, 5.0)], '{"steps": 20, "last_val_step": 20}')
    _cell_files(root, "nonum", [json.dumps({"kind": "eval", "step": 20})], '{"steps": 20}')
    _cell_files(root, "listsum", [ev(20, 4.0)], "[1]")
    _cell_files(root, "listline", [ev(20, 4.0), "42", ev(30, 3.0)], '{"steps": 20}')
    names = ["good", "midbad", "cut", "nonum", "listsum", "listline"]
    recs = {r["name"]: r for r in grid.collect([grid.Cell(n, [], {}) for n in names], root)}
    assert recs["good"]["corrupt"] is None and len(recs["good"]["evals"]) == 2
    assert grid.finished(recs["good"], 20)
    assert "midbad/metrics.jsonl:2" in recs["midbad"]["corrupt"]
    assert "ends at evaluation step 10" in recs["cut"]["corrupt"]
    assert "without numbers" in recs["nonum"]["corrupt"]
    assert "summary.json is not a readable JSON object" in recs["listsum"]["corrupt"]
    assert "listline/metrics.jsonl:2" in recs["listline"]["corrupt"]
    assert not any(grid.finished(recs[n], 20) for n in names[1:])


def _args(root, **kw):
    import argparse
    base = dict(steps=20, seeds=[0], last_evals=2, jobs=1, out=str(root), dry_run=False,
                analyse_only=True, eval_every=None, preset="tiny", device="cpu", sets=[],
                prune_checkpoints=False)
    return argparse.Namespace(**{**base, **kw})


def test_recipe_reports_what_it_left_out_and_why(tmp_path, capsys):
    import recipe
    ev = lambda s, p: json.dumps({"kind": "eval", "step": s, "val_loss": 1.0, "val_ppl": p})
    root = tmp_path / "g"
    _cell_files(root, "a", [ev(0, 900.0), ev(10, 5.0), ev(20, 4.0)], '{"steps": 20}')
    _cell_files(root, "longer", [ev(10, 5.0), ev(30, 3.0)], '{"steps": 30}')
    _cell_files(root, "bad", [ev(10, 5.0), "x", ev(20, 4.0)], '{"steps": 20}')
    _cell_files(root, "one", [ev(0, 900.0), ev(20, 4.0)], '{"steps": 20}')
    cells = [grid.Cell(n, [], {"seed": 0}) for n in ("a", "longer", "bad", "one")]
    seen = []
    rc = recipe.main("t", _args(root), cells,
                     lambda recs, out, a: seen.extend(recs) or "body", argv=[])
    assert rc == 0 and [r["name"] for r in seen] == ["a", "one"]
    report = (root / "report.md").read_text()
    assert "Ran other than --steps 20 (left out of the tables): longer (30 steps)" in report
    assert "Unreadable (left out of the tables):" in report and "bad/metrics.jsonl:2" in report
    assert "evaluations after step 0" in report and ": one" in report
    # the final perplexity never includes the untrained model's step-0 evaluation
    assert analysis.final_ppl(seen[0], 3) == pytest.approx(4.5)
    assert analysis.final_ppl(seen[1], 3) == pytest.approx(4.0)


def test_recipe_refuses_before_any_work(tmp_path, capsys, fake_python):
    import recipe
    root = tmp_path / "g"
    root.mkdir()
    (root / "report.md").write_text("someone else's report\n")
    cells = [grid.Cell("a", [], {"seed": 0})]
    body = lambda recs, out, a: "body"
    # --analyse-only of a folder holding no cell of the grid: its files stay
    assert recipe.main("t", _args(root), cells, body, argv=[]) == 2
    assert "holds no cell of this grid" in capsys.readouterr().err
    assert (root / "report.md").read_text() == "someone else's report\n"
    # a cell listed twice (a repeated --rates value)
    assert recipe.main("t", _args(root), cells * 2, body, argv=[]) == 2
    assert "twice: a" in capsys.readouterr().err
    # a cell whose lrmoe train would refuse its flags: found before any cell runs
    bad = [grid.Cell("ok", ["-c", "0"], {}), grid.Cell("no", ["--metric", "bogus"], {})]
    assert recipe.main("t", _args(root / "run", analyse_only=False), bad, body, argv=[]) == 2
    err = capsys.readouterr().err
    assert "cell no would not start" in err and "bogus" in err
    assert not (root / "run").exists()
    bad = [grid.Cell("r", ["-c", "1.5"], {})]
    assert recipe.main("t", _args(root / "run", analyse_only=False), bad, body, argv=[]) == 2
    assert "cell r would not start" in capsys.readouterr().err
    assert recipe.main("t", _args(root, eval_every=0), cells, body, argv=[]) == 2
    assert "--eval-every" in capsys.readouterr().err
    assert recipe.main("t", _args(root, out=""), cells, body, argv=[]) == 2
    assert "--out is empty" in capsys.readouterr().err


def test_dppl_table_counts_the_pairs_its_mean_is_over():
    recs = [_rec(0, [10.0], labels={"rate": 0.0}), _rec(1, [20.0], labels={"rate": 0.0}),
            _rec(0, [11.0], labels={"rate": 0.3}), _rec(1, [math.nan], labels={"rate": 0.3}),
            _rec(2, [30.0], labels={"rate": 0.3})]  # seed 2 has no baseline
    rows = analysis.dppl_table(recs, ["rate"], lambda r: r["labels"]["rate"] == 0, 1)
    row = next(r for r in rows if r["rate"] == 0.3)
    assert row["seeds"] == 1 and row["dppl_pct"] == pytest.approx(10.0)


def test_t_critical_against_closed_forms_and_the_normal_limit():
    from statistics import NormalDist
    for p in (0.5, 0.9, 0.95, 0.99):
        # df = 1 (Cauchy): P(|T| <= t) = 2 atan(t) / pi; df = 2: t / sqrt(2 + t^2)
        assert analysis.t_critical(p, 1) == pytest.approx(math.tan(math.pi * p / 2), rel=1e-9)
        assert analysis.t_critical(p, 2) == pytest.approx(p * math.sqrt(2 / (1 - p * p)),
                                                          rel=1e-9)
        assert analysis.t_critical(p, 100_001) == pytest.approx(
            NormalDist().inv_cdf(0.5 + p / 2), rel=1e-4)
    # the tables' 95 % values, 4 digits (df 3, 4, 5, 10, 30)
    for df, t in ((3, 3.182), (4, 2.776), (5, 2.571), (10, 2.228), (30, 2.042)):
        assert analysis.t_critical(0.95, df) == pytest.approx(t, abs=6e-4)
    with pytest.raises(ValueError, match="confidence"):
        analysis.t_critical(1.0, 3)
    with pytest.raises(ValueError, match="df"):
        analysis.t_critical(0.95, 0)


def test_mean_interval_by_hand():
    m, lo, hi, n = analysis.mean_interval([1.0, 2.0, 3.0, float("nan")])
    half = 4.302652729749 * 1.0 / math.sqrt(3)  # t_{0.975, 2} * sd / sqrt(n), sd = 1
    assert (m, n) == (2.0, 3) and lo == pytest.approx(2 - half) and hi == pytest.approx(2 + half)
    m, lo, hi, n = analysis.mean_interval([5.0])
    assert m == 5.0 and n == 1 and math.isnan(lo) and math.isnan(hi)


def test_dppl_table_reports_the_paired_t_interval():
    recs = [_rec(0, [10.0], labels={"rate": 0.0}), _rec(1, [20.0], labels={"rate": 0.0}),
            _rec(0, [11.0], labels={"rate": 0.3}), _rec(1, [23.0], labels={"rate": 0.3})]
    row = next(r for r in analysis.dppl_table(recs, ["rate"],
                                              lambda r: r["labels"]["rate"] == 0, 1)
               if r["rate"] == 0.3)
    # pairs +10 % and +15 %: mean 12.5, sd 5 / sqrt(2), n 2, t_{0.975, 1} = tan(0.475 pi)
    half = math.tan(0.475 * math.pi) * (5 / math.sqrt(2)) / math.sqrt(2)
    assert row["dppl_pct_lo"] == pytest.approx(12.5 - half)
    assert row["dppl_pct_hi"] == pytest.approx(12.5 + half)


def test_metric_ablation_pairs_each_metric_with_lrm_of_its_seed_and_rate():
    import metric_ablation

    def run(seed, metric, rate, ppl):
        return _rec(seed, [ppl], labels={"metric": metric, "rate": rate})

    recs = [run(0, "none", 0.0, 9.0), run(1, "none", 0.0, 18.0),
            run(0, "lrm", 0.5, 10.0), run(1, "lrm", 0.5, 20.0),
            run(0, "random", 0.5, 12.0), run(1, "random", 0.5, 21.0),
            run(0, "grad_sq", 0.3, 5.0)]  # no lrm at 0.3: no row
    rows = metric_ablation.vs_lrm(recs, 1)
    assert [(r["metric"], r["rate"]) for r in rows] == [("random", 0.5)]
    # seed 0: 12 / 10 -> +20 %, seed 1: 21 / 20 -> +5 %: mean 12.5, sd 15 / sqrt(2)
    half = math.tan(0.475 * math.pi) * (15 / math.sqrt(2)) / math.sqrt(2)
    assert rows[0]["dppl_pct"] == pytest.approx(12.5) and rows[0]["seeds"] == 2
    assert rows[0]["dppl_pct_lo"] == pytest.approx(12.5 - half)


def test_sim_drift_pairs_seeds_and_charges_the_lag_only_under_drift(tmp_path):
    """experiments/sim_drift.py on 2 seeds x 8 steps x 2 layers: every policy has one
    number per seed, the paired gaps are the per-seed ratios' mean (recomputed here from
    the seed lists), and strongly drifting popularity (phi 0.5, sigma 1.0) makes SYMI's
    one-step lag cost clearly more than fixed popularity, where the plan it lags behind is
    the same up to sampling noise (measured 2026-12-07: +24.7 +- 4.3 % against +0.2 %)."""
    import sim_drift

    table = sim_drift.main(["--seeds", "0", "1", "--drift", "off", "0.5,1.0", "--steps", "8",
                            "--layers", "2", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "sim_drift.json").read_text())["table"]
    assert set(saved) == {"off", "0.5,1.0"}
    for row in table.values():
        for p in sim_drift.POLS:
            assert len(row[p]["seeds"]) == 2 and all(v > 0 for v in row[p]["seeds"])
        for ref in ("ultraep", "lrmoe", "symi_nolag"):
            gaps = [a / b - 1 for a, b in zip(row["symi"]["seeds"], row[ref]["seeds"])]
            assert row[f"symi_over_{ref}"]["mean"] == pytest.approx(sum(gaps) / 2)
    off, drift = table["off"]["symi_over_symi_nolag"], table["0.5,1.0"]["symi_over_symi_nolag"]
    assert abs(off["mean"]) < 0.02 and drift["mean"] > off["mean"] + 0.05, (off, drift)


def test_sim_figs_seeds_mean_and_t_interval_by_hand(tmp_path):
    """experiments/sim_figs_seeds.py on 2 seeds x 1 step: every policy's per-seed values
    are the runs' own sim.json numbers, the mean is theirs, and the interval is the
    Student t one computed by hand (t_{0.975,1} = tan(0.475 pi) for 2 values)."""
    import sim_figs_seeds

    res = sim_figs_seeds.main(["--seeds", "0", "1", "--steps", "1", "--out", str(tmp_path)])
    t1 = math.tan(0.475 * math.pi)
    for p in sim_figs_seeds.POLS:
        for k, (_, scale) in sim_figs_seeds.FIELDS.items():
            runs = [json.loads((tmp_path / f"s{s}" / "sim.json").read_text())["policies"][p][k]
                    * scale for s in (0, 1)]
            v = res["policies"][p][k]
            assert v["values"] == pytest.approx(runs)
            m = (runs[0] + runs[1]) / 2
            half = t1 * abs(runs[0] - runs[1]) / math.sqrt(2) / math.sqrt(2)
            assert v["mean"] == pytest.approx(m)
            assert v["lo"] == pytest.approx(m - half) and v["hi"] == pytest.approx(m + half)
    saved = json.loads((tmp_path / "sim_figs_seeds.json").read_text())
    assert saved["seeds"] == [0, 1]
