"""Topology-aware placement through lrmoe.planner and `lrmoe plan --gpus-per-node`
(PlanInput.gpus_per_node; docs/planner.md, "Topology").

References are hand-computed: the cases of tests/cpp/test_topology.cpp. W = 4 ranks with
one expert each, all of an expert's rows from its owner's source, nodes {0, 1}, {2, 3}.
"""
import json

import numpy as np
import pytest

from lrmoe import cli
from lrmoe.planner import plan as P

MEM = P.MemoryModel(expert_weight_bytes=1, expert_grad_bytes=0, expert_optimizer_bytes=0,
                    forward_row_bytes=1, backward_row_bytes=1, budget_bytes=1 << 30,
                    resident_bytes=0)


def diag(n_E):
    return np.diag(n_E).astype(np.int64)


def instances(p, e):
    off, ranks = p.instance_offsets.tolist(), p.instance_rank.tolist()
    f = p.forward_IW.sum(dim=1).tolist()
    return [(ranks[i], f[i]) for i in range(off[e], off[e + 1])]


def test_lrmoe_replica_stays_in_the_node():
    # capacity 6, n = [10, 2, 6, 0]: rank 0 sheds 4 rows; flat to rank 3 (most room),
    # by node to rank 1 (room 4, the owner's node)
    kw = dict(replica_slots=1, backward_row_capacity=6, balance_slack=None)
    flat = P.plan(diag([10, 2, 6, 0]), "lrmoe", MEM, **kw)
    node = P.plan(diag([10, 2, 6, 0]), "lrmoe", MEM, gpus_per_node=2, **kw)
    assert instances(flat, 0) == [(0, 6), (3, 4)]
    assert instances(node, 0) == [(0, 6), (1, 4)]


def test_one_node_is_the_flat_plan():
    rng = np.random.default_rng(0)
    load = rng.integers(0, 40, size=(8, 16)) * rng.integers(1, 4, size=16)
    for policy in P.POLICIES:
        a = P.plan(load, policy, MEM, 0.3 if policy == "lrmoe" else 0.0)
        b = P.plan(load, policy, MEM, 0.3 if policy == "lrmoe" else 0.0, gpus_per_node=8)
        for field in ("instance_rank", "forward_IW", "retained_IW", "quota_E"):
            assert getattr(a, field).tolist() == getattr(b, field).tolist(), (policy, field)


@pytest.mark.parametrize("bad", [0, -1, 5, 2.0, True])
def test_bad_gpus_per_node_names_the_argument(bad):
    with pytest.raises(ValueError, match="gpus_per_node"):
        P.plan(diag([1, 1, 1, 1]), "lrmoe", MEM, gpus_per_node=bad)


def test_cli_gpus_per_node(capsys):
    args = ["plan", "--ep", "4", "--tokens-per-rank", "512", "--policy", "ultraep", "--json"]
    assert cli.main(args + ["--gpus-per-node", "2"]) == 0
    node = json.loads(capsys.readouterr().out)
    assert cli.main(args) == 0
    flat = json.loads(capsys.readouterr().out)
    assert node and flat
    assert cli.main(args + ["--gpus-per-node", "-1"]) == cli.EXIT_USAGE
    assert "gpus_per_node" in capsys.readouterr().err


def test_hysteresis_keeps_or_replans():
    # the hand case of tests/cpp/test_hysteresis.cpp: n = [6, 2], target 4; fresh T = 8,
    # the previous placement (no replica) kept T = 12
    mem = P.MemoryModel(expert_weight_bytes=7, expert_grad_bytes=0, expert_optimizer_bytes=0,
                        forward_row_bytes=1, backward_row_bytes=1, budget_bytes=1 << 30,
                        resident_bytes=0)
    load = [[6, 0], [0, 2]]
    prev = P.plan([[3, 0], [0, 5]], "lrmoe", mem, replica_slots=1, balance_slack=None)
    assert prev.replicas == 0
    kept = P.plan(load, "lrmoe", mem, replica_slots=1, previous_plan=prev, replan_threshold=0.5)
    assert kept.kept_previous and kept.replicas == 0 and kept.moved_bytes == 0
    fresh = P.plan(load, "lrmoe", mem, replica_slots=1, previous_plan=prev, replan_threshold=0.3)
    assert not fresh.kept_previous
    assert (fresh.forward_rows_W + fresh.backward_rows_W).max().item() == 8
    assert fresh.moved_replicas == 1 and fresh.moved_bytes == 7
    with pytest.raises(ValueError, match="replan_threshold"):
        P.plan(load, "lrmoe", mem, previous_plan=prev, replan_threshold=1.0)
    with pytest.raises(ValueError, match="previous_plan must be a Plan of policy"):
        P.plan(load, "ultraep", mem, previous_plan=prev)
