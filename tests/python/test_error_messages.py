"""Error messages of the C++ ops reach Python intact.

On the lent H200 (torch 2.11 image) an op whose error message streamed a double crashed
the process (SIGSEGV) instead of raising; messages now format doubles with snprintf
(``format_double`` in csrc/ops/common.h). One real error per kind is raised end to end
here, on the CPU in CI and on the GPU machine by tools/device/device_gpu_tests.sh.

Below: user mistakes on the command line (lrmoe/cli.py, experiments/recipe.py) end in a
clear error naming the flag, exit status 2, before any work and with nothing written.
"""
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lrmoe import ops


@pytest.mark.parametrize("call,match", [
    (lambda: ops.quota(torch.tensor([4, 2, 3], dtype=torch.int32), 1.0),
     r"recalibration_rate must be in \[0, 1\), got 1 "),
    (lambda: ops.quota(torch.tensor([4, 2, 3], dtype=torch.int32), float("nan")),
     "got nan"),
    (lambda: ops.gather_rows(torch.randn(4, 8), torch.zeros(3, dtype=torch.int64)), "index"),
    (lambda: ops.select(torch.rand(4), torch.arange(4, dtype=torch.int32),
                        torch.tensor([4], dtype=torch.int32),
                        torch.tensor([2], dtype=torch.int32), 3), "num_retained"),
])
def test_op_errors_reach_python(call, match):
    with pytest.raises(RuntimeError, match=match):
        call()


# ------------------------------------------------- user mistakes on the command line
# Each must end in one line naming the flag, exit status 2, before any work and without
# writing anything (the old code measured or trained first, then died in an OSError
# traceback or a message that named no flag).
from lrmoe import cli  # noqa: E402


def _usage_error(argv, capsys, match):
    assert cli.main(argv) == cli.EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert re.search(match, err), err


def test_check_output_refuses_unwritable_paths_and_writes_nothing(tmp_path):
    from lrmoe.utils.paths import check_output

    a_file = tmp_path / "f"
    a_file.write_text("x")
    with pytest.raises(ValueError, match=r"--out .*/f is a file; name a folder"):
        check_output("--out", a_file, is_dir=True)
    with pytest.raises(ValueError, match=r"--out .* is a folder; name a file"):
        check_output("--out", tmp_path, is_dir=False)
    with pytest.raises(ValueError, match=r"/f is a file, so no folder can be made"):
        check_output("--out", a_file / "sub" / "c.json", is_dir=False)
    assert check_output("--out", tmp_path / "new" / "deep", is_dir=True) == \
        tmp_path / "new" / "deep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]  # nothing created


def test_calibrate_checks_out_and_iters_before_measuring(tmp_path, capsys):
    _usage_error(["calibrate", "--quick", "--device", "cpu", "--shapes", "smoke",
                  "--out", str(tmp_path)], capsys, r"--out .* is a folder")
    _usage_error(["calibrate", "--quick", "--device", "cpu", "--shapes", "smoke",
                  "--out", str(tmp_path / "c.json"), "--iters", "0"], capsys,
                 "--iters must be >= 1, got 0")
    assert list(tmp_path.iterdir()) == []


