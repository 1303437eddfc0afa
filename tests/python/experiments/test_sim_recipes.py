"""The simulator's figure recipes (experiments/sim_figs_seeds.py, sim_fig6_seeds.py,
sim_drift.py, sim_balance.py) run with the figures' planner flags
(lrmoe.sim.report.FIGURE_FLAGS) and write strict JSON (issue 30).

References: every run's own sim.json ``setup`` (what the simulator was told) against the
flags the recipe documents; the recipes' runs against ``lrmoe sim`` called directly with
the same flags; Python's JSON parser made strict (``parse_constant`` raising on NaN and
Infinity, which are not JSON: RFC 8259 section 6).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "experiments"))

from lrmoe import cli  # noqa: E402
from lrmoe.sim.report import FIGURE_FLAGS, run_sim  # noqa: E402
from lrmoe.workload.shapes import MODELS  # noqa: E402

COSTS = str(ROOT / "configs" / "costs" / "h200.json")


def strict_load(path: Path):
    """json.loads that refuses NaN, Infinity and -Infinity."""
    def refuse(name):
        raise ValueError(f"{path}: {name} is not JSON")
    return json.loads(path.read_text(), parse_constant=refuse)


def test_strict_load_refuses_nan(tmp_path):
    f = tmp_path / "x.json"
    f.write_text(json.dumps({"a": float("nan")}))
    with pytest.raises(ValueError, match="NaN is not JSON"):
        strict_load(f)


def test_sim_figs_seeds_runs_the_figure_flags_and_writes_strict_json(tmp_path):
    """One seed: the interval is undefined, and must be null, not NaN; the run is the
    one ``lrmoe sim`` gives with the documented flags."""
    import sim_figs_seeds

    res = sim_figs_seeds.main(["--seeds", "3", "--steps", "1", "--costs", COSTS,
                               "--out", str(tmp_path / "r")])
    saved = strict_load(tmp_path / "r" / "sim_figs_seeds.json")
    for p in sim_figs_seeds.POLS:
        for k in sim_figs_seeds.FIELDS:
            assert saved["policies"][p][k]["lo"] is None and saved["policies"][p][k]["hi"] is None
            assert saved["policies"][p][k]["mean"] == pytest.approx(res["policies"][p][k]["mean"])
    run = strict_load(tmp_path / "r" / "s3" / "sim.json")
    assert (run["setup"]["joint"], run["setup"]["ultraep_refine"],
            run["setup"]["spare_capacity_split"]) == (True, True, "ultraep")
    assert run["setup"]["dedup_top_k"] == MODELS["qwen3-30b-a3b"].top_k
    direct = run_sim(cli.build_parser().parse_args(
        ["sim", "--costs", COSTS, "--steps", "1", "--seed", "3", *FIGURE_FLAGS,
         "--out", str(tmp_path / "direct")]))
    for p in sim_figs_seeds.POLS:
        for k in ("bwd_ms", "memory_peak"):
            assert run["policies"][p][k] == pytest.approx(direct["policies"][p][k]), (p, k)
    # --sim-args reaches the runs: the old simulator's flags
    sim_figs_seeds.main(["--seeds", "3", "--steps", "1", "--costs", COSTS, "--out",
                         str(tmp_path / "old"), "--sim-args",
                         "--no-joint --no-ultraep-refine --dedup-top-k 1"])
    old = strict_load(tmp_path / "old" / "s3" / "sim.json")["setup"]
    assert (old["joint"], old["ultraep_refine"], old["dedup_top_k"]) == (False, False, 1)


def test_sim_fig6_seeds_writes_strict_json_with_one_seed(tmp_path):
    import sim_fig6_seeds

    sim_fig6_seeds.main(["--activations", "keep", "--seeds", "0", "--costs", COSTS,
                         "--out", str(tmp_path)])
    saved = strict_load(tmp_path / "sim_fig6_seeds_r64.json")
    lrmoe = saved["keep"]["policies"]["lrmoe"]
    assert all(v is None for v in lrmoe["rel_lo"] + lrmoe["rel_hi"])
    assert strict_load(tmp_path / "keep-r64-s0" / "sim.json")["setup"]["joint"] is True


def test_sim_drift_writes_strict_json_with_one_seed(tmp_path):
    import sim_drift

    sim_drift.main(["--seeds", "0", "--drift", "off", "--steps", "2", "--layers", "2",
                    "--costs", COSTS, "--out", str(tmp_path)])
    saved = strict_load(tmp_path / "sim_drift.json")["table"]["off"]
    assert saved["lrmoe"]["lo"] is None and saved["symi_over_ultraep"]["hi"] is None
    assert strict_load(tmp_path / "off-0" / "sim.json")["setup"]["ultraep_refine"] is True


def test_sim_json_is_strict_when_a_plan_does_not_fit(tmp_path):
    """A budget no plan fits: the per-step times are undefined (NaN in memory) and must be
    null in sim.json."""
    run_sim(cli.build_parser().parse_args(
        ["sim", "--costs", COSTS, "--steps", "1", "--layers", "2", "--pressure",
         "--budget-gib", "64.5", "--out", str(tmp_path)]))
    data = strict_load(tmp_path / "sim.json")
    assert data["policies"]["fixed"]["feasible"] < 1
    assert data["policies"]["fixed"]["moe_ms_per_step"] is None


def test_sim_drift_replays_the_committed_counts_and_refuses_a_window_past_them(tmp_path):
    # the recipe's counts:N choice end to end on the committed recording (1,200 steps)
    import sim_drift

    sim_drift.main(["--seeds", "0", "--drift", "counts:600", "--steps", "2", "--layers", "2",
                    "--costs", COSTS, "--out", str(tmp_path)])
    table = strict_load(tmp_path / "sim_drift.json")["table"]
    (key,) = table
    assert "600" in key and table[key]["lrmoe"]["mean"] > 0
    with pytest.raises((ValueError, SystemExit)):
        sim_drift.main(["--seeds", "0", "--drift", "counts:1199", "--steps", "2",
                        "--layers", "2", "--costs", COSTS, "--out", str(tmp_path / "late")])


def test_sim_drift_runs_the_counts_controls_and_refuses_a_bad_one(tmp_path):
    # counts-shuffled:N / counts-frozen:N end to end (lrmoe sim --counts-control), and
    # their loads differ from the replay's where they should (same recording, same seed)
    import sim_drift

    sim_drift.main(["--seeds", "0", "--drift", "counts:600", "counts-shuffled:600",
                    "counts-frozen:600", "--steps", "2", "--layers", "2", "--costs", COSTS,
                    "--out", str(tmp_path)])
    table = strict_load(tmp_path / "sim_drift.json")["table"]
    assert set(table) == {"counts:600", "counts-shuffled:600", "counts-frozen:600"}
    real, shuf = (strict_load(tmp_path / f"{d}-0" / "sim.json")["setup"]
                  for d in ("counts_600", "counts-shuffled_600"))
    assert real["counts_control"] == "real" and shuf["counts_control"] == "shuffled"
    assert table["counts-shuffled:600"]["fixed"]["mean"] != table["counts:600"]["fixed"]["mean"]
    for bad in ("counts-reversed:600", "counts-frozen:x"):
        with pytest.raises(ValueError, match="--drift"):
            sim_drift.main(["--seeds", "0", "--drift", bad, "--steps", "2", "--layers", "2",
                            "--costs", COSTS, "--out", str(tmp_path / "bad")])


def test_sim_balance_runs_the_joint_plan_at_the_derived_kappa(tmp_path):
    """experiments/sim_balance.py's lrmoe cells run at the replica cost ``lrmoe sim``
    derives (it ran at kappa = 0 before 2026-12-07): the cell (EP8, max/mean 2, slack
    off) against ``lrmoe sim`` called directly with the figures' flags on the same loads,
    and kappa against the 1,326 rows docs/simulation.md works out for Qwen3 EP8 on the
    H200 calibration ("The joint plan's replica cost")."""
    import sim_balance

    sim_balance.main(["--seeds", "0", "--steps", "1", "--layers", "1", "--costs", COSTS,
                      "--out", str(tmp_path / "b.json")])
    cells = strict_load(tmp_path / "b.json")["cells"]
    cell = next(c for c in cells if (c["gpus"], c["skew"], c["policy"], c["balance_slack"])
                == (8, 2.0, "lrmoe", None))
    assert cell["replica_cost_rows"] == [1326]
    assert all(c["replica_cost_rows"] == [0] for c in cells if c["policy"] != "lrmoe")
    direct = run_sim(cli.build_parser().parse_args(
        ["sim", "--costs", COSTS, "--gpus", "8", "--skew", "2", "--tokens-per-gpu", "32768",
         "--steps", "1", "--layers", "1", "--seed", "0", "--policies", "lrmoe", "ultraep",
         "--rate",
         "0.3", "--balance-slack", "-1", "--pressure", *FIGURE_FLAGS,
         "--out", str(tmp_path / "direct")]))["policies"]["lrmoe"]
    assert direct["replica_cost_rows"] == 1326
    assert cell["ms"]["mean"] == pytest.approx(direct["fwd_ms"] + direct["bwd_ms"])
    assert cell["replicas"]["mean"] == pytest.approx(direct["replicas"])
    legacy = sim_balance.main(["--seeds", "0", "--steps", "1", "--layers", "1", "--costs",
                               COSTS, "--legacy", "--out", str(tmp_path / "l.json")])
    assert legacy == 0
    assert all(c["replica_cost_rows"] == [0]
               for c in strict_load(tmp_path / "l.json")["cells"])  # no joint plan there
