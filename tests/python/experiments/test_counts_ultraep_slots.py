"""experiments/counts_ultraep_slots.py: the owners bound and the strided layout.

References: the exact optimum of the owners model (csrc/planner/exact.h, its own search)
on tiny instances, which the bound must never exceed and which a hand case reaches; the
strided permutation written out by hand.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "experiments"))
import counts_ultraep_slots as C  # noqa: E402

from lrmoe.planner.plan import exact_optimum  # noqa: E402


def test_strided_permutation_by_hand():
    # E = 8, E_rec = 4, 2 children each: contiguous ids 2e, 2e + 1 -> strided e, e + 4
    np.testing.assert_array_equal(C.strided(8, 4), [0, 2, 4, 6, 1, 3, 5, 7])


def test_owners_bound_by_hand_and_below_the_exact_optimum():
    # W 2, E 4, R 1: rank 0 owns experts 0, 1 (100 + 100), rank 1 owns 2, 3 (10 + 10);
    # rank 1 can take at most one replica of 100: cap = (200, 120), total 220 -> T = 110
    n = np.array([100, 100, 10, 10])
    assert abs(C.owners_bound(n, 2, 1) - 110) < 1e-6
    load = np.array([[50, 50, 5, 5], [50, 50, 5, 5]])
    assert exact_optimum(load, None, 1, "owners").optimum == 110  # reached here
    # R 0: no replica, the bound is the fixed owners' max rank load
    assert abs(C.owners_bound(n, 2, 0) - 200) < 1e-6
    rng = np.random.default_rng(0)
    for _ in range(40):
        W, E, R = 4, 8, int(rng.integers(1, 3))
        load = rng.multinomial(64, rng.dirichlet(np.full(E, 0.3)), size=W)
        opt = exact_optimum(load, None, R, "owners")
        assert opt.proven
        assert C.owners_bound(load.sum(0), W, R) <= opt.optimum + 1e-6
