"""The planner's options through the simulator (issue 30): ``lrmoe sim --joint``,
``--replica-cost-rows``, ``--ultraep-refine``, ``--spare-capacity-split``,
``--replan-threshold`` (hysteresis) and the topology (``--gpus-per-node``, by default the
link file's), in lrmoe/sim/simulate.py and lrmoe/sim/report.py.

References, independent of the simulator: the planner called directly
(lrmoe.planner.plan.plan) with the same options, whose plan gives the per-layer fields
by hand (peak bytes, replicas, retained pairs, max / mean rows per rank), the link bytes
of a plan counted by hand from the hierarchical routing that csrc/sim/a2a.h documents
(a row to a remote node crosses to the rank with the source's local index there, which
forwards it over NVLink when that rank is not the destination), and the promises of
csrc/planner/joint.h and ultraep_refine.h (the refined plan's max rank rows never above
the unrefined one's). Each test first checks that the option changes the plan on its
load, so a simulator that dropped the option would fail it.
"""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from lrmoe import cli
from lrmoe.planner import plan as P
from lrmoe.sim import simulate as S
from lrmoe.sim.costs import PER_ROW, Costs
from lrmoe.sim.links import Links
from lrmoe.sim.report import run_sim

H = 64
MEM = P.MemoryModel(expert_weight_bytes=1, expert_grad_bytes=1, expert_optimizer_bytes=1,
                    forward_row_bytes=1, backward_row_bytes=1, budget_bytes=1 << 40,
                    resident_bytes=0, optimizer_on_device=False)


def _costs():
    """Round hand-set costs (not a calibration): 1 ms per 1k rows forward."""
    g = np.array([[1, 1024, 1.0, 2.0], [16, 1024, 16.0, 32.0]], dtype=np.float64)
    return Costs("toy", {}, g, {k: 1e-6 for k in PER_ROW}, 10.0, {"device": "toy"})


def _loads(seed, W=4, E=8, skew=6):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 30, size=(W, E)) * rng.integers(1, skew, size=E)).astype(np.int64)


def _fields_of(p: P.Plan) -> dict:
    """The simulator's per-layer fields a plan fixes, computed from the plan alone."""
    f, b = p.forward_rows_W.double(), p.backward_rows_W.double()
    return dict(memory_peak=p.peak_bytes(), replicas=p.replicas,
                retained=int(p.quota_E.sum()), fwd_imbalance=float(f.max() / f.mean()),
                bwd_imbalance=float(b.max() / b.mean()))


def _sim_fields(res: dict, j: int = 0) -> dict:
    return {k: res[k][j] for k in ("memory_peak", "replicas", "retained", "fwd_imbalance",
                                   "bwd_imbalance")}


def _rank_rows(p: P.Plan, kappa: int = 0) -> np.ndarray:
    """joint.h's rank time t_r = forward + retained rows + kappa x replicas on r."""
    t = (p.forward_rows_W + p.backward_rows_W).numpy().astype(np.int64)
    off, ranks = p.instance_offsets.tolist(), p.instance_rank.tolist()
    for e in range(len(off) - 1):
        for i in range(off[e] + 1, off[e + 1]):
            t[ranks[i]] += kappa
    return t


def _differs(a: P.Plan, b: P.Plan) -> bool:
    return any(getattr(a, k).tolist() != getattr(b, k).tolist()
               for k in ("instance_rank", "forward_IW", "retained_IW", "quota_E"))


def _first_load(differ, seeds=range(200), **kw):
    for seed in seeds:
        load = _loads(seed, **kw)
        if differ(load):
            return load
    raise AssertionError("no load among the seeds where the option changes the plan")


