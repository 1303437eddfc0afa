"""Tests of the cluster simulator's Python face: ``lrmoe calibrate`` (lrmoe/bench/calibrate.py)
and ``lrmoe sim`` (lrmoe/sim/simulate.py, lrmoe/sim/report.py). The simulator's arithmetic is tested
on hand-computed toy clusters in tests/cpp/test_sim.cpp.

References: hand-built expert id counts (torch.bincount), the file format written out in
lrmoe/bench/calibrate.py's docstring, the EP layer's own DispatchPlan (lrmoe/parallel/plan.py)
for the bytes, hand-computed steps to loss for Table 1.
"""
from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from lrmoe import cli
from lrmoe.bench import calibrate as C
from lrmoe.sim.costs import PER_ROW, Costs, load_costs
from lrmoe.sim.links import Links
from lrmoe.workload.shapes import SHAPES


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
    data = load_costs(str(out))
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
        load_costs(str(bad))
    with pytest.raises(ValueError, match="--shapes"):
        C.calibrate(str(tmp_path / "y.json"), "cpu", ["nope"], quick=True)


def test_calibrate_ep_times_the_ep_layer_at_size_one(tmp_path):
    """``torchrun --nproc-per-node 1 -m lrmoe calibrate --ep --quick`` (gloo): the EP
    points are the two largest one-device points of the most experts, their extras follow
    from the file's own medians and all-to-all phases by the documented formula
    (lrmoe/bench/calibrate_ep.py), and ``ep_fwd``/``ep_bwd`` are the largest point's extras per
    pair; outside torchrun the flag names torchrun."""
    from test_expert_parallel import _torchrun
    out = tmp_path / "ep.json"
    r = _torchrun(["--ep", "--quick", "--device", "cpu", "--shapes", "smoke", "--out",
                   str(out)], tmp_path, nproc=1, timeout=300, subcommand=("calibrate",))
    assert r.returncode == 0, r.stderr[-3000:]
    shape = load_costs(str(out))["shapes"]["smoke"]
    local = {(p["experts"], p["rows_per_expert"]): p for p in shape["points"]}
    eps = shape["ep_points"]
    assert [(p["experts"], p["rows_per_expert"]) for p in eps] == [
        (max(C.QUICK_EXPERTS), rows) for rows in sorted(C.QUICK_ROWS)[-2:]]
    for p in eps:
        here = local[(p["experts"], p["rows_per_expert"])]
        assert p["local_fwd_ms"] == here["fwd_ms"] and p["local_bwd_ms"] == here["bwd_ms"]
        ph = p["phases_ms"]
        assert all(ph[k] > 0 for k in ("a2a_counts", "a2a_dispatch", "a2a_combine",
                                        "a2a_grad", "a2a_dx"))
        a2a_f = ph["a2a_counts"] + ph["a2a_dispatch"] + ph["a2a_combine"]
        a2a_b = ph["a2a_grad"] + ph["a2a_dx"]
        assert p["extra_fwd_ms"] == pytest.approx(max(0.0, p["fwd_ms"] - here["fwd_ms"] - a2a_f))
        assert p["extra_bwd_ms"] == pytest.approx(max(0.0, p["bwd_ms"] - here["bwd_ms"] - a2a_b))
    big = max(eps, key=lambda p: p["pairs"])
    assert shape["per_row_ms"]["ep_fwd"] == pytest.approx(big["extra_fwd_ms"] / big["pairs"])
    assert shape["per_row_ms"]["ep_bwd"] == pytest.approx(big["extra_bwd_ms"] / big["pairs"])
    costs = Costs.from_file(str(out), "smoke")
    assert costs.per_row["ep_fwd"] == shape["per_row_ms"]["ep_fwd"]
    # a file written without --ep simulates with no EP work (the committed H200 file)
    old = Costs.from_file(str(Path(__file__).resolve().parents[3] / "configs" / "costs"
                                / "h200.json"), "qwen3-30b-a3b")
    assert old.per_row["ep_fwd"] == 0.0 and old.per_row["ep_bwd"] == 0.0
    r = _torchrun(["--ep", "--quick", "--device", "cpu", "--shapes", "smoke", "--out",
                   str(tmp_path / "no.json")], tmp_path, nproc=0, subcommand=("calibrate",))
    assert r.returncode != 0 and "torchrun --nproc-per-node 1 -m lrmoe calibrate --ep" in r.stderr
    r = _torchrun(["--ep", "--quick", "--device", "cpu", "--shapes", "smoke", "--out",
                   str(tmp_path / "two.json")], tmp_path, nproc=2, subcommand=("calibrate",))
    assert r.returncode != 0 and "torchrun started 2 processes" in r.stderr


