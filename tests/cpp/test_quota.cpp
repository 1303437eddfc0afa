// GoogleTests for csrc/core/quota.h (retention quotas).
//
// Every expectation comes from an independent source: hand arithmetic written
// out in comments, CPython's Fraction.limit_denominator (values pasted below),
// or the straightforward references in this file, which use exact integer
// arithmetic with the rate given as a fraction c = p/q and sort instead of rank.
//
// Legend: E experts, n_E loads (tokens_per_expert), N = sum(n_E),
// c = p/q recalibration rate, S = floor((1 - c) N) retained pairs, Q_E quotas.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/quota.h"

namespace {

using lrmoe::core::compute_quotas;
using lrmoe::core::QuotaRule;
using lrmoe::core::rate_fraction;
using lrmoe::core::retained_total;
using Loads = std::vector<int32_t>;

struct Rate {
  int64_t p, q;  // c = p / q, 0 <= p < q
  double value() const { return static_cast<double>(p) / static_cast<double>(q); }
};

std::vector<int32_t> quotas(QuotaRule rule, const Loads& n_E, double c) {
  std::vector<int32_t> q_E(n_E.size(), -7);
  compute_quotas(rule, n_E.data(), static_cast<int64_t>(n_E.size()), c, q_E.data());
  return q_E;
}

int64_t sum(const std::vector<int32_t>& v) {
  return std::accumulate(v.begin(), v.end(), int64_t(0));
}

// ---- references (exact integer arithmetic, c = p/q) ------------------------

int64_t ref_total(const Loads& n_E, Rate c) { return (c.q - c.p) * sum(n_E) / c.q; }

// Largest remainder, the textbook way: floor every ideal share (q-p) n_e / q,
// sort experts by remainder (descending; stable, so equal remainders stay in
// index order) and hand one extra pair to each of the first S - sum(floor).
std::vector<int32_t> ref_proportional(const Loads& n_E, Rate c) {
  const size_t E = n_E.size();
  std::vector<int32_t> q_E(E);
  std::vector<int64_t> rem_E(E);
  int64_t floors = 0;
  for (size_t e = 0; e < E; ++e) {
    const int64_t ideal_num = (c.q - c.p) * n_E[e];  // ideal share = ideal_num / q
    q_E[e] = static_cast<int32_t>(ideal_num / c.q);
    rem_E[e] = ideal_num % c.q;
    floors += q_E[e];
  }
  std::vector<size_t> order(E);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return rem_E[a] > rem_E[b]; });
  const int64_t extra = ref_total(n_E, c) - floors;
  for (int64_t i = 0; i < extra; ++i) q_E[order[i]] += 1;
  return q_E;
}

// Water level by brute force over every level 0..max(n): the largest L with
// sum min(n_e, L) <= S; Q_e = min(n_e, L); the S - sum pairs still owed go one
// each to the experts above L, most loaded first, equal loads by lower index.
std::vector<int32_t> ref_water_level(const Loads& n_E, Rate c) {
  const int64_t S = ref_total(n_E, c);
  const int32_t max_n = n_E.empty() ? 0 : *std::max_element(n_E.begin(), n_E.end());
  int32_t level = 0;
  for (int32_t L = 0; L <= max_n; ++L) {
    int64_t filled = 0;
    for (int32_t n : n_E) filled += std::min(n, L);
    if (filled <= S) level = L;
  }
  std::vector<int32_t> q_E(n_E.size());
  std::vector<size_t> above;
  for (size_t e = 0; e < n_E.size(); ++e) {
    q_E[e] = std::min(n_E[e], level);
    if (n_E[e] > level) above.push_back(e);
  }
  std::stable_sort(above.begin(), above.end(),
                   [&](size_t a, size_t b) { return n_E[a] > n_E[b]; });
  const int64_t owed = S - sum(q_E);
  EXPECT_LE(owed, static_cast<int64_t>(above.size())) << "reference: level not maximal";
  for (int64_t i = 0; i < owed; ++i) q_E[above[i]] += 1;
  return q_E;
}

// ---- random cases -----------------------------------------------------------

struct Case {
  Loads n_E;
  Rate c;
};

