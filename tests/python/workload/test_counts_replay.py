"""Counts replay (issue 30): popularity from recorded per-(step, layer, expert) counts.

References: the npz's normalised counts computed here with numpy; the multinomial's sd
for the draws; SYMI against SYMI planned from each step's own loads on hand-made counts.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from lrmoe.workload.loads import cluster_loads, counts_popularity

ROOT = Path(__file__).resolve().parents[3]
NPZ = ROOT / "experiments" / "results" / "drift" / "gcide-tiny-e32-counts.npz"


def test_replayed_popularity_is_the_files_normalised_counts():
    c = np.load(NPZ)["count_SLE"].astype(np.float64)
    ref = c / c.sum(axis=2, keepdims=True)
    p = counts_popularity(str(NPZ), 32, 5, 6, start=600)
    for s in range(5):
        for l in range(6):
            np.testing.assert_allclose(p[s, l], ref[600 + s, l % 4], rtol=0, atol=1e-15)
    p4 = counts_popularity(str(NPZ), 128, 2, 4, start=10)  # split: 4 children, p / 4 each
    np.testing.assert_allclose(p4[1, 2, 8:12], ref[11, 2, 2] / 4, rtol=1e-12)
    np.testing.assert_allclose(p4.sum(axis=2), 1.0, rtol=1e-12)


def test_draws_converge_to_the_popularity():
    c = np.load(NPZ)["count_SLE"]
    W, T, K = 4, 50_000, 4
    load = cluster_loads(W, 32, T, K, 2, 1, counts=str(NPZ), counts_start=700, seed=3)
    ref = c[701, 0] / c[701, 0].sum()
    n = W * T * K
    freq = load[1, 0].sum(axis=0) / n
    sd = np.sqrt(ref * (1 - ref) / n)
    assert (np.abs(freq - ref) < 5 * sd + 1e-12).all()
    other = cluster_loads(W, 32, T, K, 2, 1, counts=str(NPZ), counts_start=700, seed=3, group=1)
    assert not np.array_equal(load, other)  # DP groups: same popularity, other draws


def test_bad_inputs_name_the_flag(tmp_path):
    from lrmoe import cli
    from lrmoe.sim.report import run_sim
    bad = tmp_path / "bad.npz"
    np.savez(bad, other=np.zeros(3))
    cases = [(["--counts", str(bad)], "--counts"),
             (["--counts", str(NPZ), "--counts-start", "1190"], "--counts"),
             (["--counts", str(NPZ), "--drift", "fitted"], "--counts"),
             (["--counts", str(NPZ), "--model", "qwen3-30b-a3b", "--counts-start", "-1"],
              "--counts")]
    for extra, flag in cases:
        args = cli.build_parser().parse_args(
            ["sim", "--costs", str(ROOT / "configs/costs/h200.json"), "--steps", "32",
             "--out", str(tmp_path / "o"), *extra])
        with pytest.raises(ValueError, match=flag):
            run_sim(args)
    with pytest.raises(ValueError, match="multiple"):
        counts_popularity(np.ones((3, 2, 32), dtype=np.int64), 48, 2, 2)
    with pytest.raises(ValueError, match="shape"):
        counts_popularity(np.ones((3, 32), dtype=np.int64), 32, 2, 2)
    with pytest.raises(ValueError, match="counts"):
        cluster_loads(2, 32, 8, 4, 2, 1, counts=np.ones((3, 2, 32), dtype=np.int64),
                      drift=(0.9, 0.1))


def test_symis_lag_pays_for_a_jump_and_not_for_constant_counts():
    from lrmoe.planner.plan import MemoryModel
    from lrmoe.sim import simulate as S
    from lrmoe.sim.costs import PER_ROW, Costs
    from lrmoe.sim.links import Links
    g = np.array([[1, 1024, 1.0, 2.0], [16, 1024, 16.0, 32.0]], dtype=np.float64)
    costs = Costs("toy", {}, g, {k: 1e-6 for k in PER_ROW}, 10.0, {"device": "toy"})
    mem = MemoryModel(expert_weight_bytes=1, expert_grad_bytes=1, expert_optimizer_bytes=1,
                      optimizer_on_device=False, forward_row_bytes=1, backward_row_bytes=1,
                      budget_bytes=1 << 40, resident_bytes=0)
    # as test_popularity_drift's hand case: W 2, E 4, 3 SYMI slots a rank; counts whose
    # popularity jumps from expert 0 to expert 3 at step k = 1
    kw = dict(memory=mem, costs=costs, links=Links.from_file(), hidden=64, symi_slots=3,
              threads=1)
    jump = np.zeros((2, 1, 4), dtype=np.int64)
    jump[0, 0, 0] = jump[1, 0, 3] = 1000
    const = np.zeros((2, 1, 4), dtype=np.int64)
    const[:, 0, 0] = 1000

    def imbalance(c):
        load = cluster_loads(2, 4, 250, 2, 2, 1, counts=c, seed=1)
        lag = S.simulate(load, "symi", **kw)["fwd_imbalance"]
        own = [float(S.simulate(load[s:s + 1], "symi", **kw)["fwd_imbalance"][0])
               for s in range(2)]
        return lag, np.array(own)

    lag, own = imbalance(jump)
    assert lag[1] > own[1] * 1.5
    lag, own = imbalance(const)
    np.testing.assert_allclose(lag, own)
