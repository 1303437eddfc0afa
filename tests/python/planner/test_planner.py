"""Tests of the Python face of the placement planner (lrmoe/planner/plan.py over the
binding ``lrmoe._C.planner``) and of ``lrmoe plan``. The planner's own logic is tested in
tests/cpp/test_planner.cpp (the binding's in test_planner_binding.py); here: the binding carries the plan unchanged, the byte sizes match hand arithmetic, the
loads match hand-built counts, and the command runs end to end.

References: hand-computed numbers written out below, the quota reference of conftest.py
(exact rationals), numpy bincounts, and plan invariants checked from the arrays.
"""
from __future__ import annotations

import json
from fractions import Fraction

import numpy as np
import pytest
import torch

from lrmoe import cli
from lrmoe.planner import plan as P
from lrmoe.workload import loads as L
from lrmoe.workload.shapes import SHAPES
from lrmoe.workload.trace import RoutingTrace

from conftest import ref_proportional_quota

QWEN = SHAPES["qwen3-30b-a3b"]


def small_memory(budget: int = 1 << 40, resident: int = 0) -> P.MemoryModel:
    return P.MemoryModel(expert_weight_bytes=1, expert_grad_bytes=2, expert_optimizer_bytes=4,
                         forward_row_bytes=3, backward_row_bytes=5, budget_bytes=budget,
                         resident_bytes=resident)


def check_invariants(plan: P.Plan, load_WE: np.ndarray, memory: P.MemoryModel) -> None:
    """Every routed pair computed once, retained shares within forward rows and summing to
    the quotas, at most one instance per rank, memory parts from the byte sizes."""
    W, E = load_WE.shape
    off = plan.instance_offsets.numpy()
    ranks = plan.instance_rank.numpy()
    fwd, kept = plan.forward_IW.numpy(), plan.retained_IW.numpy()
    assert off[0] == 0 and off[-1] == ranks.size == fwd.shape[0] == kept.shape[0]
    for e in range(E):
        a, b = off[e], off[e + 1]
        assert len(set(ranks[a:b].tolist())) == b - a
        np.testing.assert_array_equal(fwd[a:b].sum(axis=0), load_WE[:, e])
        assert kept[a:b].sum() == plan.quota_E[e].item()
        assert (kept[a:b] <= fwd[a:b]).all() and (kept[a:b] >= 0).all()
    rows_fwd = np.zeros(W, dtype=np.int64)
    rows_bwd = np.zeros(W, dtype=np.int64)
    np.add.at(rows_fwd, ranks, fwd.sum(axis=1))
    np.add.at(rows_bwd, ranks, kept.sum(axis=1))
    np.testing.assert_array_equal(plan.forward_rows_W.numpy(), rows_fwd)
    np.testing.assert_array_equal(plan.backward_rows_W.numpy(), rows_bwd)
    mem = plan.memory_W4.numpy()
    np.testing.assert_array_equal(mem[:, 2], rows_fwd * memory.forward_row_bytes)
    np.testing.assert_array_equal(mem[:, 3], rows_bwd * memory.backward_row_bytes)
    fits = (mem.sum(axis=1) <= memory.budget_bytes - memory.resident_bytes).all()
    assert plan.feasible == bool(fits), plan.reason
    assert (plan.reason == "") == plan.feasible


def test_memory_model_bytes_by_hand():
    # Qwen3-30B-A3B expert: 3 x 2048 x 768 = 4,718,592 parameters: bf16 9 MiB, fp32 grad
    # 18 MiB, master + Adam 54 MiB; rows: 4 H + 4 I = 11,264 B forward, 6 H + 12 I =
    # 21,504 B backward.
    m = P.MemoryModel.from_shape(QWEN, 80 * P.GiB, 64 * P.GiB)
    assert (m.expert_weight_bytes, m.expert_grad_bytes, m.expert_optimizer_bytes) == (
        9 << 20, 18 << 20, 54 << 20)
    assert (m.forward_row_bytes, m.backward_row_bytes) == (11264, 21504)
    assert P.parse_bytes("80GiB") == 80 * 2 ** 30 and P.parse_bytes("1.5e9") == 1_500_000_000
    assert P.parse_bytes("512MB") == 512_000_000


def test_parse_bytes_error_names_the_value():
    with pytest.raises(ValueError, match="'lots'"):
        P.parse_bytes("lots")