// Mixed shapes: uniform, skewed (Zipf-like), sparse with many empty experts,
// one-hot, large loads; rates p/q with q up to 1000 plus the usual decimals.
std::vector<Case> random_cases(uint64_t seed, int count) {
  std::mt19937_64 rng(seed);
  auto uni = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  const Rate common[] = {{0, 1}, {1, 10}, {1, 5}, {3, 10}, {1, 3}, {1, 2}, {9, 10}, {999, 1000}};
  std::vector<Case> cases;
  for (int i = 0; i < count; ++i) {
    const int64_t E = uni(1, 70);
    Loads n_E(E);
    const int shape = static_cast<int>(uni(0, 4));
    for (int64_t e = 0; e < E; ++e) {
      switch (shape) {
        case 0: n_E[e] = static_cast<int32_t>(uni(0, 60)); break;
        case 1: n_E[e] = static_cast<int32_t>(4000.0 / std::pow(e + 1.0, 1.2) * uni(1, 3)); break;
        case 2: n_E[e] = uni(0, 3) == 0 ? static_cast<int32_t>(uni(1, 500)) : 0; break;
        case 3: n_E[e] = static_cast<int32_t>(uni(0, 2000000)); break;
        default: n_E[e] = 0; break;
      }
    }
    if (shape == 4) n_E[uni(0, E - 1)] = static_cast<int32_t>(uni(1, 100000));
    Rate c;
    if (uni(0, 3) == 0) {
      c = common[uni(0, 7)];
    } else {
      c.q = uni(1, 1000);
      c.p = uni(0, c.q - 1);
    }
    cases.push_back({std::move(n_E), c});
  }
  return cases;
}

std::string describe(const Case& k) {
  std::string s = "c=" + std::to_string(k.c.p) + "/" + std::to_string(k.c.q) + " n=[";
  for (size_t e = 0; e < k.n_E.size() && e < 16; ++e) s += std::to_string(k.n_E[e]) + ",";
  return s + (k.n_E.size() > 16 ? "...]" : "]");
}

// ---- rate as a fraction -----------------------------------------------------

TEST(RateFraction, MatchesCPythonLimitDenominator) {
  // Expected values from CPython:
  //   Fraction(round(c * 2**60), 2**60).limit_denominator(2**20)
  struct Row { double c; int64_t p, q; };
  const Row rows[] = {
      {0.0, 0, 1},
      {1.0 / 3.0, 1, 3},
      {0.1, 1, 10},
      {0.2, 1, 5},
      {0.3, 3, 10},
      {0.25, 1, 4},
      {0.123456789, 10, 81},
      {0.7071067811865476, 665857, 941664},
      {0.14159265358979312, 140914, 995207},
      {0.4999999990686774, 1, 2},
      {1e-7, 0, 1},                      // below 2^-21: nearest is 0
      {4.76837158203125e-07, 0, 1},      // exactly 2^-21: tie, the convergent 0/1 wins
      {4.768371590913034e-07, 1, 1048576},
      {0.9999999999, 1, 1},
  };
  for (const Row& r : rows) {
    const auto f = rate_fraction(r.c);
    EXPECT_EQ(f.p, r.p) << "c=" << r.c;
    EXPECT_EQ(f.q, r.q) << "c=" << r.c;
  }
}

TEST(RateFraction, RecoversEverySmallFraction) {
  for (int64_t q = 1; q <= 400; ++q) {
    for (int64_t p = 0; p < q; ++p) {
      const int64_t g = std::gcd(p, q);
      const auto f = rate_fraction(static_cast<double>(p) / static_cast<double>(q));
      ASSERT_EQ(f.p, p / g) << p << "/" << q;
      ASSERT_EQ(f.q, q / g) << p << "/" << q;
    }
  }
}

TEST(RetainedTotal, FloorOfKeptFractionExact) {
  // 0.999 * 2000001 = 1998000.999 -> 1998000. A double (1 - c) * N with a
  // relative tolerance of 1e-9 used to round this up to 1998001.
  EXPECT_EQ(retained_total(2000001, 0.001), 1998000);
  EXPECT_EQ(retained_total(9, 1.0 / 3.0), 6);  // (2/3) 9 = 6 exactly; double gives 5.999...
  EXPECT_EQ(retained_total(0, 0.3), 0);
  EXPECT_EQ(retained_total(10, 0.0), 10);
  std::mt19937_64 rng(11);
  for (int i = 0; i < 20000; ++i) {
    const int64_t q = std::uniform_int_distribution<int64_t>(1, 100000)(rng);
    const int64_t p = std::uniform_int_distribution<int64_t>(0, q - 1)(rng);
    const int64_t N = std::uniform_int_distribution<int64_t>(0, int64_t(1) << 31)(rng);
    ASSERT_EQ(retained_total(N, static_cast<double>(p) / q), (q - p) * N / q)
        << "N=" << N << " c=" << p << "/" << q;
  }
}

