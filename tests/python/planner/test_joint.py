"""The joint lrmoe objective through lrmoe.planner and `lrmoe plan` (csrc/planner/joint.h).

References are hand-computed: the same cases as tests/cpp/test_joint.cpp, rank time
t_r = forward rows + retained rows + kappa x replicas on r.
"""
import numpy as np
import pytest

from lrmoe.planner import plan as P

MEM = P.MemoryModel(expert_weight_bytes=1, expert_grad_bytes=2, expert_optimizer_bytes=4,
                    forward_row_bytes=1, backward_row_bytes=1, budget_bytes=1 << 30,
                    resident_bytes=0)


def rank_times(p, kappa):
    t = (p.forward_rows_W + p.backward_rows_W).numpy().astype(np.int64)
    off = p.instance_offsets.numpy()
    ranks = p.instance_rank.numpy()
    for e in range(len(off) - 1):
        for i in range(off[e] + 1, off[e + 1]):
            t[ranks[i]] += kappa
    return t


def test_cut_moves_to_the_cold_rank():
    # experts [8 | 4], c = 0.25: quotas [6, 3], t = [14, 7]; the cut moves one row: [13, 8]
    p = P.plan([[8, 0], [0, 4]], "lrmoe", MEM, 0.25, replica_slots=0, joint=True)
    assert p.quota_E.tolist() == [5, 4]
    assert rank_times(p, 0).tolist() == [13, 8]
    seq = P.plan([[8, 0], [0, 4]], "lrmoe", MEM, 0.25, replica_slots=0)
    assert seq.quota_E.tolist() == [6, 3]


@pytest.mark.parametrize("kappa,best", [(0, 12), (4, 14), (30, 24)])
def test_replica_against_its_cost(kappa, best):
    p = P.plan([[12, 0], [0, 0]], "lrmoe", MEM, replica_slots=1, balance_slack=None,
               joint=True, replica_cost_rows=kappa)
    assert rank_times(p, kappa).max() == best


@pytest.mark.parametrize("kw,msg", [({"replica_cost_rows": -1}, "replica_cost_rows"),
                                    ({"joint": 1}, "joint must be True or False"),
                                    ({"joint": True, "policy": "ultraep"}, "lrmoe only")])
def test_bad_input_names_the_argument(kw, msg):
    policy = kw.pop("policy", "lrmoe")
    with pytest.raises(ValueError, match=msg):
        P.plan([[4, 0], [0, 4]], policy, MEM, **kw)
