"""Tests of the simulator's pybind11 binding ``lrmoe._C.sim`` (csrc/python/sim_bindings.cpp)
and of lrmoe/sim/simulate.py reading it by name: the result keys are the documented ones,
the cost and link fields set by name reach their places in a one-rank toy worked out by
hand, and a bad field or argument is refused naming it.

References: the result keys as documented before the binding (written out below) and
hand arithmetic on a one-GEMM-point cost model.
"""
from __future__ import annotations

import numpy as np
import pytest

from lrmoe import _C
from lrmoe.planner.plan import MemoryModel
from lrmoe.sim import simulate as S
from lrmoe.sim.costs import PER_ROW, Costs
from lrmoe.sim.links import Links

B = _C.sim

#: the result keys of simulate(), in order, as they were written out by hand before they
#: were derived from the binding
DOCUMENTED = ("feasible", "binding", "fwd_ms", "bwd_ms", "src_fwd_ms", "dispatch_ms",
              "expert_fwd_ms", "combine_ms", "src_bwd_ms", "grad_a2a_ms", "expert_bwd_ms",
              "dx_a2a_ms", "replica_ms", "offload_ms",
              # issue 30: what the a2a / GEMM overlap saves (link.overlap_chunks)
              "overlap_fwd_ms", "overlap_bwd_ms", "fwd_link_bytes", "bwd_link_bytes",
              "replica_bytes", "offload_bytes", "memory_base_experts", "memory_replicas",
              "memory_forward_tokens", "memory_backward_tokens", "memory_peak", "limit_bytes",
              "replicas", "pairs", "retained", "fwd_imbalance", "bwd_imbalance",
              "owned_experts_max", "broadcast_ms",
              # issue 30: hysteresis in the simulator and the price of a move
              "kept_previous", "moved_replicas", "move_ms", "move_bytes",
              "micro_batches", "time_ms",
              # issue 30: batch pressure's whole-model activations (csrc/sim/activations.h)
              "activation_bytes", "recompute_ms")


def test_the_result_keys_derived_from_the_binding_are_the_documented_ones():
    assert S.FIELDS == DOCUMENTED
    assert set(B.PerRowCosts._fields) == set(PER_ROW)


def toy(**per_row):
    """One rank, one expert, 100 pairs; one GEMM point at exactly (1 expert, 100 rows):
    forward 1 ms, backward 2 ms; every per-row cost 0 unless given."""
    costs = Costs("toy", {}, np.array([[1, 100, 1.0, 2.0]]), {k: 0.0 for k in PER_ROW} | per_row,
                  0.0, {})
    memory = MemoryModel(0, 0, 0, 0, 0, budget_bytes=1 << 40, resident_bytes=0)
    return np.full((2, 1, 1, 1), 100, dtype=np.int64), memory, costs


def test_named_costs_reach_their_phases_in_a_hand_computed_toy():
    load, memory, costs = toy()
    r = S.simulate(load, "fixed", memory, costs, Links.from_file(), hidden=64, replica_slots=0,
                   threads=1)
    # W = 1: no all-to-all; the GEMM point itself, nothing else
    np.testing.assert_array_equal(r["expert_fwd_ms"], [1.0, 1.0])
    np.testing.assert_array_equal(r["expert_bwd_ms"], [2.0, 2.0])
    np.testing.assert_array_equal(r["time_ms"], [3.0, 3.0])
    np.testing.assert_array_equal(r["micro_batches"], [1.0, 1.0])
    np.testing.assert_array_equal(r["pairs"], [100.0, 100.0])
    assert r["feasible"].tolist() == [1.0, 1.0] and r["reason"] == ""
    # router: 0.01 ms per source pair of the forward -> 100 x 0.01 = 1 ms more, there only
    load, memory, costs = toy(router=0.01)
    r = S.simulate(load, "fixed", memory, costs, Links.from_file(), hidden=64, replica_slots=0)
    assert r["src_fwd_ms"].tolist() == pytest.approx([1.0, 1.0])
    assert r["fwd_ms"].tolist() == pytest.approx([2.0, 2.0])
    assert r["src_bwd_ms"].tolist() == [0.0, 0.0]