// ---- proportional -------------------------------------------------------------

TEST(Proportional, DesignExample) {
  // (2/3) [4, 2, 3] = [2.67, 1.33, 2]; floors [2, 1, 2] sum 5; S = floor(6) = 6;
  // the one extra pair goes to the largest remainder (expert 0) -> [3, 1, 2].
  EXPECT_EQ(quotas(QuotaRule::kProportional, {4, 2, 3}, 1.0 / 3.0),
            (std::vector<int32_t>{3, 1, 2}));
}

TEST(Proportional, RemainderTiesGoToLowerIndex) {
  // c = 1/5: (4/5) [1, 6] = [0.8, 4.8]; floors [0, 4]; S = floor(5.6) = 5; one
  // extra, remainders tie at 0.8 -> expert 0: [1, 4]. (In double, 0.8*1 and
  // 0.8*6 - 4 differ in the last bit and the old code gave [0, 5].)
  EXPECT_EQ(quotas(QuotaRule::kProportional, {1, 6}, 0.2), (std::vector<int32_t>{1, 4}));
  // c = 1/3: (2/3) [4, 7] = [2.67, 4.67]; floors [2, 4]; S = floor(7.33) = 7;
  // one extra, remainders tie at 2/3 -> expert 0: [3, 4].
  EXPECT_EQ(quotas(QuotaRule::kProportional, {4, 7}, 1.0 / 3.0), (std::vector<int32_t>{3, 4}));
  // c = 1/3: (2/3) [1, 1, 1] = 0.67 each; S = 2 -> the two lowest indices: [1, 1, 0].
  EXPECT_EQ(quotas(QuotaRule::kProportional, {1, 1, 1}, 1.0 / 3.0),
            (std::vector<int32_t>{1, 1, 0}));
}

TEST(Proportional, ZeroLoadExperts) {
  // c = 1/2: [0, 5, 0, 3] -> ideal [0, 2.5, 0, 1.5]; floors [0, 2, 0, 1]; S = 4;
  // one extra, remainder tie 0.5 between experts 1 and 3 -> expert 1.
  EXPECT_EQ(quotas(QuotaRule::kProportional, {0, 5, 0, 3}, 0.5),
            (std::vector<int32_t>{0, 3, 0, 1}));
  EXPECT_EQ(quotas(QuotaRule::kProportional, {0, 0, 0}, 0.3), (std::vector<int32_t>{0, 0, 0}));
}

TEST(Proportional, AllLoadOnOneExpert) {
  for (double c : {0.0, 0.1, 0.2, 1.0 / 3.0, 0.5, 0.999}) {
    const auto q = quotas(QuotaRule::kProportional, {0, 0, 1001, 0}, c);
    EXPECT_EQ(q, (std::vector<int32_t>{0, 0, static_cast<int32_t>(retained_total(1001, c)), 0}))
        << "c=" << c;
  }
  // 0.8 * 1001 = 800.8 -> 800
  EXPECT_EQ(quotas(QuotaRule::kProportional, {0, 0, 1001, 0}, 0.2)[2], 800);
}

TEST(Proportional, SingleExpert) {
  EXPECT_EQ(quotas(QuotaRule::kProportional, {10}, 0.25)[0], 7);  // 7.5 -> 7
  EXPECT_EQ(quotas(QuotaRule::kProportional, {2000001}, 0.001)[0], 1998000);
  EXPECT_EQ(quotas(QuotaRule::kProportional, {0}, 0.5)[0], 0);
}

TEST(Proportional, ZeroRateKeepsEverythingExactly) {
  for (const Case& k : random_cases(1, 300))
    ASSERT_EQ(quotas(QuotaRule::kProportional, k.n_E, 0.0), k.n_E) << describe(k);
}

TEST(Proportional, SumIsFloorOfKeptFractionAndBounds) {
  for (const Case& k : random_cases(2, 3000)) {
    const auto q = quotas(QuotaRule::kProportional, k.n_E, k.c.value());
    ASSERT_EQ(sum(q), ref_total(k.n_E, k.c)) << describe(k);
    for (size_t e = 0; e < q.size(); ++e) {
      ASSERT_GE(q[e], 0) << describe(k);
      ASSERT_LE(q[e], k.n_E[e]) << describe(k);
    }
  }
}

