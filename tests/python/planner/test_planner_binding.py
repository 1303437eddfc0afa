"""Tests of the planner's pybind11 binding ``lrmoe._C.planner`` (csrc/python/planner_bindings.cpp,
csrc/python/fields.h): its structs' named fields carry values both ways, a value a field
cannot hold is refused naming the field, and a PlanInput built field by field plans a
two-rank toy as worked out by hand below.

References: the hand-computed toy plan (fixed ownership, byte sizes 1/2/4/3/5) and the
names of docs/planner.md.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from lrmoe import _C
from lrmoe.planner import plan as P

B = _C.planner


def toy_input() -> "B.PlanInput":
    """2 ranks, 2 experts, L = [[1, 2], [3, 4]], no replica slots; an expert copy costs
    1 + 2 + 4 = 7 bytes (optimizer on the device), a forward row 3, a retained row 5;
    budget 50 - resident 5 = 45 bytes per rank."""
    inp = B.PlanInput()
    inp.num_ranks = 2
    inp.num_experts = 2
    inp.load_WE = [[1, 2], [3, 4]]
    inp.replica_slots = 0
    inp.memory.expert_weight_bytes = 1  # written through the nested struct
    inp.memory.expert_grad_bytes = 2
    inp.memory.expert_optimizer_bytes = 4
    inp.memory.forward_row_bytes = 3
    inp.memory.backward_row_bytes = 5
    inp.memory.budget_bytes = 50
    inp.memory.resident_bytes = 5
    return inp


def test_a_plan_input_built_field_by_field_plans_the_hand_computed_toy():
    # fixed ownership: expert e on rank e; instance 0 runs source rows [1, 3], instance 1
    # [2, 4]; c = 0 keeps all: quotas [4, 6]; rank 0 holds 7 + 4 x 3 + 4 x 5 = 39 bytes,
    # rank 1 7 + 6 x 3 + 6 x 5 = 55 > 45: infeasible on memory at rank 1, 10 bytes short
    p = B.plan("fixed", toy_input())
    assert p.policy == B.PolicyKind.fixed and p.policy.name == "fixed"
    assert (p.num_ranks, p.num_experts, p.num_instances()) == (2, 2, 2)
    assert p.instance_offsets.tolist() == [0, 1, 2] and p.instance_rank.tolist() == [0, 1]
    assert p.forward_IW.tolist() == [1, 3, 2, 4] and p.retained_IW.tolist() == [1, 3, 2, 4]
    assert p.quota_E.tolist() == [4, 6]
    assert p.fixed_rows_W.tolist() == p.forward_rows_W.tolist() == [4, 6]
    assert p.backward_rows_W.tolist() == [4, 6]
    parts = [(m.base_experts, m.replicas, m.forward_tokens, m.backward_tokens) for m in p.memory_W]
    assert parts == [(7, 0, 12, 20), (7, 0, 18, 30)]
    assert [m.total() for m in p.memory_W] == [39, 55]
    assert (p.limit_bytes, p.replicas, p.feasible) == (45, 0, False)
    assert (p.binding, p.binding_rank, p.shortfall) == (B.Binding.memory, 1, 10)
    assert "rank 1" in p.reason


def test_the_python_face_reads_the_toy_plan_by_name():
    memory = P.MemoryModel(1, 2, 4, 3, 5, budget_bytes=50, resident_bytes=5)
    p = P.plan([[1, 2], [3, 4]], "fixed", memory, replica_slots=0)
    assert p.forward_IW.dtype == torch.int64 and p.forward_IW.tolist() == [[1, 3], [2, 4]]
    assert p.memory_W4.tolist() == [[7, 0, 12, 20], [7, 0, 18, 30]]
    assert p.instance_offsets.tolist() == [0, 1, 2] and p.instance_offsets.dtype == torch.int64
    assert (p.binding, p.binding_rank, p.shortfall, p.limit_bytes) == ("memory", 1, 10, 45)
    assert P.POLICIES == ("fixed", "ultraep", "symi", "lrmoe")
    assert P.BINDINGS == ("none", "memory", "backward_row_capacity", "replica_slots")
    assert P.MEMORY_PARTS == B.MemoryBreakdown._fields


def test_every_field_reads_back_what_was_written():
    values = dict(num_ranks=3, num_experts=6, load_WE=list(range(18)),
                  recalibration_rate=0.25, quota_rule="water_level", replica_slots=1,
                  symi_slots=4, previous_load_E=[5, 4, 3, 2, 1, 0], max_expert_cut=0.75,
                  backward_row_capacity=99, balance_slack=0.125, min_replica_rows=7,
                  joint=True, replica_cost_rows=11, gpus_per_node=3,
                  previous_instance_offsets=[0, 1, 2, 3, 4, 5, 6],
                  previous_instance_rank=[0, 0, 1, 1, 2, 2],
                  previous_instance_rows=[1, 2, 3, 4, 5, 6], replan_threshold=0.375,
                  ultraep_refine=True, spare_capacity_split=True)
    int32 = {"previous_instance_offsets", "previous_instance_rank"}
    inp = B.PlanInput(**values, memory=B.MemoryModel(budget_bytes=1 << 40, resident_bytes=3,
                                                     optimizer_on_device=False))
    assert set(B.PlanInput._fields) == set(values) | {"memory"}
    for k, v in values.items():
        got = getattr(inp, k)
        if isinstance(got, np.ndarray):
            assert got.dtype == (np.int32 if k in int32 else np.int64), k
            assert got.tolist() == v, k
        elif k == "quota_rule":
            assert got == B.QuotaRule.water_level
        else:
            assert got == v and type(got) is type(v), k
    assert (inp.memory.budget_bytes, inp.memory.resident_bytes) == (1 << 40, 3)
    assert inp.memory.optimizer_on_device is False and inp.memory.forward_row_bytes == 0
    # an array is a copy: writing into it leaves the input alone
    inp.load_WE[0] = 1000
    assert inp.load_WE[0] == 0
    assert "num_ranks=3" in repr(inp) and "quota_rule=<QuotaRule.water_level" in repr(inp)


@pytest.mark.parametrize("field, value, error, match", [
    ("num_ranks", 1 << 31, ValueError,
     r"PlanInput.num_ranks must be an int in \[-2147483648, 2147483647\], got 2147483648"),
    ("replica_slots", -(1 << 40), ValueError, r"PlanInput.replica_slots must be an int in"),
    ("backward_row_capacity", 1 << 63, ValueError,
     r"PlanInput.backward_row_capacity must be an int in"),
    ("load_WE", np.array([1 << 63], dtype=np.uint64), ValueError,
     r"PlanInput.load_WE must hold values in"),
    ("quota_rule", "fastest", ValueError,
     r"PlanInput.quota_rule must be one of proportional, water_level"),
    ("quota_rule", B.Binding.memory, ValueError, r"PlanInput.quota_rule must be one of"),
    ("replica_slots", 1.5, TypeError, r"PlanInput.replica_slots must be an int, got 1.5"),
    ("replica_slots", True, TypeError, r"PlanInput.replica_slots must be an int, got True"),
    ("load_WE", [0.5, 1.0], TypeError, r"PlanInput.load_WE must hold ints, got dtype float64"),
    ("recalibration_rate", "0.3", TypeError, r"PlanInput.recalibration_rate must be a number"),
    ("memory", 5, TypeError, r"PlanInput.memory must be a MemoryModel"),
])
def test_a_bad_field_value_is_refused_naming_the_field(field, value, error, match):
    inp = toy_input()
    with pytest.raises(error, match=match):
        setattr(inp, field, value)
    with pytest.raises(error, match=match):  # the keyword constructor checks the same way
        B.PlanInput(**{field: value})


def test_the_planners_own_checks_name_the_field():
    inp = toy_input()
    inp.recalibration_rate = 1.5
    with pytest.raises(ValueError, match=r"recalibration_rate must be in \[0, 1\), got 1.5"):
        B.plan("lrmoe", inp)
    inp = toy_input()
    inp.load_WE = [1, 2, 3]
    with pytest.raises(ValueError, match="load must hold num_ranks x num_experts = 2 x 2 = 4"):
        B.plan("fixed", inp)
    inp = toy_input()
    with pytest.raises(ValueError, match=r"MemoryModel.budget_bytes must be an int in"):
        inp.memory.budget_bytes = 1 << 70
    with pytest.raises(ValueError, match="policy must be one of fixed, ultraep, symi, lrmoe"):
        B.plan("megatron", toy_input())
    with pytest.raises(TypeError, match="PlanInput has no field 'budget_bytes'"):
        B.PlanInput(budget_bytes=1)
