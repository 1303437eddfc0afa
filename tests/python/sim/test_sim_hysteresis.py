"""Hysteresis inside the C++ simulator (csrc/sim/sim.h ``SimConfig.replan_threshold``),
the price of a moved replica (``resident_replicas``) and the derived replica cost of
the joint plan (``derived_replica_cost_rows``), through lrmoe/sim/simulate.py.

References, independent of the simulator's trace walk: the loop that lrmoe/sim/simulate.py
ran before the walk moved into C++, re-implemented here (each layer's steps in order,
the planner called per cell with the previous step's plan of that layer as its previous
placement, every cell timed alone by ``simulate_layer`` / ``simulate_pressure``), the
replicas placed anew counted by set difference of (expert, rank) pairs, and the replica
cost worked out by hand on a linear toy cost curve.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from lrmoe import _C
from lrmoe.planner import plan as P
from lrmoe.sim import simulate as S
from lrmoe.sim.costs import PER_ROW, Costs
from lrmoe.sim.links import Links
from lrmoe.workload.shapes import MODELS

H = 64
MEM = P.MemoryModel(expert_weight_bytes=1000, expert_grad_bytes=2000, expert_optimizer_bytes=1,
                    forward_row_bytes=1, backward_row_bytes=1, budget_bytes=1 << 40,
                    resident_bytes=0, optimizer_on_device=False)


def _costs():
    """Round hand-set costs (not a calibration): 1 ms per 1k rows forward."""
    g = np.array([[1, 1024, 1.0, 2.0], [16, 1024, 16.0, 32.0]], dtype=np.float64)
    return Costs("toy", {}, g, {k: 1e-6 for k in PER_ROW}, 10.0, {"device": "toy"})


def _drifting(seed, S_=5, L=3, W=4, E=8):
    """(S, L, W, E) loads whose hot experts change from step to step."""
    rng = np.random.default_rng(seed)
    base = rng.integers(10, 30, size=(S_, L, W, E))
    hot = rng.integers(1, 8, size=(1, L, 1, E)).repeat(S_, axis=0)
    for s in range(1, S_):  # one expert of each layer changes its popularity per step
        hot[s:, np.arange(L), 0, rng.integers(0, E, size=L)] = rng.integers(1, 8, size=L)
    return (base * hot).astype(np.int64)


def _pairs(p) -> set:
    off, rank = np.asarray(p.instance_offsets), np.asarray(p.instance_rank)
    return {(e, int(rank[i])) for e in range(len(off) - 1) for i in range(off[e], off[e + 1])}


def _replicas(p) -> set:
    off, rank = np.asarray(p.instance_offsets), np.asarray(p.instance_rank)
    return {(e, int(rank[i])) for e in range(len(off) - 1) for i in range(off[e] + 1, off[e + 1])}


def _reference(policy, load, t, resident, c=0.0, multiplier=0.0):
    """The per-layer walk re-implemented: per (step, layer) in (step, layer) order the
    LayerResult (or PressureResult), kept_previous and the replicas placed anew, each
    cell planned by the planner with the previous step's plan of its layer."""
    cfg = S.sim_config(_costs(), Links.from_file(), H)
    cfg.resident_replicas = resident
    inp = P.plan_input(load.shape[2], load.shape[3], MEM, c, "proportional", 1, 0, 0.5, 0, 1,
                       P.DEFAULT_BALANCE_SLACK)
    P.set_options(inp, policy, replan_threshold=t)
    S_, L = load.shape[:2]
    out = [None] * (S_ * L)
    empty32, empty64 = np.zeros(0, np.int32), np.zeros(0, np.int64)
    for layer in range(L):
        inp.previous_instance_offsets, inp.previous_instance_rank = empty32, empty32
        inp.previous_instance_rows = empty64
        before = None
        for step in range(S_):
            inp.load_WE = np.ascontiguousarray(load[step, layer])
            p = _C.planner.plan(policy, inp)
            r = (_C.sim.simulate_pressure(policy, inp, multiplier, 4, cfg) if multiplier
                 else _C.sim.simulate_layer(policy, inp, cfg))
            moved = len(_replicas(p) - (set() if before is None else _pairs(before)))
            out[step * L + layer] = (r, float(p.kept_previous), moved)
            before = p
            W = p.num_ranks
            inp.previous_instance_offsets = np.asarray(p.instance_offsets, np.int32)
            inp.previous_instance_rank = np.asarray(p.instance_rank, np.int32)
            inp.previous_instance_rows = np.asarray(p.forward_IW, np.int64).reshape(
                -1, W).sum(axis=1)
    return out


def _simulate(policy, load, t, resident, c=0.0, threads=2, **kw):
    return S.simulate(load, policy, MEM, _costs(), Links.from_file(), H, c, replica_slots=1,
                      threads=threads, replan_threshold=t, resident_replicas=resident, **kw)