TEST(Proportional, MatchesSortedLargestRemainderReference) {
  for (const Case& k : random_cases(3, 3000))
    ASSERT_EQ(quotas(QuotaRule::kProportional, k.n_E, k.c.value()), ref_proportional(k.n_E, k.c))
        << describe(k);
}

TEST(Proportional, EachQuotaWithinOneOfIdealShare) {
  // |Q_e - (1-c) n_e| < 1, checked as |q Q_e - (q-p) n_e| < q.
  for (const Case& k : random_cases(4, 1000)) {
    const auto Q = quotas(QuotaRule::kProportional, k.n_E, k.c.value());
    for (size_t e = 0; e < Q.size(); ++e) {
      const int64_t diff = k.c.q * Q[e] - (k.c.q - k.c.p) * k.n_E[e];
      ASSERT_LT(diff < 0 ? -diff : diff, k.c.q) << describe(k) << " e=" << e;
    }
  }
}

// ---- water level --------------------------------------------------------------

TEST(WaterLevel, HandExamples) {
  // c = 1/4, n = [10, 2, 2, 2], N = 16, S = floor(0.75 * 16) = 12.
  // L = 6: 6 + 2 + 2 + 2 = 12 <= 12; L = 7: 13 > 12 -> L = 6, nothing owed.
  EXPECT_EQ(quotas(QuotaRule::kWaterLevel, {10, 2, 2, 2}, 0.25),
            (std::vector<int32_t>{6, 2, 2, 2}));
  // c = 1/2, n = [9, 7, 1], N = 17, S = floor(8.5) = 8.
  // L = 3: 3 + 3 + 1 = 7 <= 8; L = 4: 4 + 4 + 1 = 9 > 8 -> L = 3, one owed,
  // to the most loaded expert above L (expert 0): [4, 3, 1].
  EXPECT_EQ(quotas(QuotaRule::kWaterLevel, {9, 7, 1}, 0.5), (std::vector<int32_t>{4, 3, 1}));
  // c = 1/4, n = [6, 6, 0], N = 12, S = 9.
  // L = 4: 8 <= 9; L = 5: 10 > 9 -> L = 4, one owed; equal loads -> lower index.
  EXPECT_EQ(quotas(QuotaRule::kWaterLevel, {6, 6, 0}, 0.25), (std::vector<int32_t>{5, 4, 0}));
  // c = 1/2, n = [5, 5, 1], N = 11, S = 5. L = 2: 2 + 2 + 1 = 5 -> [2, 2, 1].
  EXPECT_EQ(quotas(QuotaRule::kWaterLevel, {5, 5, 1}, 0.5), (std::vector<int32_t>{2, 2, 1}));
}

TEST(WaterLevel, CutsHotExpertsHarderThanProportional) {
  // One hot expert (100) and seven cold ones (10 each), c = 1/5: N = 170, S = 136.
  // Proportional: 0.8 * [100, 10...] = [80, 8 x 7] (exact, sum 136).
  // Water level: for L >= 10, L + 70 <= 136 -> L = 66: [66, 10 x 7]; check
  // against the water level tau of docs/algorithm.md section 3: sum max(0, n - 66) = 34 = 0.2 * 170.
  const Loads n{100, 10, 10, 10, 10, 10, 10, 10};
  const auto prop = quotas(QuotaRule::kProportional, n, 0.2);
  const auto water = quotas(QuotaRule::kWaterLevel, n, 0.2);
  EXPECT_EQ(prop, (std::vector<int32_t>{80, 8, 8, 8, 8, 8, 8, 8}));
  EXPECT_EQ(water, (std::vector<int32_t>{66, 10, 10, 10, 10, 10, 10, 10}));
  EXPECT_LT(water[0], prop[0]);
  // the earlier hand example: the hot expert keeps 6 of 10 vs 8 proportionally
  // ((3/4) [10, 2, 2, 2] = [7.5, 1.5, 1.5, 1.5]; floors sum 10, S = 12, the two
  // extras tie at 0.5 -> experts 0 and 1: [8, 2, 1, 1]).
  EXPECT_EQ(quotas(QuotaRule::kProportional, {10, 2, 2, 2}, 0.25),
            (std::vector<int32_t>{8, 2, 1, 1}));
  EXPECT_EQ(quotas(QuotaRule::kWaterLevel, {10, 2, 2, 2}, 0.25)[0], 6);
}

