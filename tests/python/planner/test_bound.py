"""The lower bound reported with every plan and the exact optimum (csrc/planner/bound.h,
exact.h, through lrmoe.planner.plan), against an independent pure-Python brute force
on tiny instances, and ``lrmoe plan --exact`` end to end.

Reference: :func:`brute_force` below enumerates, with itertools, every integer split of
every expert's rows over the ranks (a rank with rows of an expert holds an instance of
it), keeps the splits whose slots fit, and takes the smallest max rows per rank.
"""
from __future__ import annotations

import itertools
import json
from typing import List, Optional

import numpy as np
import pytest

from lrmoe import cli
from lrmoe.planner import plan as P


def compositions(total: int, parts: int):
    """Every tuple of `parts` non-negative ints summing to `total`."""
    for cuts in itertools.combinations(range(total + parts - 1), parts - 1):
        bounds = (-1,) + cuts + (total + parts - 1,)
        yield tuple(bounds[i + 1] - bounds[i] - 1 for i in range(parts))


def brute_force(d: List[int], W: int, slots: int, model: str) -> Optional[int]:
    """Smallest max rows per rank. owners: expert e on rank e // (E // W), a non-owner rank
    with rows of e holds a replica, at most `slots` per rank. free: a rank with rows of e
    holds an instance, at most `slots` per rank, and every expert without rows needs a
    free slot somewhere."""
    E = len(d)
    best = None
    for split in itertools.product(*(list(compositions(n, W)) for n in d)):
        count = [0] * W
        idle = 0
        for e, part in enumerate(split):
            owner = e // (E // W) if model == "owners" else -1
            for r, v in enumerate(part):
                if v > 0 and r != owner:
                    count[r] += 1
            if model == "free" and not any(part):
                idle += 1
        if any(c > slots for c in count) or idle > sum(slots - c for c in count):
            continue
        top = max(sum(part[r] for part in split) for r in range(W))
        best = top if best is None else min(best, top)
    return best


def bound_reference(d: List[int], W: int, spare: int) -> int:
    """The counting bound by its definition (bound.h): the smallest T that passes (a)-(c)."""
    if sum(d) == 0:
        return 0
    T = 1
    while not (W * T >= sum(d) and all(n <= W * T for n in d)
               and sum(max(0, -(-n // T) - 1) for n in d) <= spare):
        T += 1
    return T


def tiny(rng: np.random.Generator, model: str):
    W = int(rng.integers(2, 4))
    E = W * int(rng.integers(1, 3)) if model == "owners" else int(rng.integers(2, 5))
    d = [int(v) for v in rng.integers(0, 5, size=E)]
    per = -(-E // W)
    slots = int(rng.integers(0, 3)) if model == "owners" else min(E, per + int(rng.integers(0, 3)))
    return W, E, d, slots


@pytest.mark.parametrize("model", P.PLACEMENT_MODELS)
def test_exact_optimum_equals_brute_force(model):
    rng = np.random.default_rng(7)
    for _ in range(40):
        W, E, d, slots = tiny(rng, model)
        load = np.zeros((W, E), dtype=np.int64)
        load[0] = d  # the optimum depends on the demand only, not on its sources
        kw = dict(symi_slots=slots, replica_slots=max(0, slots - (-(-E // W)))) \
            if model == "free" else dict(replica_slots=slots)
        x = P.exact_optimum(load, None, model=model, **kw)
        assert x.proven and x.feasible
        assert x.optimum == brute_force(d, W, slots, model), (W, E, d, slots)
        spare = slots * W if model == "owners" else slots * W - E
        assert x.lower_bound == bound_reference(d, W, spare) <= x.optimum
        # the split returned is one: every expert's rows, on ranks holding it, at the optimum
        assert (x.rows_EW.sum(axis=1) == d).all()
        assert not (x.rows_EW[~x.holds_EW] > 0).any()
        assert x.rows_EW.sum(axis=0).max(initial=0) == x.optimum


def test_plan_bounds_against_brute_force():
    """Every policy's plan carries the bound; it is at most its max rows and at most the
    brute-force optimum of the model holding its placements."""
    rng = np.random.default_rng(3)
    memory = P.MemoryModel(1, 2, 4, 1, 1, 1 << 40, 0)
    for _ in range(25):
        W = int(rng.integers(2, 4))
        E = W * int(rng.integers(1, 3))
        load = rng.integers(0, 3, size=(W, E))
        d = [int(v) for v in load.sum(axis=0)]
        opt = {"owners": brute_force(d, W, 1, "owners"),
               "free": brute_force(d, W, E // W + 1, "free")}
        for policy in P.POLICIES:
            p = P.plan(load, policy, memory, recalibration_rate=0.3, replica_slots=1)
            assert p.forward_bound == bound_reference(d, W, W)  # X = R W = S W - E here
            assert p.forward_bound <= min(opt.values())
            assert p.max_forward_rows() >= opt["free" if policy == "symi" else "owners"]
            assert p.backward_bound <= p.max_backward_rows()
            if policy == "lrmoe":
                q = [int(v) for v in p.quota_E]
                assert p.backward_bound == bound_reference(q, W, W)
                assert p.max_backward_rows() >= brute_force(q, W, 1, "owners")
            else:
                assert p.backward_bound == p.forward_bound


def test_hand_computed_hot_expert():
    """W = 4, E = 4, expert 0 with 100 rows, one free slot per rank: bound ceil(100 / 4) =
    25 (3 spare instances needed at 25 <= 4), optimum 25 (replicas on ranks 1-3); fixed
    ownership computes all 100 on rank 0; ultraep keeps >= 1 row on the owner but reaches 25."""
    load = np.zeros((4, 4), dtype=np.int64)
    load[:, 0] = 25
    x = P.exact_optimum(load, None, replica_slots=1)
    assert (x.optimum, x.lower_bound) == (25, 25)
    memory = P.MemoryModel(1, 2, 4, 1, 1, 1 << 40, 0)
    fixed = P.plan(load, "fixed", memory, replica_slots=1)
    assert (fixed.forward_bound, fixed.max_forward_rows()) == (25, 100)
    assert P.plan(load, "ultraep", memory, replica_slots=1).max_forward_rows() == 25


def test_exact_refuses_large_instances():
    with pytest.raises(ValueError, match="num_experts"):
        P.exact_optimum(np.ones((8, 32), dtype=np.int64))
    with pytest.raises(ValueError, match="model"):
        P.exact_optimum(np.ones((2, 2), dtype=np.int64), model="nope")


def test_plan_cli_exact(capsys):
    assert cli.main(["plan", "--ep", "4", "--experts", "8", "--tokens-per-rank", "256",
                     "--exact", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for r in out["plans"]:
        assert r["forward_bound"] <= r["exact"]["forward_optimum"] <= r["max_forward_rows"]
        assert r["exact"]["forward_gap"] >= 0
    assert cli.main(["plan", "--ep", "4", "--experts", "8", "--tokens-per-rank", "256",
                     "--exact"]) == 0
    assert "gap" in capsys.readouterr().out