def test_the_config_structs_write_through_and_refuse_bad_values():
    cfg = B.SimConfig(hidden=64)
    cfg.cost.per_row.router = 0.5  # nested: written into cfg itself
    cfg.link.gpus_per_node = 4
    assert cfg.cost.per_row.router == 0.5 and cfg.link.gpus_per_node == 4 and cfg.hidden == 64
    with pytest.raises(TypeError, match=r"SimConfig.hidden must be an int, got '64'"):
        cfg.hidden = "64"
    with pytest.raises(ValueError, match=r"LinkModel.gpus_per_node must be an int in"):
        cfg.link.gpus_per_node = 1 << 40
    with pytest.raises(TypeError, match=r"CostModel.gemm\[1\] must be a GemmPoint"):
        cfg.cost.gemm = [B.GemmPoint(experts=1, rows=1, fwd_ms=1, bwd_ms=1), (1, 1, 1, 1)]
    with pytest.raises(TypeError, match="PerRowCosts has no field 'routr'"):
        B.PerRowCosts(routr=1.0)


def test_bad_arguments_of_the_entry_points_are_named():
    inp = _C.planner.PlanInput(num_ranks=2, num_experts=4, replica_slots=0,
                               memory=_C.planner.MemoryModel(budget_bytes=1 << 40))
    cfg = B.SimConfig(hidden=64, link=B.LinkModel(intra_GBps=100.0, inter_GBps=10.0))
    cfg.cost.gemm = [B.GemmPoint(experts=1, rows=1, fwd_ms=1.0, bwd_ms=1.0)]
    good = np.ones((1, 1, 2, 4), dtype=np.int64)
    assert len(B.simulate_trace("fixed", inp, good, cfg, threads=2)) == 1
    with pytest.raises(ValueError, match=r"loads_SLWE must be \(steps, layers, W=2, E=4\).*"
                                         r"got shape \(1, 2, 4\)"):
        B.simulate_trace("fixed", inp, good[0], cfg)
    with pytest.raises(TypeError, match="loads_SLWE must hold ints, got dtype float64"):
        B.simulate_trace("fixed", inp, good * 0.5, cfg)
    with pytest.raises(ValueError, match=r"previous_LWE must be \(layers, W=2, E=4\)"):
        B.simulate_trace("fixed", inp, good, cfg, previous_LWE=good)
    cfg.link.gpus_per_node = 0
    with pytest.raises(ValueError, match="gpus_per_node must be >= 1"):
        B.simulate_trace("fixed", inp, good, cfg)
    cfg.link.gpus_per_node = 8
    inp.load_WE = [1] * 8
    with pytest.raises(ValueError, match="max_micro_batches must be >= 1"):
        B.simulate_pressure("fixed", inp, 2.0, 0, cfg)
    with pytest.raises(ValueError, match=r"costs.gemm_G4 must be \(points, 4\)"):
        S.simulate(good, "fixed", MemoryModel(0, 0, 0, 0, 0, 1 << 40, 0),
                   Costs("t", {}, np.zeros((0, 4)), {k: 0.0 for k in PER_ROW}, 0.0, {}),
                   Links.from_file(), hidden=64)