def test_sim_checks_inputs_and_out_before_simulating(tmp_path, capsys):
    a_file = tmp_path / "f"
    a_file.write_text("x")
    costs = str(tmp_path / "missing.json")
    _usage_error(["sim", "--costs", str(tmp_path), "--out", str(tmp_path / "o")], capsys,
                 "no cost file at")
    _usage_error(["sim", "--costs", str(a_file), "--out", str(tmp_path / "o")], capsys,
                 r"/f: not a cost file \(not JSON")
    real = str(tmp_path / "costs.json")
    (tmp_path / "costs.json").write_text('{"format": "lrmoe-costs/1", "shapes": {}}')
    _usage_error(["sim", "--costs", real, "--trace", costs, "--out", str(tmp_path / "o")],
                 capsys, r"--trace .*missing.json: no such file")
    _usage_error(["sim", "--costs", real, "--out", str(a_file)], capsys,
                 r"--out .*/f is a file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["costs.json", "f"]


def test_wordnet_alpaca_out_folder_and_max_senses(tmp_path, capsys):
    _usage_error(["data", "wordnet-alpaca", "--out", str(tmp_path), "--wordnet-dir",
                  str(tmp_path)], capsys, r"--out .* is a folder")
    _usage_error(["data", "wordnet-alpaca", "--out", str(tmp_path / "w.jsonl"),
                  "--max-senses", "0"], capsys, "--max-senses must be >= 1, got 0")
    assert list(tmp_path.iterdir()) == []


def test_train_refuses_out_file_and_budget_without_policy(tmp_path, capsys):
    a_file = tmp_path / "f"
    a_file.write_text("x")
    base = ["train", "--preset", "tiny", "--device", "cpu", "--steps", "1"]
    _usage_error(base + ["--out", str(a_file)], capsys, r"--out .*/f is a file")
    for flag, value in (("--memory-budget", "abc"), ("--memory-budget", "80GiB"),
                        ("--resident-bytes", "10")):
        _usage_error(base + ["--out", str(tmp_path / "r"), flag, value], capsys,
                     rf"\({flag}\) is used by a placement plan only; add --policy")
    assert a_file.read_text() == "x" and sorted(p.name for p in tmp_path.iterdir()) == ["f"]


@pytest.mark.parametrize("recipe", ["rate_sweep.py", "sft.py"])
def test_recipes_usage_errors_exit_2_without_traceback(tmp_path, recipe):
    a_file = tmp_path / "f"
    a_file.write_text("x")
    script = Path(__file__).resolve().parents[2] / "experiments" / recipe
    extra = ["--sft-data", str(a_file)] if recipe == "sft.py" else []
    for bad in (["--jobs", "0"], ["--out", str(a_file)]):
        got = subprocess.run([sys.executable, str(script), "--dry-run", *extra, *bad],
                             capture_output=True, text=True, timeout=600)
        assert got.returncode == 2, got.stderr
        assert "Traceback" not in got.stderr and bad[0] in got.stderr, got.stderr
    if recipe == "sft.py":  # running (not analysing) needs the fine-tuning data
        got = subprocess.run([sys.executable, str(script), "--dry-run", "--out",
                              str(tmp_path / "r")], capture_output=True, text=True, timeout=600)
        assert got.returncode == 2 and "Traceback" not in got.stderr, got.stderr
        assert "--sft-data PATH is required" in got.stderr, got.stderr
    for bad, says in ((["--seeds", "0", "0"], "--seeds lists a seed twice"),
                      (["--analyse-only", "--out", str(tmp_path / "none")],
                       "no grid there to analyse")):
        got = subprocess.run([sys.executable, str(script), *extra, *bad], capture_output=True,
                             text=True, timeout=600)
        assert got.returncode == 2 and "Traceback" not in got.stderr, got.stderr
        assert says in got.stderr, got.stderr


def test_bench_layer_checks_out_and_profile_dir_before_timing(tmp_path, capsys):
    a_file = tmp_path / "f"
    a_file.write_text("x")
    for flag in ("--out", "--profile-dir"):
        good = [] if flag == "--out" else ["--out", str(tmp_path / "o")]
        _usage_error(["bench", "layer", "--smoke", "--device", "cpu", *good, flag,
                      str(a_file)], capsys, rf"{flag} .*/f is a file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_bench_layer_checks_device_and_trace_before_timing(tmp_path, capsys):
    """A --device typo under --ep ran on gloo and the CPU; a missing or mismatched
    --trace failed after the routings before it had been timed."""
    import torch

    from lrmoe.workload.trace import RoutingTrace

    out = ["--out", str(tmp_path / "o")]
    for device in ("banana", "gpu", "cuda0"):
        _usage_error(["bench", "layer", "--smoke", "--device", device, *out], capsys,
                     rf"--device must be cpu, cuda or cuda:N, got '{device}'")
    base = ["bench", "layer", "--shapes", "smoke", "--device", "cpu", *out]
    _usage_error(base + ["--routing", "uniform", "trace"], capsys,
                 r"--routing trace needs --trace PATH")
    trace = RoutingTrace(num_experts=3, top_k=1)  # the smoke shape is not E=3, K=1
    trace.record(0, torch.zeros((4, 1), dtype=torch.int64))
    path = trace.save(tmp_path / "t.npz")
    _usage_error(base + ["--routing", "uniform", "trace", "--trace", str(path)], capsys,
                 r"--trace .*t\.npz was recorded with E=3, K=1, but --shapes smoke has")
    assert not (tmp_path / "o").exists()
    for flag, values in (("--rates", ["0.1", "0.1"]), ("--routing", ["skewed", "skewed"])):
        _usage_error(base + [flag, *values], capsys, rf"{flag} lists a value twice")
    for flag, value in (("--iters", "50"), ("--shapes", "glm-4.5-air"), ("--tokens", "512")):
        _usage_error(["bench", "layer", "--smoke", "--device", "cpu", *out, flag, value],
                     capsys, rf"--smoke fixes {flag} .*; drop {flag}, or drop --smoke")


@pytest.mark.parametrize("text", ["1.2.3", ".", "80 GiBs", "-1", "abc"])
def test_memory_budget_typos_name_the_flag_and_the_fix(text):
    from lrmoe.training.config import ParallelConfig

    with pytest.raises(ValueError, match=r"parallel\.memory_budget: cannot read .* as a "
                                         r"size; write e\.g\. 80GiB"):
        ParallelConfig(ep_size=2, policy="lrmoe", memory_budget=text).validate()


def test_sim_refuses_a_trace_that_is_not_one_and_a_rate_out_of_range(tmp_path, capsys):
    import numpy as np

    costs = Path(__file__).resolve().parents[2] / "configs/costs/h200-from-performance-md.json"
    (tmp_path / "t.txt").write_text("not a trace")
    np.savez(tmp_path / "other.npz", x=np.arange(3))
    base = ["sim", "--costs", str(costs), "--out", str(tmp_path / "o"), "--steps", "1",
            "--pressure"]
    for name in ("t.txt", "other.npz"):
        _usage_error(base + ["--trace", str(tmp_path / name)], capsys,
                     rf"{name} is not a routing trace .*--record-trace")
    _usage_error(base + ["--rate", "1.5"], capsys, r"--rate .* \[0, 1\), got 1.5")
    for flag in ("--results", "--validate"):
        _usage_error(base + [flag, str(tmp_path / "t.txt")], capsys,
                     rf"{flag} .*t.txt: not a JSON file")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("flag,value,match", [
    ("--tokens-per-gpu", "0", "--tokens-per-gpu must be >= 1, got 0"),
    ("--budget-gib", "-1", r"--budget-gib must be >= 0, got -1"),
    ("--threads", "0", "--threads must be >= 1, got 0"),
    ("--skew", "0.5", "--skew is the max/mean expert load"),
    ("--pressure", "0", r"--pressure multipliers must be > 0"),
    ("--scale", "12", r"--scale 12: a cluster size must divide E=128"),
    # issue 26: an OverflowError traceback before
    ("--budget-gib", "1e308", r"--budget-gib 1e\+308 is more than 2\^32 GiB"),
    ("--resident-gib", "inf", r"--resident-gib inf is more than 2\^32 GiB"),
])
def test_sim_size_flags_are_named(tmp_path, capsys, flag, value, match):
    costs = Path(__file__).resolve().parents[2] / "configs/costs/h200-from-performance-md.json"
    _usage_error(["sim", "--costs", str(costs), "--out", str(tmp_path / "o"), "--steps", "1",
                  "--layers", "1", "--pressure", "--policies", "fixed", flag, value],
                 capsys, match)
    assert not (tmp_path / "o").exists()


def test_sim_results_without_runs_is_named(tmp_path, capsys):
    """Issue 26: ``--results`` of a file with no runs said nothing (Table 1 came out
    empty)."""
    costs = Path(__file__).resolve().parents[2] / "configs/costs/h200-from-performance-md.json"
    for name, text in (("empty.json", "[]"), ("nocells.json", '{"cells": []}')):
        (tmp_path / name).write_text(text)
        _usage_error(["sim", "--costs", str(costs), "--out", str(tmp_path / "o"), "--steps",
                      "1", "--results", str(tmp_path / name), "--targets", "4.0"], capsys,
                     rf"--results .*{name}: no runs in the file")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("argv,match", [
    (["--budget", "1e30"], r"--budget: '1e30' is more than 2\^62 bytes"),  # a pybind cast error
    (["--budget", "1e400"], r"--budget: '1e400' is more than 2\^62 bytes"),  # OverflowError
    (["--resident", "9e18GiB"], r"--resident: '9e18GiB' is more than 2\^62 bytes"),
    (["--budget", "80 GiBs"], r"--budget: cannot read '80 GiBs' as a size"),
    (["--record", "5"], r"--record reads a routing trace: it needs --loads trace"),  # ignored
    (["--trace", "t.npz"], r"--trace reads a routing trace: it needs --loads trace"),
])
def test_plan_flags_are_named(capsys, argv, match):
    _usage_error(["plan", *argv], capsys, match)


def test_a_misspelled_policy_is_named_before_its_needs():
    """Issue 26: ``--policy symy`` without ``--ep`` was reported as needing ep_size >= 2."""
    from lrmoe.training.config import ParallelConfig

    with pytest.raises(ValueError, match=r"parallel\.policy must be one of fixed, ultraep, "
                                         r"symi, lrmoe; got 'symy'"):
        ParallelConfig(policy="symy").validate()
    with pytest.raises(ValueError, match=r"needs parallel\.ep_size >= 2"):
        ParallelConfig(policy="symi").validate()


def test_train_record_trace_into_a_folder_fails_before_training(tmp_path, capsys):
    _usage_error(["train", "--preset", "tiny", "--device", "cpu", "--steps", "1", "--out",
                  str(tmp_path / "r"), "--record-trace", str(tmp_path)], capsys,
                 r"--record-trace .* is a folder")
    assert not (tmp_path / "r").exists()


def test_offload_memory_bench_shape_checked_before_training(tmp_path):
    script = Path(__file__).resolve().parents[2] / "experiments" / "offload_memory.py"
    got = subprocess.run([sys.executable, str(script), "--dry-run", "--out", str(tmp_path),
                          "--bench-shape", "nope"], capture_output=True, text=True,
                         timeout=600)
    assert got.returncode == 2 and "--bench-shape 'nope': choose from" in got.stderr, \
        got.stderr


@pytest.mark.parametrize("extra,match", [
    (["--iters", "0"], "--iters must be >= 1, got 0"),
    (["--rotate", "0"], "--rotate must be >= 1, got 0"),
    (["--rates", "1.5"], r"--rates are recalibration rates: --rates.recalibration_rate must "
                         r"be in \[0, 1\), got 1.5"),
    (["--append-md", "{tmp}"], r"--append-md .* is a folder"),
] + ([] if torch.cuda.is_available() else
     [(["--device", "cuda"], "--device cuda: no CUDA device here")]))
def test_bench_layer_bad_counts_rates_device_append_md(tmp_path, capsys, extra, match):
    extra = [a.replace("{tmp}", str(tmp_path)) for a in extra]
    _usage_error(["bench", "layer", "--shapes", "smoke", "--tokens", "64", "--methods",
                  "lrmoe", "--dtype", "float32", "--out", str(tmp_path / "o"), *extra],
                 capsys, match)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("argv,match", [
    (["calibrate", "--quick", "--device", "foo"], "--device must be cpu, cuda or cuda:N"),
    (["plan", "--ep", "0"], "--ep must be >= 1, got 0"),
] + ([] if torch.cuda.is_available() else
     [(["calibrate", "--quick", "--device", "cuda:0"], "--device cuda:0: no CUDA device")]))
def test_calibrate_device_and_plan_ep_named(tmp_path, capsys, argv, match):
    if argv[0] == "calibrate":
        argv = argv + ["--out", str(tmp_path / "c.json")]
    _usage_error(argv, capsys, match)
    assert list(tmp_path.iterdir()) == []
