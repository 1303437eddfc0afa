"""Drifting Zipf loads (lrmoe.workload.loads.drifting_loads): seeded, row sums exact, the
ranking moves by at most 2 x swaps positions a step (counted here position by position),
and under drift SYMI's one-step lag costs rows that planning from the step's own loads
does not (the planner's max forward rows per rank, csrc/planner through
lrmoe.planner.plan)."""
from __future__ import annotations

import numpy as np
import pytest

from lrmoe.planner.plan import MemoryModel, plan
from lrmoe.workload.loads import drifting_loads


def test_drift_is_seeded_and_sums_exactly():
    a, ra = drifting_loads(4, 16, 1000, 5, max_over_mean=3.0, swaps_per_step=2, seed=3)
    b, rb = drifting_loads(4, 16, 1000, 5, max_over_mean=3.0, swaps_per_step=2, seed=3)
    c, _ = drifting_loads(4, 16, 1000, 5, max_over_mean=3.0, swaps_per_step=2, seed=4)
    assert a.shape == (5, 4, 16) and a.dtype == np.int64
    assert np.array_equal(a, b) and np.array_equal(ra, rb) and not np.array_equal(a, c)
    assert (a.sum(axis=2) == 1000).all()
    for s in range(5):  # every step's ranking is a permutation of the experts
        assert sorted(ra[s].tolist()) == list(range(16))


def test_ranking_moves_at_most_two_positions_per_swap():
    _, r = drifting_loads(2, 32, 100, 200, max_over_mean=4.0, swaps_per_step=3, seed=1)
    moved = [(r[s] != r[s - 1]).sum() for s in range(1, 200)]
    assert max(moved) <= 6 and sum(moved) > 0
    assert len(set(r[:, 0].tolist())) > 1  # the hottest expert changes over 200 steps
    _, still = drifting_loads(2, 32, 100, 50, max_over_mean=4.0, swaps_per_step=0, seed=1)
    assert (still == still[0]).all()


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="swaps_per_step"):
        drifting_loads(2, 8, 10, 3, swaps_per_step=-1)
    with pytest.raises(ValueError, match="steps"):
        drifting_loads(2, 8, 10, 0)


def test_symis_lag_costs_rows_under_drift():
    # W 8, E 64, a steep skew (max/mean 8) moving fast (32 swaps a step): SYMI planned
    # from step s - 1's popularity against SYMI planned from step s's own (no lag); with
    # drift the lagged plan's hot rank is heavier on average, without it about equal
    W, E, S = 8, 64, 12
    mem = MemoryModel(expert_weight_bytes=1, expert_grad_bytes=1, expert_optimizer_bytes=1,
                      optimizer_on_device=False, forward_row_bytes=1, backward_row_bytes=1,
                      budget_bytes=1 << 40, resident_bytes=0)

    def lag_gap(swaps):
        load, _ = drifting_loads(W, E, 20000, S, max_over_mean=8.0, swaps_per_step=swaps, seed=5)
        gap = []
        for s in range(1, S):
            own = plan(load[s], "symi", mem, previous_load_E=load[s].sum(axis=0))
            lag = plan(load[s], "symi", mem, previous_load_E=load[s - 1].sum(axis=0))
            gap.append(lag.max_forward_rows() / own.max_forward_rows())
        return float(np.mean(gap))

    drift, still = lag_gap(32), lag_gap(0)
    assert drift > 1.05
    assert drift > still