def test_joint_reaches_the_planner_and_never_raises_the_max_rank_rows():
    c, kw = 0.3, dict(replica_slots=1, balance_slack=None)
    load = _first_load(lambda x: _differs(P.plan(x, "lrmoe", MEM, c, joint=True, **kw),
                                          P.plan(x, "lrmoe", MEM, c, **kw)))
    links = Links.from_file()
    for joint in (False, True):
        res = S.simulate(load[None, None], "lrmoe", MEM, _costs(), links, H, c,
                         replica_slots=1, balance_slack=None, threads=1, joint=joint)
        ref = P.plan(load, "lrmoe", MEM, c, joint=joint, **kw)
        assert _sim_fields(res) == pytest.approx(_fields_of(ref)), joint
    # joint.h: the local search starts from the sequential plan and never raises T
    for seed in range(40):
        x = _loads(seed)
        for kappa in (0, 5):
            seq = P.plan(x, "lrmoe", MEM, c, **kw)
            jnt = P.plan(x, "lrmoe", MEM, c, joint=True, replica_cost_rows=kappa, **kw)
            assert _rank_rows(jnt, kappa).max() <= _rank_rows(seq, kappa).max(), (seed, kappa)


def test_replica_cost_rows_reaches_the_joint_objective():
    # one hot expert, one slot: a replica halves the hot rank's rows unless it costs more
    # than it saves (test_joint.py's hand case: kappa 30 keeps all 12 rows on rank 0)
    load = np.array([[12, 0], [0, 0]], dtype=np.int64)
    for kappa, replicas in ((0, 1), (30, 0)):
        res = S.simulate(load[None, None], "lrmoe", MEM, _costs(), Links.from_file(), H,
                         replica_slots=1, balance_slack=None, threads=1, joint=True,
                         replica_cost_rows=kappa)
        assert res["replicas"][0] == replicas, kappa


def test_ultraep_refine_reaches_the_planner_and_never_raises_the_max_rows():
    kw = dict(replica_slots=2)
    load = _first_load(lambda x: _differs(P.plan(x, "ultraep", MEM, ultraep_refine=True, **kw),
                                          P.plan(x, "ultraep", MEM, **kw)), W=8, E=16)
    for refine in (False, True):
        res = S.simulate(load[None, None], "ultraep", MEM, _costs(), Links.from_file(), H,
                         replica_slots=2, threads=1, ultraep_refine=refine)
        ref = P.plan(load, "ultraep", MEM, ultraep_refine=refine, **kw)
        assert _sim_fields(res) == pytest.approx(_fields_of(ref)), refine
    for seed in range(40):
        x = _loads(seed, W=8, E=16)
        assert P.plan(x, "ultraep", MEM, ultraep_refine=True, **kw).max_forward_rows() \
            <= P.plan(x, "ultraep", MEM, **kw).max_forward_rows(), seed