def test_sim_charges_ep_costs_per_received_row_from_two_ranks():
    """ep_fwd / ep_bwd reach the simulator in their places (set by name through the binding):
    fixed ownership of 8 experts over W = 2, 100 pairs per (source, expert), so each
    rank receives 2 x 4 x 100 = 800 rows: by hand +0.8 ms at 1e-3 ms per row, forward
    only for ep_fwd, backward only for ep_bwd; nothing at W = 1."""
    from lrmoe.sim import simulate as S
    from lrmoe.planner.plan import MemoryModel
    g = np.array([[1, 1024, 1.0, 2.0], [16, 1024, 16.0, 32.0]], dtype=np.float64)

    def costs(**kw):
        per_row = {k: 0.0 for k in PER_ROW}
        per_row.update(kw)
        return Costs("toy", {}, g, per_row, 10.0, {"device": "toy"})
    mem = MemoryModel(1, 1, 1, 1, 1, 1 << 40, 0, optimizer_on_device=False)
    links = Links.from_file()
    for W, want in ((2, 0.8), (1, 0.0)):
        load = np.full((1, 1, W, 8), 100, dtype=np.int64)
        run = lambda c: S.simulate(load, "fixed", mem, c, links, 64, 0.0, replica_slots=0,
                                   threads=1)
        base = run(costs())
        f, b = run(costs(ep_fwd=1e-3)), run(costs(ep_bwd=1e-3))
        assert f["expert_fwd_ms"][0] - base["expert_fwd_ms"][0] == pytest.approx(want)
        assert f["expert_bwd_ms"][0] == pytest.approx(base["expert_bwd_ms"][0])
        assert b["expert_bwd_ms"][0] - base["expert_bwd_ms"][0] == pytest.approx(want)
        assert b["expert_fwd_ms"][0] == pytest.approx(base["expert_fwd_ms"][0])


# ------------------------------------------------------------------------- lrmoe sim
def _toy_costs(hidden: int = 768):
    """Costs with hand-set round numbers (not a calibration): 1 ms per 1k rows forward."""
    g = np.array([[1, 1024, 1.0, 2.0], [16, 1024, 16.0, 32.0]], dtype=np.float64)
    return Costs("toy", {}, g, {k: 1e-6 for k in PER_ROW}, 10.0, {"device": "toy"})


