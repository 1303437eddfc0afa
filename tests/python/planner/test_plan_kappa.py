"""``lrmoe plan --joint``'s replica cost kappa (lrmoe/planner/report.py ``replica_cost``):
derived from ``--costs`` and ``--links`` as ``lrmoe sim`` derives it, an explicit
``--replica-cost-rows`` winning, 0 without a cost file, each reported with its source.

References: kappa worked out by hand on a toy cost file (one 16-expert curve, linear
between two points) and a toy link file; the derived plan against the plan the CLI makes
with that number given explicitly.
"""
from __future__ import annotations

import json

import pytest

from lrmoe import cli

# gpu-small's expert GEMMs at 16 experts per rank: 8 / 16 ms (fwd / bwd) at 512 rows per
# expert, 32 / 64 ms at 2048, linear between (no roofline: the device is not an H200)
COSTS = {"format": "lrmoe-costs/1", "quick": True, "bandwidth": {}, "meta": {"device": "toy"},
         "shapes": {"gpu-small": {
             "dims": {"hidden": 768, "inter": 256, "experts": 128, "top_k": 8},
             "per_row_ms": {},
             "points": [{"experts": 16, "rows_per_expert": r, "fwd_ms": None, "bwd_ms": None,
                         "phases_ms": {"expert_gemm_fwd": f, "expert_gemm_bwd": b}}
                        for r, f, b in ((512, 8.0, 16.0), (2048, 32.0, 64.0))]}}}
LINKS = ("name: toy\ngpus_per_node: 8\nintra_node: {GBps: 100, latency_us: 10}\n"
         "inter_node: {GBps: 10, latency_us: 20}\n")
# W = 8 ranks x 2048 tokens x top-8 = 131,072 pairs over E = 128 experts: r = 1024 rows
# per expert, k = E / W = 16 experts per rank.
#   t_row = (fwd + bwd) / (2 k r) with fwd = 8 + 24 x (1024 - 512) / 1536 = 16 ms, bwd 32:
#         = 48 / 32,768 = 0.00146484375 ms
#   t_w   = 3 x 768 x 256 x 2 B / (100 GB/s x 1e6) + 10 us = 0.01179648 + 0.01 ms
#   kappa = round(0.02179648 / 0.00146484375) = round(14.88) = 15
KAPPA = 15
BASE = ["plan", "--model", "gpu-small", "--ep", "8", "--tokens-per-rank", "2048",
        "--policy", "lrmoe", "--json"]


def test_hand_computed_kappa():
    t_row = (16.0 + 32.0) / (2 * 16 * 1024)
    t_w = 3 * 768 * 256 * 2 / (100 * 1e6) + 10 / 1e3
    assert round(t_w / t_row) == KAPPA


@pytest.fixture()
def hw(tmp_path):
    c, l = tmp_path / "toy_costs.json", tmp_path / "toy_links.yaml"
    c.write_text(json.dumps(COSTS))
    l.write_text(LINKS)
    return ["--costs", str(c), "--links", str(l)]


def _plan(capsys, *argv):
    assert cli.main([*BASE, *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_joint_derives_kappa_from_costs_and_links(capsys, hw):
    got = _plan(capsys, "--joint", *hw)
    assert sum(got["plans"][0]["rows_before"]) == 131072  # the r = 1024 of the hand value
    assert got["replica_cost_rows"]["value"] == KAPPA
    assert got["replica_cost_rows"]["source"].startswith("derived round(t_w / t_row)")
    # the derived number is the one the planner ran with: the plan of an explicit 15
    explicit = _plan(capsys, "--joint", "--replica-cost-rows", str(KAPPA))
    assert explicit["replica_cost_rows"] == {"value": KAPPA, "source": "--replica-cost-rows"}
    assert got["plans"] == explicit["plans"]


def test_explicit_kappa_wins_and_no_costs_is_zero(capsys, hw):
    got = _plan(capsys, "--joint", "--replica-cost-rows", "3", *hw)
    assert got["replica_cost_rows"] == {"value": 3,
                                        "source": "--replica-cost-rows; --costs not used"}
    zero = _plan(capsys, "--joint", "--replica-cost-rows", "0", *hw)
    assert zero["replica_cost_rows"]["value"] == 0
    none = _plan(capsys, "--joint")
    assert none["replica_cost_rows"]["value"] == 0
    assert "without --costs" in none["replica_cost_rows"]["source"]
    assert zero["plans"] == none["plans"]
    assert _plan(capsys)["replica_cost_rows"] is None  # no joint plan, no kappa


def test_table_reports_kappa_and_its_source(capsys, hw):
    argv = [a for a in BASE if a != "--json"]
    assert cli.main([*argv, "--joint", *hw]) == 0
    assert f"replica cost kappa = {KAPPA} rows (derived" in capsys.readouterr().out
    assert cli.main([*argv, "--joint"]) == 0
    assert "replica cost kappa = 0 rows (default without --costs" in capsys.readouterr().out


@pytest.mark.parametrize("extra,match", [
    (["--replica-cost-rows", "5"], "--replica-cost-rows is a term of lrmoe's joint"),
    (["--joint", "--replica-cost-rows", "-1"], "--replica-cost-rows must be >= 0"),
    (["{costs}"], "--costs is read by lrmoe plan only to derive the joint plan's"),
    (["--joint", "--links", "x.yaml"], "--links refines the replica cost derived from a cost"),
    (["--joint", "--costs-shape", "qwen3-30b-a3b"], "--costs-shape refines"),
    (["--joint", "{costs}", "--costs-shape", "glm-4.5-air"], "has no calibration of"),
    (["--joint", "--policy", "fixed"], "--joint refines the lrmoe plan only, and --policy fixed"),
])
def test_bad_combinations_are_named(capsys, hw, extra, match):
    extra = [x for a in extra for x in (hw[:2] if a == "{costs}" else [a])]
    assert cli.main([*BASE, *extra]) == cli.EXIT_USAGE
    assert match in capsys.readouterr().err