@pytest.mark.parametrize("policy", P.POLICIES)
def test_binding_carries_a_valid_plan(policy):
    rng = np.random.default_rng(3)
    load = rng.integers(0, 50, size=(4, 8))
    load[:, 2] *= 20  # one hot expert
    memory = small_memory(budget=10_000, resident=2_000)
    plan = P.plan(load, policy, memory, recalibration_rate=0.3)
    check_invariants(plan, load, memory)
    n = load.sum(axis=0)
    if policy == "lrmoe":  # no memory pressure: the plain quota rule
        assert plan.quota_E.tolist() == ref_proportional_quota(n.tolist(), Fraction(3, 10))
    else:  # the baselines keep every pair
        assert plan.quota_E.tolist() == n.tolist()
    if policy != "symi":  # fixed ownership first: expert 2 of 8 on 4 ranks -> rank 1
        assert plan.instances(2)[0] == 1


def test_toy_hot_expert_replica_freed_by_the_cut():
    # loads [4, 2, 3] on 3 ranks, one backward row costs 1 byte, 3 bytes free per GPU:
    # c = 1/3 gives quotas [3, 1, 2] (the op `quota` agrees) and no replica; exact (c = 0)
    # needs one replica of expert 0.
    load = np.diag([4, 2, 3])
    memory = P.MemoryModel(0, 0, 0, 0, 1, budget_bytes=3, resident_bytes=0)
    # memory only (balance_slack None): the default balance target would level [3, 1, 2]
    # with a replica of expert 0, which is not what this checks
    cut = P.plan(load, "lrmoe", memory, recalibration_rate=1 / 3, replica_slots=1,
                 balance_slack=None)
    quota_op = torch.ops.lrmoe.quota(torch.tensor([4, 2, 3], dtype=torch.int32), 1 / 3,
                                     "proportional")
    assert cut.quota_E.tolist() == quota_op.tolist() == [3, 1, 2]
    assert cut.replicas == 0 and cut.feasible
    exact = P.plan(load, "lrmoe", memory, recalibration_rate=0.0, replica_slots=1,
                   balance_slack=None)
    assert exact.replicas == 1 and exact.feasible and exact.instances(0) == [0, 1]
    # the default balance target (the mean, 2 retained rows per rank) levels them with a
    # replica and never cuts: rank 0 is 1 row over; a forward row of expert 0 carries 3/4
    # of a retained one, and rank 1 has room for 1 more retained row (1 forward row): a
    # replica of expert 0 on rank 1 with 1 of its 4 forward rows; its 3 retained rows
    # split over forward [3, 1] within the rooms [2, 1] -> [2, 1]; rows per rank [2, 2, 2]
    level = P.plan(load, "lrmoe", memory, recalibration_rate=1 / 3, replica_slots=1)
    assert level.quota_E.tolist() == [3, 1, 2] and level.feasible
    assert level.replicas == 1 and level.instances(0) == [0, 1]
    assert level.backward_rows_W.tolist() == [2, 2, 2]
    fixed = P.plan(load, "fixed", memory)
    assert not fixed.feasible and fixed.binding == "memory" and fixed.shortfall == 1
    assert "rank 0" in fixed.reason


@pytest.mark.parametrize("kwargs, match", [
    (dict(load=[[1, -1], [0, 0]]), "load must be >= 0"),
    (dict(load=[[1, 2, 3]], ranks=2), "multiple of num_ranks"),
    (dict(resident=1 << 41), "budget_bytes"),
    (dict(policy="ultraep", replica_slots=0), "replica_slots must be >= 1"),
    (dict(policy="symi", symi_slots=0, load=[[1] * 8] * 4, replica_slots=0), None),
    (dict(policy="megatron"), "policy must be one of"),
    # the C++ planner holds slot counts as int32: 2^32 + 2 wrapped around to 2
    (dict(policy="ultraep", replica_slots=(1 << 32) + 2), r"replica_slots must be an int in \[0, E=2\]"),
    (dict(policy="ultraep", replica_slots=3), "replica_slots must be an int in"),
    (dict(policy="symi", symi_slots=10 ** 20), "symi_slots must be an int in"),
    (dict(replica_slots=True), "replica_slots must be an int in"),
])
def test_bad_input_names_the_argument(kwargs, match):
    load = np.asarray(kwargs.get("load", [[1, 2], [3, 4]]))
    if kwargs.get("ranks") == 2:
        load = np.asarray([[1, 2, 3], [4, 5, 6]])
    memory = small_memory(resident=kwargs.get("resident", 0))
    call = lambda: P.plan(load, kwargs.get("policy", "fixed"), memory,  # noqa: E731
                          replica_slots=kwargs.get("replica_slots", 2),
                          symi_slots=kwargs.get("symi_slots", 0))
    if match is None:
        call()  # symi with no spare slot: one slot per expert is fine
    else:
        with pytest.raises(ValueError, match=match):
            call()