@pytest.mark.parametrize("rate, policy", [(0.0, "fixed"), (0.3, "lrmoe")])
def test_sim_bytes_equal_the_ep_layers_dispatch_plan(rate, policy):
    """The bytes the simulator says each rank sends equal those the EP layer's
    DispatchPlan (lrmoe/parallel/plan.py, built per rank from the same counts) moves:
    the formulas of lrmoe/parallel/__init__.py applied to its split lists."""
    from lrmoe.sim import simulate as S
    from lrmoe.moe.config import LRMoEConfig
    from lrmoe.parallel.plan import build_plan
    from lrmoe.planner.plan import MemoryModel
    W, E, H, es = 2, 8, 64, 2
    rng = np.random.default_rng(3)
    load = rng.integers(0, 40, size=(W, E)).astype(np.int64)
    mem = MemoryModel(1, 1, 1, 1, 1, 1 << 40, 0, optimizer_on_device=False)
    res = S.simulate(load[None, None], policy, mem, _toy_costs(), Links.from_file(), H,
                     rate, replica_slots=0, per_rank_bytes=True, threads=1)
    assert res["feasible"][0] == 1
    sent = res["sent_N5W"][0]
    cfg = LRMoEConfig(hidden_size=H, moe_intermediate_size=32, num_experts=E, top_k=2,
                      recalibration_rate=rate)
    row = H * es
    for r in range(W):
        p = build_plan(load.tolist(), torch.as_tensor(load), r, E // W, cfg)
        want = [sum(p.input_splits) * row, p.num_received * (row + 4), p.num_retained * row,
                p.num_retained * 4, p.num_grad_received * row]
        assert [int(v) for v in sent[:, r]] == want, (r, dict(zip(S.SENT_KEYS, want)))


def _write_trace(path, steps=2, layers=2, tokens=64, E=128, K=8, seed=0):
    from lrmoe.workload.trace import RoutingTrace
    rng = np.random.default_rng(seed)
    tr = RoutingTrace(E, K)
    for s in range(steps):
        tr.step = s
        for l in range(layers):
            p = np.arange(1, E + 1, dtype=np.float64) ** -1.0
            ids = np.stack([rng.choice(E, K, replace=False, p=p / p.sum()) for _ in range(tokens)])
            tr.record(l, torch.as_tensor(ids))
    tr.save(path)
    return path


def test_sim_cli_writes_json_and_figures_labelled_simulated(tmp_path):
    costs = tmp_path / "costs.json"
    assert cli.main(["calibrate", "--quick", "--device", "cpu", "--shapes", "gpu-small",
                     "--out", str(costs), "--iters", "1"]) == 0
    trace = _write_trace(tmp_path / "trace.npz")
    results = tmp_path / "results.json"
    cells = [{"labels": {"rate": r, "seed": 0, "selection": "none" if r == 0 else "topk"},
              "evals": [{"step": 10 * k, "val_loss": 5.0 - k * (0.5 if r == 0 else 0.4)}
                        for k in range(6)]} for r in (0.0, 0.3)]
    results.write_text(json.dumps(cells))
    out = tmp_path / "out"
    rc = cli.main(["sim", "--costs", str(costs), "--model", "gpu-small", "--gpus", "2",
                   "--tokens-per-gpu", "64", "--steps", "2", "--layers", "2", "--trace",
                   str(trace), "--pressure", "1", "2", "--pressure-tokens-per-gpu", "64",
                   "--results", str(results), "--targets", "4.0", "--scale", "2", "4", "256",
                   "--threads", "1", "--out", str(out)])
    assert rc == 0
    data = json.loads((out / "sim.json").read_text())
    assert data["label"] == "simulated" and "simulated" in data["note"]
    assert set(data["policies"]) == {"fixed", "ultraep", "symi", "lrmoe"}
    for v in data["policies"].values():
        assert v["feasible"] == 1.0 and v["fwd_ms"] > 0 and v["bwd_ms"] > 0
    # lrmoe at c = 0.3 keeps floor(0.7 n) of each layer's pairs; the baselines all
    assert data["policies"]["fixed"]["retained_fraction"] == 1.0
    assert 0.69 < data["policies"]["lrmoe"]["retained_fraction"] <= 0.7
    # Table 1: c = 0 reaches 4.0 at step 20 (5 - 2 x 0.5); c = 0.3 is at 4.2 at step 20
    # and 3.8 at 30, so it crosses 4.0 half way, at step 25 (interpolated)
    row = data["table1"][0]
    assert (row["steps_c0"], row["steps_rate"]) == (20, 25)
    assert row["lrmoe"] == pytest.approx(25 * data["policies"]["lrmoe"]["moe_ms_per_step"]
                                         / 60000.0)
    ms = {p: v["moe_ms_per_step"] for p, v in data["policies"].items()}
    assert row["lrmoe_over_symi"]["mean"] == pytest.approx(25 * ms["lrmoe"] / (20 * ms["symi"]))
    assert row["lrmoe_over_symi"]["n"] == 1
    assert [r["gpus"] for r in data["scale"]["policies"]["fixed"]] == [2, 4, 256]
    # 256 GPUs: two data-parallel copies of an EP128 group, both simulated; the cluster
    # waits for the slower, so it is never below the mean group
    for rows in data["scale"]["policies"].values():
        assert [(r["ep"], r["groups"]) for r in rows] == [(2, 1), (4, 1), (128, 2)]
        assert rows[2]["layer_ms"] >= rows[2]["mean_group_ms"] > 0
        assert rows[0]["layer_ms"] == pytest.approx(rows[0]["mean_group_ms"])
        # the step: the simulated layers' mean scaled to the model's 2 (--layers 2, both
        # simulated), plus its terms; an expert all-reduce only with 2 groups
        for r in rows:
            assert r["moe_ms"] == pytest.approx(2 * r["layer_ms"], rel=1e-9)
            assert r["step_ms"] == pytest.approx(
                r["moe_ms"] + r["expert_allreduce_ms"] + r["dense_allreduce_ms"]
                + r["optimizer_ms"] + r["broadcast_ms"], rel=1e-9)
            assert r["dense_allreduce_ms"] > 0 and r["optimizer_ms"] > 0
        assert rows[0]["expert_allreduce_ms"] == 0 and rows[2]["expert_allreduce_ms"] > 0
    assert all(r["broadcast_ms"] == 0 for r in data["scale"]["policies"]["fixed"])
    assert [r["multiplier"] for r in data["pressure"]["policies"]["lrmoe"]] == [1, 2]
    for png in ("fig6_pressure.png", "fig7_memory.png", "fig8_latency.png", "scale.png"):
        assert (out / png).stat().st_size > 1000


def test_sim_refuses_bad_input(tmp_path):
    from lrmoe.sim import simulate as S
    bad = tmp_path / "links.yaml"
    bad.write_text("gpus_per_node: 8\nintra_node: {GBps: 0, latency_us: 1}\n"
                   "inter_node: {GBps: 1, latency_us: 1}\n")
    with pytest.raises(ValueError, match="intra_GBps"):
        Links.from_file(str(bad))
    with pytest.raises(ValueError, match="load_SLWE must be 4-D"):
        S.simulate(np.zeros((2, 8), dtype=np.int64), "fixed", None, _toy_costs(),
                   Links.from_file(), 64)
    with pytest.raises(ValueError, match="--gpus 3"):
        cli_args = ["sim", "--costs", "x.json", "--gpus", "3"]
        from lrmoe.sim.report import run_sim
        run_sim(cli.build_parser().parse_args(cli_args))


def _hand_cost_file(path, fwd_total=5.0, bwd_total=9.0):
    """One shape (gpu-small dims), two points at 128 experts; each point's medians exceed
    its named phases by a known rest (forward 5 - 4 = 1 ms, backward 9 - 7 = 2 ms)."""
    phases = dict(router=1.0, permute=0.5, expert_gemm_fwd=2.0, combine=0.5,
                  router_grad=1.0, score=0.5, select=0.5, compact=1.0,
                  expert_gemm_bwd=3.0, scatter=1.0)
    pts = [dict(experts=128, rows_per_expert=r, tokens=128 * r // 8, pairs=128 * r,
                fwd_ms=fwd_total * m, bwd_ms=bwd_total * m,
                phases_ms={k: v * m for k, v in phases.items()})
           for r, m in ((1024, 1.0), (2048, 2.0))]
    per_row = {k: 0.0 for k in ("router", "permute", "combine", "router_grad", "score",
                                 "select", "compact", "scatter")}
    per_row.update(fwd_rest=0.25, bwd_rest=0.5)
    data = dict(format=C.FORMAT, quick=False, bandwidth=dict(copy_GBps=0.0, h2d_GBps=0.0),
                shapes={"gpu-small": dict(dims=SHAPES["gpu-small"].dims, points=pts,
                                          per_row_ms=per_row)},
                meta=dict(machine="hand", device="hand", torch="-", date="-", command="-"))
    path.write_text(json.dumps(data))
    return path


def test_costs_fold_each_points_rest_into_its_gemm_time(tmp_path):
    c = Costs.from_file(str(_hand_cost_file(tmp_path / "c.json")), "gpu-small")
    # forward GEMM 2 + rest (5 - 1 - 0.5 - 2 - 0.5 = 1), backward 3 + (9 - 7 = 2), per point
    assert c.gemm_G4.tolist() == [[128, 1024, 3.0, 5.0], [128, 2048, 6.0, 10.0]]
    assert c.per_row["fwd_rest"] == 0.0 and c.per_row["bwd_rest"] == 0.0


def test_validate_simulates_the_benchs_own_uneven_routing(tmp_path):
    """W = 1, c = 0, all per-row costs 0: the simulated forward is the mean over the
    bench's three routings of the mean over experts of the 128-expert curve at each
    expert's rows (GemmTable::ms_instances), computed here by hand from bincount."""
    from lrmoe.sim import report as R
    from lrmoe.workload.routing import make_routing
    costs = _hand_cost_file(tmp_path / "c.json")
    tokens, E, K = 32768, 128, 8
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"records": [dict(
        method="lrmoe", shape="gpu-small", tokens=tokens, routing="skewed", rate=0.0,
        fwd_ms=1.0, bwd_ms=1.0)]}))
    (row,) = R.validate(str(bench), str(costs), R.Links.from_file())

    def curve(x, y1, y2):  # through (1024, y1), (2048, y2); flat below, slope beyond
        return y1 if x <= 1024 else y1 + (y2 - y1) * (x - 1024) / 1024

    want = np.mean([np.mean([curve(n, 3.0, 6.0) for n in torch.bincount(
        make_routing("skewed", tokens, E, K, s).reshape(-1), minlength=E).tolist()])
        for s in range(3)])
    assert row["sim_fwd_ms"] == pytest.approx(want, rel=1e-9)
    even = curve(tokens * K / E, 3.0, 6.0)  # the old model: rows spread evenly
    assert row["sim_fwd_ms"] > even * 1.05  # a skewed load costs more than its mean