def test_simulate_cluster_takes_the_slowest_group_by_hand():
    """One rank per group, one expert, 3 groups of one layer and 2 steps: group g's
    layer of step s has 100 x (1 + g + s) pairs; the one GEMM point (100 rows: 1 ms
    forward, 2 ms backward) grows in proportion beyond it, so a layer of 100 n rows takes
    3 n ms and the slowest group is the last: 3 x (3 + s) ms, the mean 3 x (2 + s)."""
    _, memory, costs = toy()
    cfg = S.sim_config(costs, Links.from_file(), 64)
    inp = S.plan_input(1, 1, memory, 0.0, "proportional", 0, 0, 0.5, 0, 1, 0.0)
    load = np.array([[[[[100 * (1 + g + s)]]] for g in range(3)] for s in range(2)],
                    dtype=np.int64)
    out = B.simulate_cluster("fixed", inp, load, cfg, 2)
    assert [r.time_ms for r in out] == [9.0, 12.0]
    assert [r.slowest_group for r in out] == [2, 2]
    assert [r.mean_group_ms for r in out] == pytest.approx([6.0, 9.0])
    with pytest.raises(ValueError, match="loads_SGLWE"):
        B.simulate_cluster("fixed", inp, load[0], cfg, 1)


def test_cluster_steps_add_the_step_terms_by_hand():
    """The toy above as 3 groups of one rank, 2 steps of one simulated layer standing for
    4 (slowest group 9 and 12 ms, mean 6 and 9), one expert of 4e6 gradient bytes per
    rank, links G = 2, NVLink 1 GB/s 10 us, network 2 GB/s 5 us (2e6 B/ms); by hand from
    the ring all-reduce 2 (n - 1) / n x bytes / GBps + 2 (n - 1) x latency and Adam's
    30 B per parameter over HBM."""
    _, _, costs = toy()
    memory = MemoryModel(0, 4_000_000, 0, 0, 0, budget_bytes=1 << 40, resident_bytes=0)
    cfg = S.sim_config(costs, Links.from_file(), 64)
    inp = S.plan_input(1, 1, memory, 0.0, "proportional", 0, 0, 0.5, 0, 1, 0.0)
    load = np.array([[[[[100 * (1 + g + s)]]] for g in range(3)] for s in range(2)],
                    dtype=np.int64)
    res = B.simulate_cluster("fixed", inp, load, cfg, 2)
    assert [r.owned_experts_max for r in res] == [1, 1]
    assert [r.broadcast_ms for r in res] == [0.0, 0.0]
    link = B.LinkModel(gpus_per_node=2, intra_GBps=1.0, intra_latency_us=10.0,
                       inter_GBps=2.0, inter_latency_us=5.0)
    model = B.StepModel(dp_size=3, dense_grad_bytes=1e6, dense_params=1e5, expert_params=1e4,
                        hbm_GBps=1.0, moe_layers=4)
    st = B.cluster_steps(res, 2, 1, 1, 4e6, link, model)
    assert [s.moe_ms for s in st] == [36.0, 48.0]  # 9 and 12 ms x 4 layers
    assert [s.mean_group_moe_ms for s in st] == [24.0, 36.0]
    t = st[0].terms
    # 4 layers x 1 expert x 4e6 B over 3 groups: 4 / 3 x 16e6 / 2e6 + 4 x 0.005
    assert t.expert_allreduce_ms == pytest.approx(4 / 3 * 8 + 0.02, rel=1e-12)
    # 1e6 B over 3 GPUs, more than a node of 2: 4 / 3 x 1e6 / 2e6 + 4 x 0.005
    assert t.dense_allreduce_ms == pytest.approx(4 / 3 * 0.5 + 0.02, rel=1e-12)
    # Adam: (4 x 1e4 + 1e5) x 30 B / 1e6 B/ms
    assert t.optimizer_ms == pytest.approx(4.2, rel=1e-12)
    assert t.broadcast_ms == 0.0
    with pytest.raises(ValueError, match="layers_SL must hold"):
        B.cluster_steps(res[:1], 2, 1, 1, 4e6, link, model)
    with pytest.raises(ValueError, match="dp_size"):
        B.cluster_steps(res, 2, 1, 1, 4e6, link, B.StepModel(dp_size=0))
    with pytest.raises(TypeError, match="ClusterLayer"):
        B.cluster_steps([1, 2], 2, 1, 1, 4e6, link, model)