@pytest.mark.parametrize("policy,c", [("lrmoe", 0.3), ("ultraep", 0.0), ("fixed", 0.0)])
@pytest.mark.parametrize("resident", [False, True])
@pytest.mark.parametrize("t", [0.0, 0.05, 0.3])
def test_the_cpp_walk_is_the_reference_loop(policy, c, resident, t):
    load = _drifting(13)
    res = _simulate(policy, load, t, resident, c)
    ref = _reference(policy, load, t, resident, c)
    assert res["kept_previous"].tolist() == [k for _, k, _ in ref]
    assert res["moved_replicas"].tolist() == [m for _, _, m in ref]
    for key in ("fwd_ms", "bwd_ms", "move_ms", "replica_bytes", "broadcast_ms", "memory_peak"):
        np.testing.assert_allclose(res[key], [getattr(r, key) for r, _, _ in ref], rtol=1e-12,
                                   err_msg=key)
    if policy != "fixed":  # the test must see both outcomes of the rule
        kept = res["kept_previous"].reshape(load.shape[:2])[1:]
        assert t == 0.0 or kept.any(), "no placement kept: hysteresis not exercised"
        assert (res["moved_replicas"] > 0).any()
    if resident and policy != "fixed":
        # a move is charged exactly where one happens (the first step's replicas too)
        assert ((res["move_ms"] > 0) == (res["moved_replicas"] > 0)).all()


def test_moves_are_counted_and_charged_without_hysteresis():
    load = _drifting(5)
    res = _simulate("ultraep", load, None, True)
    assert not res["kept_previous"].any()
    S_, L = load.shape[:2]
    inp_plans = [[P.plan(load[s, l], "ultraep", MEM, replica_slots=1) for s in range(S_)]
                 for l in range(L)]
    for s in range(S_):
        for l in range(L):
            p = inp_plans[l][s]
            want = len(_replicas(p) - (_pairs(inp_plans[l][s - 1]) if s else set()))
            assert res["moved_replicas"][s * L + l] == want
    assert ((res["move_ms"] > 0) == (res["moved_replicas"] > 0)).all()
    # without resident replicas (and without hysteresis) nothing is counted
    assert not _simulate("ultraep", load, None, False)["moved_replicas"].any()


def test_batch_pressure_takes_the_threshold():
    load = _drifting(11)
    res = _simulate("lrmoe", load, 0.05, True, 0.3, multiplier=1.0)
    ref = _reference("lrmoe", load, 0.05, True, 0.3, multiplier=1.0)
    assert all(r.micro_batches == 1 for r, _, _ in ref)  # one pass: the plan is the cell's
    np.testing.assert_allclose(res["time_ms"], [r.time_ms for r, _, _ in ref], rtol=1e-12)
    assert res["kept_previous"].tolist() == [k for _, k, _ in ref]
    assert res["kept_previous"].any()


def test_scale_takes_the_threshold():
    """simulate_cluster with one group is the layer walk of simulate on the same loads."""
    load = _drifting(13)
    one = _simulate("ultraep", load, 0.05, True)
    cl = S.simulate_cluster(load[:, None], "ultraep", MEM, _costs(), Links.from_file(), H,
                            replica_slots=1, threads=2, replan_threshold=0.05,
                            resident_replicas=True)
    np.testing.assert_allclose(cl["time_ms"], one["fwd_ms"] + one["bwd_ms"], rtol=1e-12)
    with pytest.raises(ValueError, match="symi"):
        S.simulate_cluster(load[:, None], "symi", MEM, _costs(), Links.from_file(), H,
                           threads=1, replan_threshold=0.05)


def test_symi_and_bad_thresholds_are_refused():
    load = _drifting(1, S_=2, L=1)
    with pytest.raises(ValueError, match="symi"):
        _simulate("symi", load, 0.1, False)
    with pytest.raises(ValueError, match="replan_threshold"):
        _simulate("ultraep", load, 1.0, False)


def test_derived_replica_cost_rows_by_hand():
    """gpu-small's expert (3 H I bf16) over 100 GB/s + 10 us, over one row of the toy curve:
    at k = E / W = 2 experts per rank and r = 750 rows per expert (<= 1024, the curves'
    first point), fwd = 1 + (16 - 1) (2 - 1) / 15 = 2 ms and bwd 4 ms, t_row = (2 + 4) /
    (2 x 2 x 750) = 0.002 ms; kappa = round(t_w / 0.002)."""
    shape = MODELS["gpu-small"]
    links = dataclasses.replace(Links.from_file(), intra_GBps=100.0, intra_latency_us=10.0)
    load = np.full((2, 1, 4, 8), 750 // 4, dtype=np.int64)
    load[..., 0, :] += 750 - 4 * (750 // 4)  # 750 rows per expert in every cell
    w = 3 * shape.hidden_size * shape.moe_intermediate_size * 2
    t_w = w / (100.0 * 1e6) + 10.0 / 1e3
    assert S.derived_replica_cost_rows(shape, _costs(), links, load) == round(t_w / 0.002)
    with pytest.raises(ValueError, match="no routed pair"):
        S.derived_replica_cost_rows(shape, _costs(), links, np.zeros((1, 4, 8), np.int64))