def test_validate_ep_simulates_every_ranks_routing_and_its_policy(tmp_path):
    """An expert-parallel bench file (W = 2): each record is simulated at W = 2 on every
    rank's own routing (set s of rank r: seed s + 1000 r, counted here with bincount).
    With the hand cost file (copy bandwidth 0: a rank's rows to itself are free) the
    fixed-ownership dispatch of a set (the record without a policy) is, by the link model of docs/simulation.md,
    latency + the per-peer setup of its one peer + max over ranks of max(rows out, rows
    in) x H x 2 bytes / bandwidth, computed here from the counts (one node: no network
    phase to pipeline with); the errors are simulated / measured - 1."""
    from lrmoe.sim import validate as V
    from lrmoe.workload.routing import make_routing
    costs = _hand_cost_file(tmp_path / "c.json")
    T, E, K, H, W = 2048, 128, 8, 768, 2
    recs = [dict(method="lrmoe", policy=pol, rate=c, shape="gpu-small", tokens_per_rank=T,
                 routing="skewed", world_size=W, fwd_ms=2.0, bwd_ms=4.0,
                 phases_ms={"a2a_dispatch": 0.5, "a2a_combine": 0.5, "a2a_grad": 0.25,
                            "a2a_dx": 0.25})
            for pol in (None, "ultraep") for c in (0.0, 0.3)]
    recs.append(dict(method="dropless", rate=None, shape="gpu-small", world_size=W,
                     fwd_ms=1.0, bwd_ms=1.0))
    bench = tmp_path / "ep.json"
    bench.write_text(json.dumps({"records": recs, "meta": {"replica_slots": 2}}))
    links = V.Links.from_file()
    rows = V.validate(str(bench), str(costs), links)
    # ultraep at c = 0.3 (a baseline placement with LRMoE's quotas) is not modelled
    assert [(r["policy"], r["rate"]) for r in rows] == [(None, 0.0), (None, 0.3),
                                                      ("ultraep", 0.0)]
    loads = V.bench_loads("skewed", T, E, K, ranks=W)
    for s in range(3):
        for r in range(W):
            want = torch.bincount(make_routing("skewed", T, E, K, s + 1000 * r).reshape(-1),
                                  minlength=E)
            assert loads[s, 0, r].tolist() == want.tolist()
    owner = np.arange(E) // (E // W)
    dispatch = []
    for s in range(3):
        out = [int(loads[s, 0, r][owner != r].sum()) for r in range(W)]
        inn = [int(sum(loads[s, 0, q][owner == r].sum() for q in range(W) if q != r))
               for r in range(W)]
        worst = max(max(o, i) for o, i in zip(out, inn))
        dispatch.append((links.intra_latency_us + links.per_peer_us) * 1e-3
                        + worst * H * 2 / (links.intra_GBps * 1e6))
    fixed = rows[0]
    # the bench's all-to-all ranges come from its profiled step on input set 0
    assert fixed["sim_dispatch_ms"] == pytest.approx(dispatch[0], rel=1e-9)
    assert fixed["dispatch_rel_err"] == pytest.approx(fixed["sim_dispatch_ms"] / 0.5 - 1)
    assert fixed["fwd_rel_err"] == pytest.approx(fixed["sim_fwd_ms"] / 2.0 - 1)
    for r in rows:
        assert all(np.isfinite(r[f"sim_{k}"]) and r[f"sim_{k}"] > 0 for k in (
            "fwd_ms", "bwd_ms", "dispatch_ms", "combine_ms", "grad_a2a_ms", "dx_a2a_ms"))
    # c = 0.3 keeps fewer gradient rows: a smaller backward all-to-all, same forward
    assert rows[1]["sim_grad_a2a_ms"] < rows[0]["sim_grad_a2a_ms"]
    assert rows[1]["sim_dispatch_ms"] == rows[0]["sim_dispatch_ms"]
    with pytest.raises(ValueError, match="not an lrmoe bench layer result"):
        (tmp_path / "x.json").write_text("[]")
        V.validate(str(tmp_path / "x.json"), str(costs), links)
    with pytest.raises(ValueError, match="bench a2a result"):
        (tmp_path / "a.json").write_text(json.dumps({"fit": {}, "records": [{"ms": 1.0}]}))
        V.validate(str(tmp_path / "a.json"), str(costs), links)
    with pytest.raises(ValueError, match="no LRMoE record at a shape"):
        (tmp_path / "s.json").write_text(json.dumps({"records": [dict(recs[0], shape="smoke")]}))
        V.validate(str(tmp_path / "s.json"), str(costs), links)