TEST(WaterLevel, EdgeCases) {
  EXPECT_EQ(quotas(QuotaRule::kWaterLevel, {0, 0, 0}, 0.2), (std::vector<int32_t>{0, 0, 0}));
  EXPECT_EQ(quotas(QuotaRule::kWaterLevel, {10}, 0.25)[0], 7);
  EXPECT_EQ(quotas(QuotaRule::kWaterLevel, {0, 1001, 0}, 0.2), (std::vector<int32_t>{0, 800, 0}));
  EXPECT_EQ(quotas(QuotaRule::kWaterLevel, {3, 0, 9}, 0.0), (std::vector<int32_t>{3, 0, 9}));
}

TEST(WaterLevel, ZeroRateKeepsEverythingExactly) {
  for (const Case& k : random_cases(5, 300))
    ASSERT_EQ(quotas(QuotaRule::kWaterLevel, k.n_E, 0.0), k.n_E) << describe(k);
}

TEST(WaterLevel, MatchesBruteForceDefinition) {
  // The brute-force scan is O(E * max n): keep loads moderate here.
  for (Case k : random_cases(6, 2000)) {
    for (int32_t& n : k.n_E) n %= 3000;
    const auto q = quotas(QuotaRule::kWaterLevel, k.n_E, k.c.value());
    ASSERT_EQ(q, ref_water_level(k.n_E, k.c)) << describe(k);
    ASSERT_EQ(sum(q), ref_total(k.n_E, k.c)) << describe(k);
    for (size_t e = 0; e < q.size(); ++e) {
      ASSERT_GE(q[e], 0);
      ASSERT_LE(q[e], k.n_E[e]);
    }
  }
}

TEST(WaterLevel, SumIsFloorOfKeptFractionOnLargeLoads) {
  for (const Case& k : random_cases(7, 2000)) {
    const auto q = quotas(QuotaRule::kWaterLevel, k.n_E, k.c.value());
    ASSERT_EQ(sum(q), ref_total(k.n_E, k.c)) << describe(k);
    for (size_t e = 0; e < q.size(); ++e) ASSERT_LE(q[e], k.n_E[e]) << describe(k);
  }
}

// ---- source shares (expert parallelism) ---------------------------------------

// Column-major view of one expert: shares of every source for a given expert, from
// core::source_share on a (W, E) row-major table.
std::vector<int32_t> shares_of(const std::vector<int32_t>& counts_WE, int64_t W, int64_t E,
                               int64_t e, int64_t quota_e) {
  std::vector<int32_t> out(W);
  for (int64_t s = 0; s < W; ++s)
    out[s] = static_cast<int32_t>(
        lrmoe::core::source_share(s, e, counts_WE.data(), W, E, quota_e));
  return out;
}

// Brute-force largest remainder with rationals: ideal share x_s = Q n_s / N kept as
// a reduced fraction; floor it, compare fractional parts by cross-multiplication
// (__int128), stable sort (equal parts stay in rank order), one extra to each of the
// first Q - sum(floor).
std::vector<int32_t> ref_source_shares(const std::vector<int32_t>& n_W, int64_t Q) {
  const size_t W = n_W.size();
  int64_t N = 0;
  for (int32_t n : n_W) N += n;
  std::vector<int32_t> share(W, 0);
  if (N == 0) return share;  // Q must be 0
  struct Frac { int64_t num, den; };
  std::vector<Frac> frac(W);
  int64_t floors = 0;
  for (size_t s = 0; s < W; ++s) {
    int64_t num = Q * n_W[s], den = N;
    const int64_t g = std::gcd(num, den);
    num /= g; den /= g;
    share[s] = static_cast<int32_t>(num / den);
    floors += share[s];
    frac[s] = {num - (num / den) * den, den};
  }
  std::vector<size_t> order(W);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    __extension__ typedef __int128 i128;
    return static_cast<i128>(frac[a].num) * frac[b].den >
           static_cast<i128>(frac[b].num) * frac[a].den;
  });
  for (int64_t i = 0; i < Q - floors; ++i) share[order[i]] += 1;
  return share;
}

