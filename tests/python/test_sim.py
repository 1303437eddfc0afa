"""Tests of the cluster simulator's Python face: ``lrmoe calibrate`` (lrmoe/calibrate.py)
and ``lrmoe sim`` (lrmoe/sim.py, lrmoe/sim_report.py). The simulator's arithmetic is tested
on hand-computed toy clusters in tests/cpp/test_sim.cpp.

References: hand-built expert id counts (torch.bincount), the file format written out in
lrmoe/calibrate.py's docstring.
"""
from __future__ import annotations

import json

import pytest
import torch

from lrmoe import calibrate as C
from lrmoe import cli


def test_balanced_ids_give_every_expert_the_same_rows():
    ids = C.balanced_ids(experts=4, rows=6, top_k=2, device=torch.device("cpu"))
    assert ids.shape == (12, 2)
    assert torch.bincount(ids.reshape(-1), minlength=4).tolist() == [6, 6, 6, 6]
    assert all(len(set(row)) == 2 for row in ids.tolist())
    with pytest.raises(ValueError, match="divisible by top_k"):
        C.balanced_ids(experts=3, rows=1, top_k=2, device=torch.device("cpu"))


def test_calibrate_quick_writes_a_valid_cost_file(tmp_path):
    out = tmp_path / "costs" / "cpu.json"
    rc = cli.main(["calibrate", "--quick", "--device", "cpu", "--shapes", "smoke",
                   "--out", str(out)])
    assert rc == 0
    data = C.load_costs(str(out))
    assert data["format"] == C.FORMAT and data["quick"] is True
    for key in ("machine", "device", "torch", "date", "command"):
        assert data["meta"][key]
    assert data["meta"]["torch"] == torch.__version__
    shape = data["shapes"]["smoke"]
    got = {(p["experts"], p["rows_per_expert"]) for p in shape["points"]}
    assert got == {(e, r) for e in C.QUICK_EXPERTS for r in C.QUICK_ROWS}
    for p in shape["points"]:
        assert p["pairs"] == p["experts"] * p["rows_per_expert"]
        assert p["tokens"] * min(2, p["experts"]) == p["pairs"]
        assert p["fwd_ms"] > 0 and p["bwd_ms"] > 0
        assert p["phases_ms"]["expert_gemm_fwd"] > 0 and p["phases_ms"]["expert_gemm_bwd"] > 0
    assert set(shape["per_row_ms"]) >= {"permute", "combine", "score", "select", "compact",
                                        "scatter", "fwd_rest", "bwd_rest"}
    assert all(v >= 0 for v in shape["per_row_ms"].values())


def test_calibrate_refuses_bad_input(tmp_path, capsys):
    rc = cli.main(["calibrate", "--quick", "--device", "cpu", "--shapes", "smoke",
                   "--out", str(tmp_path / "x.json"), "--iters", "1"])
    assert rc == 0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="lrmoe calibrate"):
        C.load_costs(str(bad))
    with pytest.raises(ValueError, match="--shapes"):
        C.calibrate(str(tmp_path / "y.json"), "cpu", ["nope"], quick=True)