def _corrupted(path, change):
    """The real H200 cost file with every number passed through ``change``."""
    def walk(v):
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x) for x in v]
        if isinstance(v, float):
            return change(v)
        return v
    real = json.loads((Path(__file__).resolve().parents[3] / "configs" / "costs" /
                       "h200.json").read_text())
    data = dict(real, shapes=walk(real["shapes"]), bandwidth=walk(real["bandwidth"]))
    path.write_text(json.dumps(data))  # json writes NaN / Infinity as Python reads them
    return path


@pytest.mark.parametrize("change, key", [
    (lambda v: -v, r"bandwidth\.copy_GBps is -4165"),
    (lambda v: float("nan"), r"bandwidth\.copy_GBps is nan"),
    (lambda v: float("inf"), r"bandwidth\.copy_GBps is inf")])
def test_sim_refuses_a_corrupt_cost_file_naming_file_and_key(tmp_path, change, key):
    """Issue 26.2: a cost file with every number negated, NaN or infinite ran to exit 0
    with confident figures; now the command fails with one line naming the file and key."""
    bad = _corrupted(tmp_path / "bad.json", change)
    r = subprocess.run([sys.executable, "-m", "lrmoe", "sim", "--costs", str(bad), "--gpus",
                        "8", "--steps", "2", "--out", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 2, r.stderr
    assert re.search(rf"^lrmoe sim: error: {re.escape(str(bad))}: {key}", r.stderr, re.M), r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "out" / "sim.json").exists()


@pytest.mark.parametrize("where, value, key", [
    (("shapes", "gpu-small", "points", 1, "fwd_ms"), -1.0, r"shapes\.gpu-small\.points\[1\]\.fwd_ms is -1\.0"),
    (("shapes", "gpu-small", "points", 0, "phases_ms", "score"), float("nan"),
     r"shapes\.gpu-small\.points\[0\]\.phases_ms\.score is nan"),
    (("shapes", "gpu-small", "points", 0, "rows_per_expert"), 0, r"points\[0\]\.rows_per_expert is 0"),
    (("shapes", "gpu-small", "per_row_ms", "bwd_rest"), "fast", r"per_row_ms\.bwd_rest is 'fast'"),
    (("shapes", "gpu-small", "dims", "experts"), 2.5, r"dims\.experts is 2\.5"),
    (("bandwidth", "h2d_GBps"), -3.0, r"bandwidth\.h2d_GBps is -3\.0")])
def test_cost_file_values_out_of_range_are_named(tmp_path, where, value, key):
    path = _hand_cost_file(tmp_path / "c.json")
    data = json.loads(path.read_text())
    node = data
    for k in where[:-1]:
        node = node[k]
    node[where[-1]] = value
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: .*{key}"):
        load_costs(str(path))
    # the file as written by hand (no corruption) reads, so the check is on the value
    load_costs(str(_hand_cost_file(tmp_path / "good.json")))


def test_sim_config_floors_h200_costs_at_the_roofline():
    """An H200 cost file gets the H200 roofline of its shape's expert (989 TFLOP/s,
    4,800 GB/s, docs/simulation.md "Cost model"); a hand file of no named device none."""
    from lrmoe.sim.simulate import sim_config
    c = Costs.from_file("configs/costs/h200.json", "qwen3-30b-a3b")
    roof = sim_config(c, _links(), 2048).cost.roofline
    assert (roof.peak_TFLOPs, roof.hbm_GBps, roof.hidden, roof.inter) == (989.0, 4800.0, 2048, 768)
    hand = dataclasses.replace(c, meta=dict(device="hand"))
    assert sim_config(hand, _links(), 2048).cost.roofline.peak_TFLOPs == 0.0


def _links():
    from lrmoe.sim.links import Links
    return Links.from_file()


def test_sim_config_carries_the_all_to_all_model_and_refuses_a_bad_top_k():
    """The link file's per_peer_us and chunks, and top_k, reach the C++ config as given;
    a top_k that is not an integer >= 1 is refused naming it."""
    from lrmoe.sim.simulate import sim_config
    c = _toy_costs()
    links = dataclasses.replace(_links(), per_peer_us=3.0, chunks=5)
    cfg = sim_config(c, links, 64, top_k=8)
    assert (cfg.link.per_peer_us, cfg.link.chunks, cfg.top_k) == (3.0, 5, 8)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="top_k"):
            sim_config(c, links, 64, top_k=bad)