def _link_bytes_by_hand(p: P.Plan, G: int, row_bytes: int) -> float:
    """Forward dispatch + combine bytes over links of plan ``p`` without dedup: a row
    from s to d on d's node counts once (NVLink); to another node it crosses to the rank
    of d's node with s's local index and is forwarded once more when that is not d; a
    rank's own rows touch no link. The combine takes the same hops back with rows of
    ``row_bytes`` + 4 (the output and its fp32 phi_sq, as the EP layer sends)."""
    W = p.forward_IW.shape[1]
    M = np.zeros((W, W), dtype=np.int64)  # M[s, d]: rows from source s computed on d
    for i, r in enumerate(p.instance_rank.tolist()):
        M[:, r] += p.forward_IW[i].numpy()
    rows = 0
    for s in range(W):
        for d in range(W):
            if s == d or not M[s, d]:
                continue
            if s // G == d // G:
                rows += M[s, d]
            else:
                rows += M[s, d] * (1 + ((d // G) * G + s % G != d))
    return float(rows * (2 * row_bytes + 4))


@pytest.mark.parametrize("policy", ["lrmoe", "ultraep"])
def test_topology_and_spare_split_reach_the_planner(policy):
    """W = 8 in nodes of 2: the node-aware plan (and UltraEP's spare-capacity split)
    moves rows between nodes, which the link bytes show."""
    W, E, G = 8, 16, 2
    links = dataclasses.replace(Links.from_file(), gpus_per_node=G)
    c = 0.3 if policy == "lrmoe" else 0.0
    variants = [dict(), dict(gpus_per_node=G), dict(gpus_per_node=G, spare_capacity_split=True)]
    plans = lambda x: [P.plan(x, policy, MEM, c, replica_slots=2, **v) for v in variants]  # noqa: E731
    load = _first_load(lambda x: len({_link_bytes_by_hand(p, G, 2 * H) for p in plans(x)}) == 3,
                       W=W, E=E)
    for v, ref in zip(variants, plans(load)):
        res = S.simulate(load[None, None], policy, MEM, _costs(), links, H, c, replica_slots=2,
                         threads=1, **v)
        assert res["fwd_link_bytes"][0] == pytest.approx(_link_bytes_by_hand(ref, G, 2 * H)), v
        assert _sim_fields(res) == pytest.approx(_fields_of(ref)), v


def test_hysteresis_plans_each_layer_from_its_previous_step():
    """Two steps x two layers: step 1 of each layer is plan(load, previous_plan=step 0's
    plan of that layer) called directly; step 0 is a fresh plan."""
    kw = dict(replica_slots=1)
    rng = np.random.default_rng(7)
    load = (rng.integers(0, 30, size=(2, 2, 4, 8)) * rng.integers(1, 6, size=8)).astype(np.int64)
    t = 0.5  # a high threshold: the kept placement wins unless far worse
    res = S.simulate(load, "lrmoe", MEM, _costs(), Links.from_file(), H, 0.3, threads=1,
                     replan_threshold=t, **kw)
    kept = []
    for layer in range(2):
        first = P.plan(load[0, layer], "lrmoe", MEM, 0.3, **kw)
        second = P.plan(load[1, layer], "lrmoe", MEM, 0.3, previous_plan=first,
                        replan_threshold=t, **kw)
        assert _sim_fields(res, layer) == pytest.approx(_fields_of(first))
        assert _sim_fields(res, 2 + layer) == pytest.approx(_fields_of(second))
        assert res["kept_previous"][2 + layer] == float(second.kept_previous)
        assert res["moved_replicas"][2 + layer] == second.moved_replicas
        kept.append(second.kept_previous)
    assert res["kept_previous"][:2].tolist() == [0.0, 0.0]
    assert any(kept), "the threshold keeps no placement: the test would not see hysteresis"
    with pytest.raises(ValueError, match="symi"):
        S.simulate(load, "symi", MEM, _costs(), Links.from_file(), H, replan_threshold=0.1)


@pytest.fixture(scope="module")
def quick_costs(tmp_path_factory):
    path = tmp_path_factory.mktemp("costs") / "costs.json"
    assert cli.main(["calibrate", "--quick", "--device", "cpu", "--shapes", "gpu-small",
                     "--out", str(path), "--iters", "1"]) == 0
    return path


def _sim(costs, out, *extra):
    return run_sim(cli.build_parser().parse_args(
        ["sim", "--costs", str(costs), "--model", "gpu-small", "--gpus", "4",
         "--tokens-per-gpu", "256", "--steps", "2", "--layers", "2", "--pressure",
         "--threads", "1", "--skew", "4", "--out", str(out), *extra]))


def test_sim_defaults_are_the_papers_policies_and_flags_turn_them_off(quick_costs, tmp_path):
    from lrmoe.workload.shapes import MODELS
    on = _sim(quick_costs, tmp_path / "on")
    setup = json.loads((tmp_path / "on" / "sim.json").read_text())["setup"]
    assert (setup["joint"], setup["ultraep_refine"], setup["spare_capacity_split"]) == \
        (True, True, "ultraep")
    assert setup["dedup_top_k"] == MODELS["gpu-small"].top_k
    assert setup["gpus_per_node"] == Links.from_file().gpus_per_node
    assert setup["replan_threshold"] is None
    off = _sim(quick_costs, tmp_path / "off", "--no-joint", "--no-ultraep-refine",
               "--spare-capacity-split", "none", "--dedup-top-k", "1")
    # dedup is a property of the dispatcher: fewer rows cross for every policy
    for p in ("fixed", "symi"):
        assert on["policies"][p]["fwd_link_bytes"] < off["policies"][p]["fwd_link_bytes"], p
        assert on["policies"][p]["memory_peak"] == off["policies"][p]["memory_peak"], p


@pytest.mark.parametrize("extra,msg", [
    (["--joint", "--policies", "fixed", "ultraep"], "--joint applies to policy lrmoe"),
    (["--ultraep-refine", "--policies", "lrmoe"], "--ultraep-refine applies to policy ultraep"),
    (["--no-joint", "--replica-cost-rows", "5"], "--replica-cost-rows is a term"),
    (["--replica-cost-rows", "-1"], "--replica-cost-rows must be >= 0"),
    (["--replan-threshold", "1.0"], r"--replan-threshold must be in \[0, 1\)"),
    (["--replan-threshold", "0.1", "--policies", "symi"], "--replan-threshold .hysteresis."),
    (["--gpus-per-node", "3"], "--gpus-per-node must be an integer >= 1 that divides"),
    (["--gpus-per-node", "0"], "--gpus-per-node must be"),
    (["--dedup-top-k", "99"], r"--dedup-top-k must be in \[1, "),
])
def test_sim_refuses_bad_planner_flag_combinations(quick_costs, tmp_path, extra, msg):
    with pytest.raises(ValueError, match=msg):
        _sim(quick_costs, tmp_path / "x", *extra)


def test_sim_cli_joint_gives_the_direct_plans_fields(quick_costs, tmp_path):
    """``lrmoe sim --replan-threshold`` records each policy's share of kept placements;
    ``--no-joint`` / ``--joint`` change lrmoe only."""
    a = _sim(quick_costs, tmp_path / "a", "--no-joint")
    b = _sim(quick_costs, tmp_path / "b", "--joint")
    for p in ("fixed", "ultraep", "symi"):
        assert a["policies"][p]["bwd_ms"] == b["policies"][p]["bwd_ms"], p
    h = _sim(quick_costs, tmp_path / "h", "--replan-threshold", "0.5")
    assert 0.0 <= h["policies"]["lrmoe"]["kept_previous"] <= 0.5  # step 0 is always fresh
    assert "kept_previous" not in h["policies"]["symi"] or h["policies"]["symi"]["kept_previous"] == 0


def test_sim_cli_threshold_reaches_pressure_and_scale_and_kappa_is_derived(quick_costs, tmp_path):
    """``--replan-threshold`` with batch pressure and ``--scale`` runs (it was refused or
    ignored there); the joint plan's replica cost is the derived one unless given, and
    the derived one is lrmoe.sim.simulate.derived_replica_cost_rows of the run's loads
    (by hand in tests/python/sim/test_sim_hysteresis.py)."""
    from lrmoe.workload.shapes import MODELS
    h = run_sim(cli.build_parser().parse_args(
        ["sim", "--costs", str(quick_costs), "--model", "gpu-small", "--gpus", "4",
         "--tokens-per-gpu", "256", "--steps", "2", "--layers", "2", "--pressure", "1", "2",
         "--pressure-steps", "2", "--scale", "4", "8", "--threads", "1", "--skew", "4",
         "--replan-threshold", "0.05", "--resident-replicas", "--out", str(tmp_path / "h")]))
    assert set(h["pressure"]["policies"]) >= {"fixed", "ultraep", "lrmoe"}
    assert h["scale"]
    shape = MODELS["gpu-small"]
    from lrmoe.workload.loads import cluster_loads
    loads = cluster_loads(4, shape.num_experts, 256, shape.top_k, 2, 2, 4.0, None, 0)
    want = S.derived_replica_cost_rows(shape, Costs.from_file(str(quick_costs), "gpu-small"),
                                       Links.from_file(), loads)
    # (the quick CPU calibration's rows are slow: kappa may round to 0 here; the formula is
    # checked by hand on a toy curve in test_sim_hysteresis.py)
    assert h["policies"]["lrmoe"]["replica_cost_rows"] == want
    k = _sim(quick_costs, tmp_path / "k", "--replica-cost-rows", "5")
    assert k["policies"]["lrmoe"]["replica_cost_rows"] == 5
    assert k["policies"]["ultraep"]["replica_cost_rows"] == 0
