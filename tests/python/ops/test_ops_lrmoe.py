"""CPU tests of the selection-side ops: score, quota, select, grouped_mm.

Every op is compared with an independent reference: float64 PyTorch, brute-force
Python over the definition (sorting, exact fractions), a pure-Python splitmix64,
or hand-computed values. Routing (row_pair, offsets) is built in plain torch with
a stable argsort of expert ids, never with lrmoe.ops.permute.
"""
from __future__ import annotations

import math
import random
from fractions import Fraction

import pytest
import torch

from lrmoe import ops

from _refs import I32, grouped_mm_k_ref, grouped_mm_rows_ref, routing
from conftest import ref_uniform01


# --------------------------------------------------------------------------- helpers
def random_routing(gen, T, K, E, empty=(), skew=False):
    """Random (T, K) expert ids (distinct per token when K <= usable experts)."""
    usable = [e for e in range(E) if e not in set(empty)]
    w = torch.ones(len(usable), dtype=torch.float64)
    if skew:
        w = torch.rand(len(usable), generator=gen, dtype=torch.float64) ** 4 + 1e-3
    idx = torch.stack([torch.multinomial(w, K, replacement=False, generator=gen) for _ in range(T)])
    return torch.tensor(usable)[idx]


# --------------------------------------------------------------------------- score
def score_reference(grad_out, weights, phi_sq, row_pair, metric):
    g = grad_out.double()
    K = weights.shape[1]
    pair = row_pair.long()
    t = pair // K
    if metric == "grad_abs":
        return g.abs().sum(1)[t]
    gsq = (g * g).sum(1)[t]
    if metric == "grad_sq":
        return gsq
    alpha = weights.double().reshape(-1)[pair]
    return alpha * alpha * gsq * phi_sq.double()