def test_overlap_chunks_reach_the_layer_time_and_the_cli_refuses_a_bad_value(tmp_path,
                                                                            capsys):
    """links.overlap_chunks reaches the C++ config; one chunk is bit for bit the default
    (phases in sequence); several chunks change fwd_ms / bwd_ms by exactly the overlap
    the layer reports, the phase breakdown unchanged (the hand-computed pipeline is
    tests/cpp/test_sim.cpp, AllToAllsPipelinedWithTheExpertGemms)."""
    from lrmoe.sim import simulate as S
    from lrmoe.sim.simulate import sim_config
    from lrmoe.planner.plan import MemoryModel
    links = dataclasses.replace(_links(), overlap_chunks=3)
    assert sim_config(_toy_costs(), links, 64).link.overlap_chunks == 3
    W, E, H = 4, 8, 64
    load = np.random.default_rng(5).integers(1, 400, size=(1, 1, W, E)).astype(np.int64)
    mem = MemoryModel(1, 1, 1, 1, 1, 1 << 40, 0, optimizer_on_device=False)

    def run(n):
        return S.simulate(load, "fixed", mem, _toy_costs(),
                          dataclasses.replace(_links(), overlap_chunks=n), H, 0.0,
                          replica_slots=0, threads=1)
    base, one, four = run(1), S.simulate(load, "fixed", mem, _toy_costs(), _links(), H, 0.0,
                                         replica_slots=0, threads=1), run(4)
    for k in ("fwd_ms", "bwd_ms"):
        assert np.array_equal(base[k], one[k])
    assert base["overlap_fwd_ms"][0] == 0 and four["overlap_fwd_ms"][0] != 0
    for k in ("dispatch_ms", "expert_fwd_ms", "combine_ms", "expert_bwd_ms"):
        assert np.array_equal(base[k], four[k])
    np.testing.assert_allclose(four["fwd_ms"], base["fwd_ms"] - four["overlap_fwd_ms"],
                               rtol=1e-12)
    np.testing.assert_allclose(four["bwd_ms"], base["bwd_ms"] - four["overlap_bwd_ms"],
                               rtol=1e-12)
    capsys.readouterr()
    assert cli.main(["sim", "--costs", "configs/costs/h200.json", "--overlap-chunks", "0",
                     "--out", str(tmp_path / "o")]) != 0
    assert "--overlap-chunks must be an integer >= 1" in capsys.readouterr().err


