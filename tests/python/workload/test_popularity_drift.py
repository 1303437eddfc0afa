"""Popularity drift (issue 30): the trace statistics of lrmoe.workload.drift against hand
values and an AR(1) process generated here, the drifting generator of
lrmoe.workload.loads (off = the old loads bit for bit, step 0 = the fixed popularity,
its step-to-step change and stationary spread against the AR(1) formulas), the
``--drift`` flag, and that the simulator hands SYMI the previous step's loads (a
placement planned for the wrong expert, counted by hand)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from lrmoe.workload import drift as D
from lrmoe.workload.loads import cluster_loads, drift_popularity, synthetic_loads
from lrmoe.workload.trace import RoutingTrace


# ----------------------------------------------------------------- trace statistics
def test_tv_distance_by_hand():
    # p_0 = (.5, .5, 0, 0), p_1 = (0, .5, .5, 0), p_2 = (0, 0, 0, 1): TV(0,1) = 0.5,
    # TV(1,2) = 1 (disjoint), TV(0,2) = 1
    c = np.array([[[2, 2, 0, 0]], [[0, 4, 4, 0]], [[0, 0, 0, 3]]])
    assert D.tv_distance(c, 1)[:, 0].tolist() == [0.5, 1.0]
    assert D.tv_distance(c, 2)[:, 0].tolist() == [1.0]
    with pytest.raises(ValueError, match="lag"):
        D.tv_distance(c, 3)
    with pytest.raises(ValueError, match="no routed pairs"):
        D.tv_distance(np.zeros((2, 1, 4)), 1)


def test_lag_correlation_same_and_reversed_ranking():
    # a geometric popularity and its reversal: centred logs are negatives of each other
    # (up to the 0.5 pseudo-count, 1e-4 here), so the correlation is -1; unchanged: +1
    up = [1000, 2000, 4000]
    c = np.array([[up], [up], [up[::-1]]])
    r = D.lag_correlation(c, 1)[:, 0]
    assert r[0] == pytest.approx(1.0, abs=1e-12)
    assert r[1] == pytest.approx(-1.0, abs=1e-4)


def test_sampling_tv_matches_the_binomial_formula():
    # E = 2 at p = 1/2: TV = |a - b| / n with a, b ~ Bin(n, 1/2); a - b ~ N(0, n / 2), so
    # E TV = sqrt(n / 2) sqrt(2 / pi) / n = 1 / sqrt(pi n)
    n = 10_000
    c = np.array([[[n // 2, n // 2]]])
    got = D.sampling_tv(c, draws=4000, seed=1)[0, 0]
    assert got == pytest.approx(1 / math.sqrt(math.pi * n), rel=0.05)


def _ar1_counts(phi, sigma, steps, layers, experts, pairs, seed):
    """Counts of a log-popularity AR(1) about a fixed spread mu, written from the model's
    definition (not from lrmoe): x_{t+1} - mu = phi (x_t - mu) + sigma eps, started
    stationary, p = softmax(x), multinomial draws of ``pairs``."""
    rng = np.random.default_rng(seed)
    mu = rng.normal(0, 0.3, size=(layers, experts))
    x = mu + rng.normal(0, sigma / math.sqrt(1 - phi * phi), size=(layers, experts))
    out = np.empty((steps, layers, experts), dtype=np.int64)
    for t in range(steps):
        if t:
            x = mu + phi * (x - mu) + sigma * rng.standard_normal((layers, experts))
        p = np.exp(x) / np.exp(x).sum(axis=1, keepdims=True)
        for l in range(layers):
            out[t, l] = rng.multinomial(pairs, p[l])
    return out


def test_fit_ar1_recovers_phi_sigma_and_the_sampling_noise():
    c = _ar1_counts(phi=0.9, sigma=0.2, steps=600, layers=2, experts=32, pairs=8192, seed=3)
    f = D.fit_ar1(c, max_lag=8, min_count=32)
    assert f["phi"] == pytest.approx(0.9, abs=0.04)
    assert f["jitter"] < 0.06  # no non-persistent part beyond the draw in this process
    assert f["sigma"] == pytest.approx(0.2, rel=0.15)
    # the noise left at lag 0 is the multinomial's, ~ 1 / count (delta method)
    assert f["noise_var"] == pytest.approx(f["noise_var_predicted"], rel=0.3)
    # no drift at all (independent draws of one popularity): the persistent part v is
    # < 10 % of the sampling noise (the fit does not mistake noise for drift), where the
    # drifting series' v = sigma^2 / (1 - phi^2) = 0.21 is ~20x its noise
    for s in range(3):
        flat = np.random.default_rng(s).multinomial(8192, np.full(16, 1 / 16), size=(200, 1))
        try:
            g = D.fit_ar1(flat, max_lag=8)
        except ValueError as err:  # fewer than 2 positive autocovariances: also right
            assert "persist" in str(err)
            continue
        assert g["v"] < 0.1 * g["noise_var_predicted"]
    assert f["v"] > 10 * f["noise_var_predicted"]
    with pytest.raises(ValueError, match="persist"):  # alternating: every gamma_d, d odd, < 0
        alt = np.array([[[900, 100]], [[100, 900]]] * 10)
        D.fit_ar1(alt, max_lag=2, min_count=1)
    with pytest.raises(ValueError, match="min_count"):
        D.fit_ar1(c[:20], max_lag=8, min_count=1e9)
    with pytest.raises(ValueError, match="max_lag"):
        D.fit_ar1(c[:5], max_lag=8)


def test_trace_counts_from_a_recorded_trace(tmp_path):
    import torch
    tr = RoutingTrace(num_experts=4, top_k=2, every=1)
    for step, ids in enumerate(([[0, 1], [0, 2]], [[3, 1], [3, 1]])):
        tr.step = step
        for layer in (0, 1):
            tr.record(layer, torch.tensor(ids) if layer == 0 else torch.flip(torch.tensor(ids), [1]))
    path = tr.save(tmp_path / "t.npz")
    steps, layers, c = D.trace_counts(path)
    assert steps.tolist() == [0, 1] and layers.tolist() == [0, 1]
    assert c[0, 0].tolist() == [2, 1, 1, 0] and c[1, 0].tolist() == [0, 2, 0, 2]
    assert (c[:, 1] == c[:, 0]).all()  # same ids, other column order


# ------------------------------------------------------------------- the generator
def test_drift_off_is_the_old_loads_bit_for_bit():
    # the loop cluster_loads ran before drift existed, spelled out with synthetic_loads
    W, E, T, K, S, L, seed = 4, 16, 64, 2, 3, 2, 7
    ref = np.stack([np.stack([synthetic_loads(W, E, T * K, 2.0, seed=seed + 7919 * s + l,
                                              popularity_seed=seed + 104729 * (l + 1))
                              for l in range(L)]) for s in range(S)])
    for drift in (None, (0.9, 0.0), (1.0, 0.0), (0.9, 0.0, 0.0)):
        assert np.array_equal(cluster_loads(W, E, T, K, S, L, 2.0, seed=seed, drift=drift), ref)
    # with drift, step 0 is still the fixed popularity's draw; later steps move
    d = cluster_loads(W, E, T, K, S, L, 2.0, seed=seed, drift=(0.9, 0.5))
    assert np.array_equal(d[0], ref[0]) and not np.array_equal(d[1:], ref[1:])


def test_drift_popularity_follows_the_ar1_formulas():
    # z_1 = sigma eps: the centred log-ratio of steps 1 and 0 has std sigma over experts;
    # after many steps z is stationary with variance sigma^2 / (1 - phi^2)
    E, phi, sigma = 4000, 0.9, 0.3
    p = drift_popularity(E, 101, 3.0, phi, sigma, popularity_seed=11)
    assert np.allclose(p.sum(axis=1), 1.0)
    step = np.log(p[1] / p[0])
    assert (step - step.mean()).std() == pytest.approx(sigma, rel=0.05)
    far = np.log(p[100] / p[0])
    assert (far - far.mean()).var() == pytest.approx(sigma ** 2 / (1 - phi ** 2), rel=0.1)
    # phi = 1, sigma 0.1: a random walk, variance 100 x 0.01 = 1 after 100 steps
    rw = drift_popularity(E, 101, 3.0, 1.0, 0.1, popularity_seed=11)
    far = np.log(rw[100] / rw[0])
    assert (far - far.mean()).var() == pytest.approx(1.0, rel=0.1)
    with pytest.raises(ValueError, match="phi"):
        drift_popularity(8, 2, 2.0, 1.5, 0.1, 0)
    with pytest.raises(ValueError, match="sigma"):
        drift_popularity(8, 2, 2.0, 0.5, -0.1, 0)
    with pytest.raises(ValueError, match="jitter"):
        drift_popularity(8, 2, 2.0, 0.5, 0.1, 0, jitter=-1)
    # jitter alone (sigma 0): every step's log-popularity is the Zipf's plus independent
    # N(0, jitter^2): the centred log-ratio of two steps has variance 2 jitter^2
    j = drift_popularity(E, 3, 3.0, 0.9, 0.0, popularity_seed=11, jitter=0.2)
    r = np.log(j[2] / j[1])
    assert (r - r.mean()).var() == pytest.approx(2 * 0.04, rel=0.1)


def test_groups_share_the_drift_not_the_draws():
    W, E, T, K, S = 2, 16, 20_000, 2, 12
    a = cluster_loads(W, E, T, K, S, 1, 3.0, seed=1, group=0, drift=(0.95, 0.4))
    b = cluster_loads(W, E, T, K, S, 1, 3.0, seed=1, group=1, drift=(0.95, 0.4))
    pa, pb = a.sum(axis=2)[:, 0], b.sum(axis=2)[:, 0]
    pa, pb = pa / pa.sum(1, keepdims=True), pb / pb.sum(1, keepdims=True)
    assert not np.array_equal(a, b)
    assert 0.5 * np.abs(pa[-1] - pb[-1]).sum() < 0.02  # same popularity, other draws
    assert 0.5 * np.abs(pa[-1] - pa[0]).sum() > 0.1  # but it moved over the steps
    with pytest.raises(ValueError, match="drift"):
        cluster_loads(W, E, 8, K, 2, 1, 2.0, trace="x.npz", drift=(0.9, 0.1))


# ----------------------------------------------------------------------- the flag
def test_parse_drift_forms_and_errors(tmp_path):
    from lrmoe.sim.report import FITTED_DRIFT, parse_drift
    assert parse_drift("off") is None
    assert parse_drift("0.9,0.25") == (0.9, 0.25)
    fit = json.loads(FITTED_DRIFT.read_text())["fit"]
    assert parse_drift("0.9,0.25,0.1") == (0.9, 0.25, 0.1)
    assert parse_drift("fitted") == (fit["phi"], fit["sigma"], fit["jitter"])
    assert 0 < fit["phi"] <= 1 and fit["sigma"] > 0 and fit["jitter"] >= 0
    for bad in ("0.9", "a,b", "1.5,0.1", "0.5,-1", "0.1,0.2,-0.3", "0.1,0.2,0.3,0.4"):
        with pytest.raises(ValueError, match="--drift"):
            parse_drift(bad)


def test_sim_cli_drift_needs_synthetic_loads(tmp_path):
    from lrmoe import cli
    from lrmoe.sim.report import run_sim
    t = tmp_path / "t.npz"
    t.write_bytes(b"")
    args = cli.build_parser().parse_args(
        ["sim", "--costs", "configs/costs/h200.json", "--trace", str(t), "--drift", "fitted",
         "--out", str(tmp_path / "o")])
    with pytest.raises(ValueError, match="--drift"):
        run_sim(args)


# ---------------------------------------------------- the lag reaches SYMI's planner
def test_simulator_hands_symi_the_previous_steps_loads():
    # W 2, E 4, 3 SYMI slots a rank (6 instances: one per expert and 2 spare): step 0
    # routes everything to expert 0, step 1 everything to expert 3. Planning step 1 from
    # step 0, SYMI spends a spare on expert 0 (it cannot hold more than W = 2 instances)
    # and the other not on expert 3, whose popularity was 0; so its 1000 rows all land on
    # one rank, max / mean = 1000 / 500 = 2. Step 1 alone (no previous step) gives expert
    # 3 both ranks: 500 / 500, 1.
    from lrmoe.planner.plan import MemoryModel
    from lrmoe.sim import simulate as S
    from lrmoe.sim.costs import PER_ROW, Costs
    from lrmoe.sim.links import Links
    # hand-set round costs (1 ms per 1k rows), a budget that never binds
    g = np.array([[1, 1024, 1.0, 2.0], [16, 1024, 16.0, 32.0]], dtype=np.float64)
    costs = Costs("toy", {}, g, {k: 1e-6 for k in PER_ROW}, 10.0, {"device": "toy"})
    mem = MemoryModel(expert_weight_bytes=1, expert_grad_bytes=1, expert_optimizer_bytes=1,
                      optimizer_on_device=False, forward_row_bytes=1, backward_row_bytes=1,
                      budget_bytes=1 << 40, resident_bytes=0)
    load = np.zeros((2, 1, 2, 4), dtype=np.int64)
    load[0, 0, :, 0] = 500
    load[1, 0, :, 3] = 500
    kw = dict(memory=mem, costs=costs, links=Links.from_file(), hidden=64,
              symi_slots=3, threads=1)
    lagged = S.simulate(load, "symi", **kw)
    alone = S.simulate(load[1:], "symi", **kw)
    assert lagged["fwd_imbalance"].tolist() == [1.0, 2.0]
    assert alone["fwd_imbalance"].tolist() == [1.0]
    # a policy planning from the step's own loads is the same with or without step 0
    assert S.simulate(load, "ultraep", **kw)["fwd_imbalance"][1] == \
        S.simulate(load[1:], "ultraep", **kw)["fwd_imbalance"][0]