TEST(SourceShare, HandExamples) {
  // counts [[3], [1]], Q = 2: ideal 1.5 and 0.5, equal remainders -> rank 0 gets it.
  EXPECT_EQ(shares_of({3, 1}, 2, 1, 0, 2), (std::vector<int32_t>{2, 0}));
  // counts [5, 3, 2], Q = 7: ideal 3.5, 2.1, 1.4 -> floors 3, 2, 1 (sum 6); largest
  // remainder 0.5 (rank 0) -> [4, 2, 1].
  EXPECT_EQ(shares_of({5, 3, 2}, 3, 1, 0, 7), (std::vector<int32_t>{4, 2, 1}));
  // counts [1, 1, 1], Q = 2: all remainders 2/3 -> ranks 0 and 1.
  EXPECT_EQ(shares_of({1, 1, 1}, 3, 1, 0, 2), (std::vector<int32_t>{1, 1, 0}));
  // Q = 0 and Q = N.
  EXPECT_EQ(shares_of({4, 0, 9}, 3, 1, 0, 0), (std::vector<int32_t>{0, 0, 0}));
  EXPECT_EQ(shares_of({4, 0, 9}, 3, 1, 0, 13), (std::vector<int32_t>{4, 0, 9}));
  // expert with no pairs anywhere.
  EXPECT_EQ(shares_of({0, 0}, 2, 1, 0, 0), (std::vector<int32_t>{0, 0}));
  // (W, E) = (2, 2) row-major: expert 0 counts [2, 2] Q = 1 -> [1, 0];
  // expert 1 counts [1, 3] Q = 3 -> ideal 0.75, 2.25 -> [1, 2].
  const std::vector<int32_t> c = {2, 1, 2, 3};
  EXPECT_EQ(shares_of(c, 2, 2, 0, 1), (std::vector<int32_t>{1, 0}));
  EXPECT_EQ(shares_of(c, 2, 2, 1, 3), (std::vector<int32_t>{1, 2}));
}

TEST(SourceShare, MatchesRationalLargestRemainderReference) {
  std::mt19937_64 rng(11);
  auto uni = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  for (int it = 0; it < 3000; ++it) {
    const int64_t W = uni(1, 17), E = uni(1, 9);
    const int64_t hi = uni(0, 3) == 0 ? 2000000 : uni(1, 40);
    std::vector<int32_t> counts_WE(W * E);
    for (auto& v : counts_WE) v = uni(0, 2) == 0 ? 0 : static_cast<int32_t>(uni(0, hi));
    for (int64_t e = 0; e < E; ++e) {
      std::vector<int32_t> n_W(W);
      int64_t N = 0;
      for (int64_t s = 0; s < W; ++s) N += (n_W[s] = counts_WE[s * E + e]);
      const int pick = static_cast<int>(uni(0, 4));
      const int64_t Q = pick == 0 ? 0 : pick == 1 ? N : uni(0, N);
      const auto got = shares_of(counts_WE, W, E, e, Q);
      ASSERT_EQ(got, ref_source_shares(n_W, Q)) << "W=" << W << " e=" << e << " Q=" << Q;
      ASSERT_EQ(sum(got), Q);
      for (int64_t s = 0; s < W; ++s) {
        ASSERT_GE(got[s], 0);
        ASSERT_LE(got[s], n_W[s]);
      }
    }
  }
}

}  // namespace

// the host form (one sort, int64 loads) against the per-expert (device) form
TEST(CoreQuotas, HostFormEqualsPerExpertForm) {
  std::mt19937_64 rng(7);
  const double rates[] = {0.0, 0.1, 0.2, 0.25, 1.0 / 3.0, 0.3, 0.5, 0.9, 0.999999};
  for (int trial = 0; trial < 400; ++trial) {
    const int E = 1 + static_cast<int>(rng() % 64);
    const int64_t hi = trial % 3 == 0 ? 4 : 5000;  // small loads make many ties
    std::vector<int64_t> n(E);
    std::vector<int32_t> n32(E);
    for (int e = 0; e < E; ++e) n32[e] = static_cast<int32_t>(n[e] = static_cast<int64_t>(rng() % (hi + 1)));
    for (double c : rates)
      for (QuotaRule rule : {QuotaRule::kProportional, QuotaRule::kWaterLevel}) {
        std::vector<int64_t> q(E, -1);
        compute_quotas(rule, n.data(), E, c, q.data());
        for (int e = 0; e < E; ++e)
          ASSERT_EQ(q[e], lrmoe::core::expert_quota(rule, e, n32.data(), E, c))
              << "trial " << trial << " c " << c << " rule " << int(rule) << " e " << e;
      }
  }
}