def test_tile_overlap_is_bounded_by_the_phases_and_the_cli_refuses_bad_values(tmp_path,
                                                                           capsys):
    """links.overlap_tile_rows / overlap_comm_share reach the C++ config. Against the
    layer's own phase breakdown (the slowest rank's all-to-alls a and GEMMs g, both
    unchanged by the overlap): with 1-row tiles the overlapped phases take at least
    max(a, g / (1 - share)) and at most that plus min(a, g / (1 - share)) / 8 (every rank
    here holds 2 experts of >= 4 rows: >= 8 tiles); fwd_ms / bwd_ms fall by exactly the
    overlap reported. (The hand-computed case is tests/cpp/test_sim.cpp,
    AllToAllsOverlappedTileByTile.)"""
    from lrmoe.sim import simulate as S
    from lrmoe.sim.simulate import sim_config
    from lrmoe.planner.plan import MemoryModel
    links = dataclasses.replace(_links(), overlap_tile_rows=64, overlap_comm_share=0.25)
    cfg = sim_config(_toy_costs(), links, 64)
    assert (cfg.link.overlap_tile_rows, cfg.link.overlap_comm_share) == (64, 0.25)
    W, E, H = 4, 8, 64
    load = np.random.default_rng(5).integers(1, 400, size=(1, 1, W, E)).astype(np.int64)
    mem = MemoryModel(1, 1, 1, 1, 1, 1 << 40, 0, optimizer_on_device=False)

    def run(**kw):
        return S.simulate(load, "fixed", mem, _toy_costs(), dataclasses.replace(_links(), **kw),
                          H, 0.0, replica_slots=0, threads=1)
    base = run()
    for share in (0.0, 0.5):
        got = run(overlap_tile_rows=1, overlap_comm_share=share)
        for k in ("dispatch_ms", "combine_ms", "expert_fwd_ms", "expert_bwd_ms"):
            assert np.array_equal(base[k], got[k])
        for a, g, src, tot, ov in (
                (got["dispatch_ms"] + got["combine_ms"], got["expert_fwd_ms"],
                 got["src_fwd_ms"], got["fwd_ms"], got["overlap_fwd_ms"]),
                (got["grad_a2a_ms"] + got["dx_a2a_ms"], got["expert_bwd_ms"],
                 got["src_bwd_ms"], got["bwd_ms"], got["overlap_bwd_ms"])):
            gs = g / (1.0 - share)
            lo, hi = np.maximum(a, gs), np.maximum(a, gs) + np.minimum(a, gs) / 8
            assert np.all(tot - src >= lo - 1e-9) and np.all(tot - src <= hi + 1e-9)
            np.testing.assert_allclose(tot, src + a + g - ov, rtol=1e-12)
    capsys.readouterr()
    costs = "configs/costs/h200.json"
    for argv, needle in (
            (["--overlap-tile-rows", "-1"], "--overlap-tile-rows must be an integer >= 0"),
            (["--overlap-tile-rows", "128", "--overlap-comm-share", "1.0"],
             "--overlap-comm-share must be a number in [0, 1)"),
            (["--overlap-comm-share", "0.2"], "applies to the tile-level overlap only"),
            (["--overlap-tile-rows", "128", "--overlap-chunks", "2"], "two models")):
        assert cli.main(["sim", "--costs", costs, *argv, "--out", str(tmp_path / "o")]) != 0
        assert needle in capsys.readouterr().err