def test_the_binding_bounds_slot_counts_itself(monkeypatch):
    """Past the Python check, the binding refuses slots above E (plan()) and values its
    int32 fields cannot hold (the field itself) rather than wrap them."""
    monkeypatch.setattr(P, "check_slots", lambda *args: None)
    for kwargs, match in (
            (dict(replica_slots=3),
             r"replica_slots must be <= the number of experts \(E=2"),
            (dict(symi_slots=(1 << 32) + 1),
             r"PlanInput.symi_slots must be an int in \[-2147483648, 2147483647\], "
             r"got 4294967297")):
        with pytest.raises(ValueError, match=match):
            P.plan([[1, 2], [3, 4]], "ultraep", small_memory(), **kwargs)


def test_synthetic_loads_skew_and_totals():
    E, W, pairs = 128, 8, 4096
    a = L.zipf_exponent(E, 4.0)
    w = np.arange(1, E + 1, dtype=np.float64) ** -a
    assert w[0] / w.mean() == pytest.approx(4.0, rel=1e-9)
    load = L.synthetic_loads(W, E, pairs, 4.0, seed=1)
    assert load.shape == (W, E) and (load.sum(axis=1) == pairs).all()
    n = load.sum(axis=0)
    assert 3.0 < n.max() / n.mean() < 5.0  # the draw scatters around the expected 4
    uniform = L.synthetic_loads(W, E, pairs, 1.0, seed=1).sum(axis=0)
    assert uniform.max() / uniform.mean() < 1.5
    with pytest.raises(ValueError, match="max_over_mean"):
        L.synthetic_loads(W, E, pairs, 0.5)


def test_trace_loads_from_a_recorded_trace(tmp_path):
    trace = RoutingTrace(num_experts=4, top_k=2)
    ids = torch.tensor([[0, 1], [1, 2], [3, 1], [1, 0]])
    trace.record(0, ids)
    path = trace.save(tmp_path / "t.npz")
    load, meta = L.trace_loads(path, num_ranks=2, record=0)
    # rank 0 gets tokens 0, 1 (experts 0 1 1 2), rank 1 tokens 2, 3 (3 1 1 0)
    np.testing.assert_array_equal(load, [[1, 2, 1, 0], [1, 2, 0, 1]])
    assert meta["num_experts"] == 4
    resampled, _ = L.trace_loads(path, num_ranks=2, tokens_per_rank=50, seed=0)
    assert (resampled.sum(axis=1) == 100).all()
    assert resampled[:, 1].sum() == 100  # every recorded token routes to expert 1


def test_cli_plan_json_and_figures(tmp_path, capsys):
    prefix = tmp_path / "fig"
    rc = cli.main(["plan", "--ep", "4", "--tokens-per-rank", "512", "--balance", "-1", "--json",
                   "--png", str(prefix)])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert [p["policy"] for p in out["plans"]] == list(P.POLICIES)
    fixed = out["plans"][0]
    assert fixed["replicas"] == 0 and fixed["retained_fraction"] == 1.0
    lrmoe = out["plans"][3]
    # no balance target, room to spare: exactly floor(0.7 N) of N = 4 x 512 x 8 pairs
    assert lrmoe["retained_fraction"] == int(0.7 * 16384) / 16384
    assert (tmp_path / "fig_memory.png").stat().st_size > 0
    assert (tmp_path / "fig_loads.png").stat().st_size > 0


def test_cli_plan_table_and_errors(capsys):
    assert cli.main(["plan", "--ep", "2", "--tokens-per-rank", "64", "--policy", "fixed"]) == 0
    out = capsys.readouterr().out
    assert "fixed" in out and "peak rank" in out
    assert cli.main(["plan", "--budget", "10GiB", "--resident", "64GiB"]) == cli.EXIT_USAGE
    assert "budget_bytes" in capsys.readouterr().err
    assert cli.main(["plan", "--loads", "trace"]) == cli.EXIT_USAGE
    assert "--trace PATH" in capsys.readouterr().err