@pytest.mark.parametrize("metric", ["lrm", "grad_sq", "grad_abs"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("T,K,H,E", [(37, 3, 67, 8), (1, 1, 5, 1), (16, 4, 128, 4), (9, 5, 33, 5)])
def test_score_matches_float64(metric, dtype, T, K, H, E):
    gen = torch.Generator().manual_seed(T * 1000 + K * 100 + H + len(metric) + dtype.itemsize)
    grad_out = torch.randn(T, H, generator=gen).to(dtype)
    weights = torch.rand(T, K, generator=gen).to(dtype)
    phi_sq = torch.rand(T * K, generator=gen) * 10
    row_pair, _, _ = routing(random_routing(gen, T, K, E), E)
    out = ops.score(grad_out, weights, phi_sq, row_pair, metric)
    ref = score_reference(grad_out, weights, phi_sq, row_pair, metric)
    assert out.dtype == torch.float32 and out.shape == (T * K,)
    torch.testing.assert_close(out.double(), ref, rtol=2e-5, atol=1e-30)


def test_score_non_contiguous_inputs():
    gen = torch.Generator().manual_seed(1)
    T, K, H, E = 37, 3, 40, 6
    grad_out = torch.randn(H, T, generator=gen).t()  # (T, H) view, stride (1, T)
    weights = torch.rand(K, T, generator=gen).t()
    phi_sq = torch.rand(2 * T * K, generator=gen)[::2]
    row_pair, _, _ = routing(random_routing(gen, T, K, E), E)
    assert not grad_out.is_contiguous() and not weights.is_contiguous()
    out = ops.score(grad_out, weights, phi_sq, row_pair, "lrm")
    ref = score_reference(grad_out, weights, phi_sq, row_pair, "lrm")
    torch.testing.assert_close(out.double(), ref, rtol=2e-5, atol=0)


def test_score_random_matches_python_splitmix_and_is_uniform():
    gen = torch.Generator().manual_seed(2)
    T, K, E, H = 4000, 4, 16, 3
    row_pair, _, _ = routing(random_routing(gen, T, K, E), E)
    grad_out = torch.randn(T, H, generator=gen)
    weights = torch.rand(T, K, generator=gen)
    phi_sq = torch.rand(T * K, generator=gen)
    seed = 12345
    out = ops.score(grad_out, weights, phi_sq, row_pair, "random", seed)
    # exact against a pure-Python splitmix64, keyed by pair id (not row)
    for r in range(0, T * K, 997):
        assert out[r].item() == ref_uniform01(seed, 1, int(row_pair[r]))
    # reproducible, seed-dependent, and a function of the pair id only
    assert torch.equal(out, ops.score(grad_out, weights, phi_sq, row_pair, "random", seed))
    other = ops.score(grad_out, weights, phi_sq, row_pair, "random", seed + 1)
    assert (other != out).float().mean() > 0.99
    ident = ops.score(grad_out, weights, phi_sq, torch.arange(T * K, dtype=I32), "random", seed)
    assert torch.equal(out, ident[row_pair.long()])
    # ~uniform on [0, 1): chi-square over 20 bins (19 dof; 99.99% quantile ~ 50)
    assert out.min() >= 0 and out.max() < 1
    counts = torch.histc(out, bins=20, min=0, max=1)
    expected = out.numel() / 20
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 50, chi2


def test_score_bad_inputs():
    T, K, H = 6, 2, 4
    g, w = torch.randn(T, H), torch.rand(T, K)
    phi = torch.rand(T * K)
    rp = torch.arange(T * K, dtype=I32)
    with pytest.raises(RuntimeError, match="metric"):
        ops.score(g, w, phi, rp, "lrn")
    with pytest.raises(RuntimeError, match="phi_sq"):
        ops.score(g, w, phi.double(), rp, "lrm")
    with pytest.raises(RuntimeError, match="row_pair"):
        ops.score(g, w, phi, rp.long(), "lrm")
    with pytest.raises(RuntimeError, match="row_pair"):
        ops.score(g, w, phi, rp[:-1], "lrm")
    with pytest.raises(RuntimeError, match="phi_sq"):
        ops.score(g, w, phi[:-1], rp, "lrm")
    with pytest.raises(RuntimeError, match="weights"):
        ops.score(g, w[:-1], phi, rp, "lrm")
    with pytest.raises(RuntimeError, match="grad_out"):
        ops.score(g.int(), w, phi, rp, "lrm")
    bad = rp.clone()
    bad[3] = T * K
    with pytest.raises(RuntimeError, match=r"row_pair\[3\]"):
        ops.score(g, w, phi, bad, "lrm")


@pytest.mark.parametrize("metric", ["lrm", "grad_sq", "grad_abs"])
def test_score_float8_grad_out_names_the_argument(metric):
    # float8 is floating point but not one of the dispatched dtypes: the message must
    # name grad_out and the fix, not surface as a dispatch error of an inner kernel.
    gen = torch.Generator().manual_seed(41)
    T, K, H = 5, 2, 8
    g8 = torch.randn(T, H, generator=gen).to(torch.float8_e4m3fn)
    w, phi = torch.rand(T, K, generator=gen), torch.rand(T * K, generator=gen)
    rp = torch.randperm(T * K, generator=gen).to(I32)
    with pytest.raises(RuntimeError, match="grad_out must be float32, bfloat16, float16 or float64"):
        ops.score(g8, w, phi, rp, metric)


# --------------------------------------------------------------------------- quota
def proportional_reference(n, c: Fraction):
    keep = 1 - c
    target = math.floor(keep * sum(n))
    base = [min(math.floor(keep * x), x) for x in n]
    rem = [keep * x - b for x, b in zip(n, base)]
    extra = target - sum(base)
    order = sorted((e for e in range(len(n)) if base[e] < n[e]), key=lambda e: (-rem[e], e))
    q = list(base)
    for e in order[:extra]:
        q[e] += 1
    return q


def water_level_reference(n, c: Fraction):
    target = math.floor((1 - c) * sum(n))
    filled = lambda L: sum(min(x, L) for x in n)  # non-decreasing in L
    lo, hi = 0, max(n, default=0)
    while lo < hi:  # largest level with filled(level) <= target
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if filled(mid) <= target else (lo, mid - 1)
    level = lo
    q = [min(x, level) for x in n]
    extra = target - sum(q)
    above = sorted((e for e in range(len(n)) if n[e] > level), key=lambda e: (-n[e], e))
    for e in above[:extra]:
        q[e] += 1
    return q


def test_quota_hand_computed():
    n = torch.tensor([4, 2, 3], dtype=I32)
    assert ops.quota(n, 1 / 3).tolist() == [3, 1, 2]
    # [10, 2, 2] at c = 0.5: target 7; level 3 fills 3 + 2 + 2 = 7 exactly
    assert ops.quota(torch.tensor([10, 2, 2], dtype=I32), 0.5, "water_level").tolist() == [3, 2, 2]
    # [5, 5, 1] at c = 0.25: target 8; level 3 fills 7, one more to the lower of the tied 5s
    assert ops.quota(torch.tensor([5, 5, 1], dtype=I32), 0.25, "water_level").tolist() == [4, 3, 1]
    # proportional on the same: 3.75, 3.75, 0.75 -> base 3, 3, 0 (6), +2 by remainder: 0.75 ties
    # go to the lower experts
    assert ops.quota(torch.tensor([5, 5, 1], dtype=I32), 0.25).tolist() == [4, 4, 0]
    # all load on one expert, an empty expert, c = 0 exact
    assert ops.quota(torch.tensor([0, 7, 0], dtype=I32), 0.3).tolist() == [0, 4, 0]
    assert ops.quota(torch.tensor([0, 7, 0], dtype=I32), 0.3, "water_level").tolist() == [0, 4, 0]
    assert ops.quota(torch.tensor([], dtype=I32), 0.3).tolist() == []


RATES = [Fraction(0), Fraction(1, 10), Fraction(1, 5), Fraction(1, 4), Fraction(3, 10), Fraction(1, 3),
         Fraction(1, 2), Fraction(9, 10), Fraction(99, 100)]


@pytest.mark.parametrize("rule", ["proportional", "water_level"])
def test_quota_vs_fraction_reference(rule):
    rng = random.Random(7 if rule == "proportional" else 8)
    ref = proportional_reference if rule == "proportional" else water_level_reference
    for trial in range(300):
        E = rng.choice([1, 2, 3, 8, 17, 64])
        n = [rng.choice([0, rng.randint(0, 50), rng.randint(0, 5000)]) for _ in range(E)]
        c = rng.choice(RATES + [Fraction(rng.randint(0, 999), 1000), Fraction(rng.randint(0, 96), 97)])
        q = ops.quota(torch.tensor(n, dtype=I32), float(c), rule).tolist()
        expect = ref(n, c)
        assert sum(q) == math.floor((1 - c) * sum(n)), (n, c, q)
        assert all(0 <= a <= b for a, b in zip(q, n)), (n, c, q)
        if c == 0:
            assert q == n
        if rule == "water_level":
            assert q == expect, (n, c, q, expect)
        else:
            # exact remainders can tie while their double images differ in the last bit,
            # so only instances whose rounded-up set is decided by distinct remainders
            # are compared element-wise; the rest must still round each expert by <= 1
            keep = 1 - c
            rems = [keep * x - math.floor(keep * x) for x in n]
            if len(set(r for r in rems if r > 0)) == sum(1 for r in rems if r > 0):
                assert q == expect, (n, c, q, expect)
            assert all(math.floor(keep * x) <= a <= math.floor(keep * x) + 1 for a, x in zip(q, n))


def test_quota_non_contiguous_and_bad_inputs():
    n = torch.tensor([4, 0, 2, 0, 3, 0], dtype=I32)[::2]
    assert ops.quota(n, 1 / 3).tolist() == [3, 1, 2]
    good = torch.tensor([4, 2, 3], dtype=I32)
    with pytest.raises(RuntimeError, match="recalibration_rate"):
        ops.quota(good, 1.0)
    with pytest.raises(RuntimeError, match="recalibration_rate"):
        ops.quota(good, -0.1)
    with pytest.raises(RuntimeError, match="recalibration_rate"):
        ops.quota(good, float("nan"))
    with pytest.raises(RuntimeError, match="rule"):
        ops.quota(good, 0.1, "waterlevel")
    with pytest.raises(RuntimeError, match="tokens_per_expert"):
        ops.quota(good.long(), 0.1)
    with pytest.raises(RuntimeError, match="tokens_per_expert"):
        ops.quota(good.view(1, 3), 0.1)
    with pytest.raises(RuntimeError, match="tokens_per_expert"):
        ops.quota(torch.tensor([3, -1], dtype=I32), 0.1)


# --------------------------------------------------------------------------- select
def expert_ranges(offsets):
    ends = offsets.tolist()
    starts = [0] + ends[:-1]
    return list(zip(starts, ends))


def topk_reference(score, offsets, quota):
    s = score.tolist()
    kept = []
    for (a, b), q in zip(expert_ranges(offsets), quota.tolist()):
        # NaN ranks last; -0 == +0; ties to the lower row
        key = lambda r: (math.isnan(s[r]), -s[r] if not math.isnan(s[r]) else 0.0, r)
        kept += sorted(sorted(range(a, b), key=key)[:q])
    return kept


def importance_probs_reference(score, offsets, quota):
    """p per row in float64 (water-filling / zero rule of the docstring)."""
    s = [max(x, 0.0) if not math.isnan(x) else 0.0 for x in score.double().tolist()]
    p = [0.0] * len(s)
    for (a, b), Q in zip(expert_ranges(offsets), quota.tolist()):
        rows = list(range(a, b))
        n = len(rows)
        if Q == 0 or n == 0:
            continue
        pos = [r for r in rows if s[r] > 0]
        if len(pos) <= Q:
            for r in rows:
                p[r] = 1.0 if s[r] > 0 else (Q - len(pos)) / (n - len(pos))
            continue
        order = sorted(rows, key=lambda r: (-s[r], r))
        w = [s[r] for r in order]
        tails = [math.fsum(w[m:]) for m in range(n)]
        m = next(m for m in range(Q) if w[m] * (Q - m) <= tails[m])
        lam = (Q - m) / tails[m]
        for j, r in enumerate(order):
            p[r] = 1.0 if j < m else min(1.0, lam * w[j])
    return p


def make_select_case(gen, T, K, E, c, ties=False, empty=(), skew=False, rule="proportional"):
    expert_ids = random_routing(gen, T, K, E, empty=empty, skew=skew)
    row_pair, counts, offsets = routing(expert_ids, E)
    P = T * K
    if ties:
        score = torch.randint(0, 4, (P,), generator=gen).float()
    else:
        score = torch.rand(P, generator=gen) * torch.rand(P, generator=gen)
    quota = ops.quota(counts, c, rule)
    return score, row_pair, offsets, quota, int(quota.sum())


def check_select_invariants(out, score, row_pair, offsets, quota, R):
    kept_rows, kept_pair, pair_kept, kept_offsets, kept_scale, retained_mass = out
    P = score.numel()
    assert kept_rows.dtype == I32 and kept_rows.shape == (R,)
    assert kept_pair.shape == (R,) and pair_kept.shape == (P,) and kept_scale.shape == (R,)
    assert retained_mass.shape == () and retained_mass.dtype == torch.float32
    assert torch.equal(kept_offsets, torch.cumsum(quota, 0).to(I32))
    if R:
        assert bool((kept_rows[1:] > kept_rows[:-1]).all()), "kept rows must ascend"
    assert torch.equal(kept_pair, row_pair[kept_rows.long()])
    expect = torch.full((P,), -1, dtype=I32)
    expect[kept_pair.long()] = torch.arange(R, dtype=I32)
    assert torch.equal(pair_kept, expect)
    # rows of expert e fill exactly its kept range
    for e, ((a, b), (ka, kb)) in enumerate(zip(expert_ranges(offsets), expert_ranges(kept_offsets))):
        seg = kept_rows[ka:kb]
        assert bool(((seg >= a) & (seg < b)).all()), e
    total = math.fsum(score.double().tolist())
    kept = math.fsum(score.double()[kept_rows.long()].tolist())
    ref_mass = 1.0 if total == 0 else kept / total
    assert retained_mass.item() == pytest.approx(ref_mass, rel=1e-6, abs=1e-7)


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("T,K,E,c,empty", [
    (37, 3, 8, 0.3, (2,)), (1, 1, 1, 0.5, ()), (50, 4, 4, 0.1, ()), (20, 6, 6, 0.25, ()),
    (64, 2, 16, 0.9, (0, 5, 15)), (33, 1, 1, 0.3, ()), (40, 8, 8, 1 / 3, ()),
])
def test_select_topk_vs_bruteforce(ties, T, K, E, c, empty):
    gen = torch.Generator().manual_seed(T * 31 + K * 7 + E + int(ties))
    score, row_pair, offsets, quota, R = make_select_case(gen, T, K, E, c, ties, empty)
    out = ops.select(score, row_pair, offsets, quota, R, "topk")
    assert out[0].tolist() == topk_reference(score, offsets, quota)
    assert torch.equal(out[4], torch.ones(R))
    check_select_invariants(out, score, row_pair, offsets, quota, R)


def test_select_topk_nan_and_signed_zero():
    score = torch.tensor([float("nan"), 1.0, -0.0, 0.0, float("-inf"), 2.0, float("nan"), 0.5])
    offsets = torch.tensor([4, 8], dtype=I32)
    row_pair = torch.tensor([3, 0, 1, 2, 7, 6, 5, 4], dtype=I32)
    quota = torch.tensor([3, 2], dtype=I32)
    out = ops.select(score, row_pair, offsets, quota, 5, "topk")
    # expert 0: 1.0 (row 1), then -0 / +0 tie -> rows 2, 3; NaN (row 0) last
    # expert 1: 2.0 (row 5), 0.5 (row 7); -inf beats NaN but not these
    assert out[0].tolist() == [1, 2, 3, 5, 7]
    quota = torch.tensor([4, 3], dtype=I32)
    out = ops.select(score, row_pair, offsets, quota, 7, "topk")
    assert out[0].tolist() == [0, 1, 2, 3, 4, 5, 7]


@pytest.mark.parametrize("selection", ["topk", "importance"])
def test_select_c0_is_identity(selection):
    gen = torch.Generator().manual_seed(3)
    score, row_pair, offsets, quota, R = make_select_case(gen, 37, 3, 8, 0.0, empty=(1,))
    out = ops.select(score, row_pair, offsets, quota, R, selection, seed=5)
    P = score.numel()
    assert R == P
    assert torch.equal(out[0], torch.arange(P, dtype=I32))
    assert torch.equal(out[1], row_pair)
    assert torch.equal(out[4], torch.ones(P))
    assert out[5].item() == 1.0


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("T,K,E,c,empty", [
    (37, 3, 8, 0.3, (2,)), (50, 4, 4, 0.5, ()), (64, 2, 16, 0.9, (0, 5)), (40, 8, 8, 0.2, ()),
])
def test_select_importance_counts_and_scales(ties, T, K, E, c, empty):
    gen = torch.Generator().manual_seed(T + K + E + int(ties))
    score, row_pair, offsets, quota, R = make_select_case(gen, T, K, E, c, ties, empty)
    if ties:
        score[::7] = 0.0
    p_ref = importance_probs_reference(score, offsets, quota)
    for seed in range(5):
        out = ops.select(score, row_pair, offsets, quota, R, "importance", seed)
        check_select_invariants(out, score, row_pair, offsets, quota, R)
        kept_rows, kept_scale = out[0].tolist(), out[4]
        expect = torch.tensor([1.0 / p_ref[r] for r in kept_rows], dtype=torch.float64)
        torch.testing.assert_close(kept_scale.double(), expect, rtol=1e-6, atol=0)


def test_select_importance_hand_computed():
    # expert 0: [100, 1, 1, 1, 1], Q = 2 -> 100 capped at 1, lambda = 1/4 for the rest
    # expert 1: [0, 0, 3, 0, 0], Q = 3 -> 3 kept surely, 2 of the 4 zeros with p = 1/2
    score = torch.tensor([100.0, 1, 1, 1, 1, 0, 0, 3, 0, 0])
    offsets = torch.tensor([5, 10], dtype=I32)
    row_pair = torch.arange(10, dtype=I32)
    quota = torch.tensor([2, 3], dtype=I32)
    for seed in range(20):
        kept_rows, _, _, _, kept_scale, _ = ops.select(score, row_pair, offsets, quota, 5,
                                                        "importance", seed)
        rows = kept_rows.tolist()
        assert rows[0] == 0 and 1 <= rows[1] <= 4 and 7 in rows[2:]
        scale = dict(zip(rows, kept_scale.tolist()))
        assert scale[0] == 1.0 and scale[rows[1]] == 4.0 and scale[7] == 1.0
        assert sorted(scale[r] for r in rows[2:] if r != 7) == [2.0, 2.0]


def check_unbiased(score, row_pair, offsets, quota, R, v, n_seeds):
    """Mean over seeds of sum_kept v / p equals sum v; inclusion frequencies equal p."""
    p_ref = torch.tensor(importance_probs_reference(score, offsets, quota), dtype=torch.float64)
    assert bool((p_ref > 0).all()), "the estimator is unbiased only where every p > 0"
    estimates = torch.empty(n_seeds, dtype=torch.float64)
    hits = torch.zeros(score.numel(), dtype=torch.float64)
    for seed in range(n_seeds):
        kept_rows, _, _, _, kept_scale, _ = ops.select(score, row_pair, offsets, quota, R,
                                                        "importance", seed)
        kr = kept_rows.long()
        estimates[seed] = (kept_scale.double() * v[kr]).sum()
        hits[kr] += 1
    truth = v.sum().item()
    # 5 standard errors of the mean, from the sample variance of the estimates
    sem = estimates.std().item() / math.sqrt(n_seeds)
    assert abs(estimates.mean().item() - truth) <= 5 * sem + 1e-9 * v.abs().sum().item(), \
        (estimates.mean().item(), truth, sem)
    # marginal inclusion frequencies match p within 5 binomial sigmas per row
    freq = hits / n_seeds
    sigma = torch.sqrt(p_ref * (1 - p_ref) / n_seeds)
    assert bool(((freq - p_ref).abs() <= 5 * sigma + 1e-12).all())


def test_select_importance_unbiased():
    gen = torch.Generator().manual_seed(11)
    score, row_pair, offsets, quota, R = make_select_case(gen, 60, 2, 5, 0.6, skew=True)
    score = score + 1e-3  # every row in play
    v = torch.randn(score.numel(), generator=gen, dtype=torch.float64)
    check_unbiased(score, row_pair, offsets, quota, R, v, 3000)


def test_select_importance_unbiased_zero_rule():
    # expert 0 water-fills (one row capped), expert 1 has fewer positives than its quota
    score = torch.tensor([50.0, 1, 2, 3, 1, 0.5, 0, 0, 3, 0, 0, 2])
    offsets = torch.tensor([6, 12], dtype=I32)
    row_pair = torch.arange(12, dtype=I32)
    quota = torch.tensor([3, 4], dtype=I32)
    v = torch.randn(12, generator=torch.Generator().manual_seed(12), dtype=torch.float64)
    check_unbiased(score, row_pair, offsets, quota, 7, v, 3000)


def test_select_bad_inputs():
    score = torch.rand(6)
    rp = torch.arange(6, dtype=I32)
    off = torch.tensor([4, 6], dtype=I32)
    q = torch.tensor([2, 1], dtype=I32)
    with pytest.raises(RuntimeError, match="selection"):
        ops.select(score, rp, off, q, 3, "top_k")
    with pytest.raises(RuntimeError, match="num_retained"):
        ops.select(score, rp, off, q, 4, "topk")
    with pytest.raises(RuntimeError, match="num_retained"):
        ops.select(score, rp, off, q, 7, "topk")
    with pytest.raises(RuntimeError, match=r"quota\[1\]"):
        ops.select(score, rp, off, torch.tensor([0, 3], dtype=I32), 3, "topk")
    with pytest.raises(RuntimeError, match="quota"):
        ops.select(score, rp, off, torch.tensor([2, 1, 0], dtype=I32), 3, "topk")
    with pytest.raises(RuntimeError, match="offsets"):
        ops.select(score, rp, torch.tensor([4, 5], dtype=I32), q, 3, "topk")
    with pytest.raises(RuntimeError, match="offsets"):
        ops.select(score, rp, torch.tensor([4, 3], dtype=I32), torch.tensor([2, 0], dtype=I32), 2, "topk")
    with pytest.raises(RuntimeError, match="offsets"):
        ops.select(score, rp, off.long(), q, 3, "topk")
    with pytest.raises(RuntimeError, match="score"):
        ops.select(score.double(), rp, off, q, 3, "topk")
    with pytest.raises(RuntimeError, match="row_pair"):
        ops.select(score, rp[:5], off, q, 3, "topk")
    with pytest.raises(RuntimeError, match="permutation"):
        ops.select(score, torch.tensor([0, 1, 2, 2, 4, 5], dtype=I32), off, q, 3, "topk")
    with pytest.raises(RuntimeError, match=r"row_pair\[2\]"):
        ops.select(score, torch.tensor([0, 1, 6, 3, 4, 5], dtype=I32), off, q, 3, "topk")


# --------------------------------------------------------------------------- grouped_mm
def tol(dtype):
    return dict(rtol=2e-2, atol=2e-2) if dtype in (torch.bfloat16, torch.float16) else \
        dict(rtol=1e-5, atol=1e-5)


def padded_strides(shape, dtype):
    align = 16 // torch.empty((), dtype=dtype).element_size()
    padded = list(shape)
    padded[-1] = -(-padded[-1] // align) * align
    return torch.empty(padded).stride()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("transpose_b", [False, True])
def test_grouped_mm_rows(dtype, transpose_b):
    gen = torch.Generator().manual_seed(4)
    M, K, N = 37, 24, 13
    sizes = [5, 0, 17, 0, 15]  # empty groups included
    offsets = torch.tensor(sizes, dtype=I32).cumsum(0).to(I32)
    a = torch.randn(M, K, generator=gen).to(dtype)
    if transpose_b:
        b = torch.randn(len(sizes), N, K, generator=gen).to(dtype).transpose(1, 2)
    else:
        b = torch.randn(len(sizes), K, N, generator=gen).to(dtype)
    out = ops.grouped_mm(a, b, offsets)
    assert out.shape == (M, N) and out.dtype == dtype
    assert out.stride() == padded_strides((M, N), dtype)
    torch.testing.assert_close(out.double(), grouped_mm_rows_ref(a, b, offsets), **tol(dtype))


def test_grouped_mm_rows_past_last_offset_are_zero():
    a, b = torch.randn(10, 8), torch.randn(2, 8, 4)
    out = ops.grouped_mm(a, b, torch.tensor([3, 6], dtype=I32))
    assert torch.equal(out[6:], torch.zeros(4, 4))
    torch.testing.assert_close(out[:6].double(), grouped_mm_rows_ref(a, b, torch.tensor([3, 6]))[:6],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("transpose_a", [False, True])
def test_grouped_mm_k_groups(dtype, transpose_a):
    gen = torch.Generator().manual_seed(5)
    M, Ktot, N = 12, 41, 7
    sizes = [0, 9, 20, 0, 12, 0]
    offsets = torch.tensor(sizes, dtype=I32).cumsum(0).to(I32)
    if transpose_a:  # the weight-gradient layout: x^T with x (Ktot, M)
        a = torch.randn(Ktot, M, generator=gen).to(dtype).t()
    else:
        a = torch.randn(M, Ktot, generator=gen).to(dtype)
    b = torch.randn(Ktot, N, generator=gen).to(dtype)
    out = ops.grouped_mm(a, b, offsets)
    assert out.shape == (len(sizes), M, N)
    assert out.stride() == padded_strides((len(sizes), M, N), dtype)
    ref = grouped_mm_k_ref(a, b, offsets)
    torch.testing.assert_close(out.double(), ref, **tol(dtype))
    for e, s in enumerate(sizes):
        if s == 0:
            assert torch.equal(out[e], torch.zeros(M, N, dtype=dtype))


def test_grouped_mm_bad_inputs():
    a, b3, b2 = torch.randn(10, 8), torch.randn(3, 8, 4), torch.randn(8, 4)
    off = torch.tensor([3, 6, 10], dtype=I32)
    with pytest.raises(RuntimeError, match="offsets"):
        ops.grouped_mm(a, b3, off.long())
    with pytest.raises(RuntimeError, match="offsets"):
        ops.grouped_mm(a, b3, off[:2])
    with pytest.raises(RuntimeError, match="offsets"):
        ops.grouped_mm(a, b3, torch.tensor([3, 2, 10], dtype=I32))
    with pytest.raises(RuntimeError, match="offsets"):
        ops.grouped_mm(a, b3, torch.tensor([3, 6, 11], dtype=I32))
    with pytest.raises(RuntimeError, match="offsets"):
        ops.grouped_mm(a, b2, torch.tensor([3, 9], dtype=I32))  # K is 8
    with pytest.raises(RuntimeError, match="dtype"):
        ops.grouped_mm(a, b3.double(), off)
    with pytest.raises(RuntimeError, match="K"):
        ops.grouped_mm(a, torch.randn(3, 7, 4), off)
    with pytest.raises(RuntimeError, match="b must"):
        ops.grouped_mm(a, torch.randn(2, 3, 8, 4), off)