def test_simulate_cluster_waits_for_the_slowest_group():
    """Three groups of W = 4 on their own loads: each (step, layer) of the cluster takes
    the max over groups of that group simulated alone (simulate, the per-group path),
    reports which group that was, and the mean over groups."""
    from lrmoe.sim import simulate as S
    from lrmoe.planner.plan import MemoryModel
    W, E, H, G, steps, layers = 4, 8, 64, 3, 2, 2
    rng = np.random.default_rng(5)
    load = rng.integers(0, 60, size=(steps, G, layers, W, E)).astype(np.int64)
    load[:, 1] *= 3  # group 1 routes 3x the rows: the slowest, always
    mem = MemoryModel(1, 1, 1, 1, 1, 1 << 40, 0, optimizer_on_device=False)
    for pol in ("fixed", "ultraep", "lrmoe"):
        rate = 0.3 if pol == "lrmoe" else 0.0
        got = S.simulate_cluster(load, pol, mem, _toy_costs(), _links(), H, rate,
                                 replica_slots=1, threads=2, top_k=2)
        each = np.stack([S.simulate(load[:, g], pol, mem, _toy_costs(), _links(), H, rate,
                                    replica_slots=1, threads=1, top_k=2)["time_ms"]
                         for g in range(G)])  # (G, S x Lyr)
        assert got["feasible"].tolist() == [1.0] * steps * layers
        assert got["time_ms"] == pytest.approx(each.max(axis=0), rel=1e-12)
        assert got["slowest_group"].tolist() == each.argmax(axis=0).tolist()
        assert got["mean_group_ms"] == pytest.approx(each.mean(axis=0), rel=1e-12)
    with pytest.raises(ValueError, match="5-D"):
        S.simulate_cluster(load[0], "fixed", mem, _toy_costs(), _links(), H)


def test_cluster_loads_groups_share_popularity_not_draws():
    """group g of a cluster: other draws of the same layers' Zipf popularity. Group 0 is
    the single-group loads (unchanged); every group's load sums per layer match; over
    many steps the groups agree on each layer's hottest expert."""
    from lrmoe.workload.loads import cluster_loads
    a = cluster_loads(4, 16, 256, 2, 40, 2, 4.0, seed=1)
    b = cluster_loads(4, 16, 256, 2, 40, 2, 4.0, seed=1, group=1)
    assert np.array_equal(a, cluster_loads(4, 16, 256, 2, 40, 2, 4.0, seed=1, group=0))
    assert not np.array_equal(a, b)
    assert np.array_equal(a.sum(axis=(2, 3)), b.sum(axis=(2, 3)))
    for layer in range(2):
        assert a[:, layer].sum(axis=(0, 1)).argmax() == b[:, layer].sum(axis=(0, 1)).argmax()
    with pytest.raises(ValueError, match="group"):
        cluster_loads(4, 16, 256, 2, 1, 1, group=-1)


def test_steps_to_loss_per_seed_interpolated_and_unreached(tmp_path):
    """Crossings by hand (each assert says how);
    a seed that never reaches the target is absent, and a cell at the target at its first
    evaluation gives that step; a second file's cell of the same seed replaces the first's."""
    from lrmoe.sim.table1 import steps_to_loss

    def cell(seed, losses, rate=0.0, **lab):
        return {"labels": {"rate": rate, "seed": seed, **lab},
                "evals": [{"step": 25 * i, "val_loss": v} for i, v in enumerate(losses)]}

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps([cell(0, [7.0, 6.0, 5.0, 4.0]), cell(1, [7.0, 6.5, 6.1]),
                             cell(2, [4.0, 3.0]), cell(3, [7.0, 5.0], rate=0.3),
                             cell(4, [3.0], selection="random")]))
    # seed 0 at 5.5: between 6.0 (step 25) and 5.0 (step 50): 25 + 25 x 0.5 / 1.0 = 37.5
    assert steps_to_loss([str(a)], 5.5, 0.0) == {0: 37.5, 2: 0.0}
    # 4.2: seed 0 between 5.0 (50) and 4.0 (75): 50 + 25 x 0.8 = 70
    assert steps_to_loss([str(a)], 4.2, 0.0) == pytest.approx({0: 70.0, 2: 0.0})
    b.write_text(json.dumps({"cells": [cell(0, [7.0, 5.5])]}))
    assert steps_to_loss([str(a), str(b)], 5.5, 0.0) == {0: 25.0, 2: 0.0}
    assert steps_to_loss([str(a)], 6.0, 0.3) == {3: 12.5}
