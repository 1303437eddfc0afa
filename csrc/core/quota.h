// Retention quotas: how many routed pairs of each expert keep their backward.
//
// Plain C++17, no torch. Every per-expert function is also compiled for the device
// (LRMOE_HD): the CUDA quota kernel runs one thread per expert on exactly this
// code, so the CPU path, the GPU path and the GoogleTests share one definition.
//
// Legend: E experts, n_E routed pairs per expert (tokens_per_expert),
// N = sum(n_E), c = recalibration rate in [0, 1), keep = 1 - c.
// Source: docs/algorithm.md section 3 ("Retention quotas").
#pragma once

#include <math.h>  // llrint, ldexp: host and device (CUDA math API)
#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#if defined(__CUDACC__)
#define LRMOE_HD __host__ __device__
#else
#define LRMOE_HD
#endif

namespace lrmoe {
namespace core {

enum class QuotaRule : int { kProportional = 0, kWaterLevel = 1 };

// The rate c as an exact fraction p/q, so that every quota below is integer
// arithmetic: exact ties (a double (1 - c) * n_e puts equal rational
// remainders in an order set by rounding, which an FMA-contracting compiler
// may change on the device), and floor((1 - c) N) that is right for any N.
// Definition (reproducible in Python):
//   Fraction(round(c * 2**60), 2**60).limit_denominator(2**20)
// i.e. the fraction nearest to c with q <= 2^20 (ties to the convergent), so a
// rate written with at most 6 decimals, or 1/3, is taken exactly as meant.
constexpr int64_t kMaxRateDenominator = int64_t(1) << 20;

struct RateFraction {
  int64_t p;  // 0 <= p <= q
  int64_t q;  // 1 <= q <= kMaxRateDenominator
};

// Continued fractions on c ~ n / 2^60, following CPython's
// Fraction.limit_denominator step for step. c outside [0, 1) is clamped.
LRMOE_HD inline RateFraction rate_fraction(double recalibration_rate) {
  if (!(recalibration_rate > 0.0)) return {0, 1};  // also NaN (ops reject it earlier)
  if (recalibration_rate >= 1.0) return {1, 1};
  const uint64_t kMax = static_cast<uint64_t>(kMaxRateDenominator);
  // c * 2^60 is exact; llrint rounds half to even like Python's round.
  uint64_t n = static_cast<uint64_t>(llrint(ldexp(recalibration_rate, 60)));
  uint64_t d = uint64_t(1) << 60;
  if (n == 0) return {0, 1};
  while ((n & 1u) == 0 && d > 1) { n >>= 1; d >>= 1; }  // lowest terms (d is 2^m)
  if (d <= kMax) return {static_cast<int64_t>(n), static_cast<int64_t>(d)};
  const uint64_t den = d;
  uint64_t p0 = 0, q0 = 1, p1 = 1, q1 = 0;
  while (d != 0) {  // d never reaches 0 here: the last convergent has q = den > kMax
    const uint64_t a = n / d;
    if (q1 != 0 && a > (kMax - q0) / q1) break;  // next q = q0 + a q1 > kMax (no overflow)
    const uint64_t q2 = q0 + a * q1;
    if (q2 > kMax) break;
    const uint64_t p2 = p0 + a * p1;
    p0 = p1; q0 = q1; p1 = p2; q1 = q2;
    const uint64_t r = n - a * d;
    n = d; d = r;
  }
  // Closest of the convergent p1/q1 and the semiconvergent (p0 + k p1)/(q0 + k q1):
  // CPython's test 2 d (q0 + k q1) <= den, written as d <= (den / 2) / q_semi
  // (den is a power of two >= 2^21) to stay inside 64 bits.
  const uint64_t k = (kMax - q0) / q1;
  const uint64_t q_semi = q0 + k * q1;
  if (d <= (den / 2) / q_semi) return {static_cast<int64_t>(p1), static_cast<int64_t>(q1)};
  return {static_cast<int64_t>(p0 + k * p1), static_cast<int64_t>(q_semi)};
}

// Total number of retained pairs: floor((1 - c) * N), c as rate_fraction(c).
// Known on the host from N = T * top_k alone, which is why retained buffers
// need no host sync. Exact for N < 2^43.
LRMOE_HD inline int64_t retained_total(int64_t num_pairs, double recalibration_rate) {
  if (num_pairs <= 0) return 0;
  const RateFraction c = rate_fraction(recalibration_rate);
  return (c.q - c.p) * num_pairs / c.q;
}

// Proportional rule: Q_e = (1 - c) * n_e rounded by largest remainder so that
// sum(Q) = floor((1 - c) * N). Remainders are the exact integers
// ((q - p) n_e) mod q; ties go to the lower expert index.
// O(E) per expert, so one expert per thread on the device.
LRMOE_HD inline int64_t proportional_quota(int64_t e, const int32_t* n_E, int64_t E,
                                           double recalibration_rate) {
  const RateFraction c = rate_fraction(recalibration_rate);
  const int64_t keep = c.q - c.p;  // (1 - c) = keep / q
  int64_t total_pairs = 0, base_sum = 0;
  for (int64_t j = 0; j < E; ++j) {
    total_pairs += n_E[j];
    base_sum += keep * n_E[j] / c.q;
  }
  const int64_t extra = keep * total_pairs / c.q - base_sum;  // < #experts with rem > 0
  const int64_t base_e = keep * n_E[e] / c.q;
  const int64_t rem_e = keep * n_E[e] % c.q;
  if (rem_e == 0) return base_e;  // exact share (also n_e = 0 and c = 0)
  // rank of e by remainder descending, then index ascending
  int64_t rank = 0;
  for (int64_t j = 0; j < E; ++j) {
    if (j == e) continue;
    const int64_t rem_j = keep * n_E[j] % c.q;
    if (rem_j > rem_e || (rem_j == rem_e && j < e)) ++rank;
  }
  return base_e + (rank < extra ? 1 : 0);
}

// Water-level rule: the largest integer level L with sum_e min(n_e, L) <= S,
// S = floor((1 - c) * N); Q_e = min(n_e, L), and the S - sum min(n_e, L)
// pairs still owed go one each to the experts above the level, most loaded
// first (ties: lower index). Cuts hot experts harder than proportional.
LRMOE_HD inline int64_t water_level_quota(int64_t e, const int32_t* n_E, int64_t E,
                                          double recalibration_rate) {
  int64_t total_pairs = 0, max_load = 0;
  for (int64_t j = 0; j < E; ++j) {
    total_pairs += n_E[j];
    if (n_E[j] > max_load) max_load = n_E[j];
  }
  const int64_t target = retained_total(total_pairs, recalibration_rate);
  // binary search for the largest L in [0, max_load] with filled(L) <= target
  int64_t lo = 0, hi = max_load;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    int64_t filled = 0;
    for (int64_t j = 0; j < E; ++j) filled += n_E[j] < mid ? n_E[j] : mid;
    if (filled <= target) lo = mid; else hi = mid - 1;
  }
  const int64_t level = lo;
  int64_t filled = 0;
  for (int64_t j = 0; j < E; ++j) filled += n_E[j] < level ? n_E[j] : level;
  const int64_t extra = target - filled;
  if (n_E[e] <= level) return n_E[e];
  int64_t rank = 0;
  for (int64_t j = 0; j < E; ++j) {
    if (j == e || n_E[j] <= level) continue;
    if (n_E[j] > n_E[e] || (n_E[j] == n_E[e] && j < e)) ++rank;
  }
  return level + (rank < extra ? 1 : 0);
}

LRMOE_HD inline int64_t expert_quota(QuotaRule rule, int64_t e, const int32_t* n_E, int64_t E,
                                     double recalibration_rate) {
  return rule == QuotaRule::kWaterLevel ? water_level_quota(e, n_E, E, recalibration_rate)
                                        : proportional_quota(e, n_E, E, recalibration_rate);
}

// Expert parallelism: split expert e's global quota Q_e over the W source ranks
// by largest remainder. n[s, e] = counts_WE[s * E + e], N_e = sum_s n[s, e]:
//   share[s, e] = floor(Q_e n[s, e] / N_e), plus one for the Q_e - sum_s floor(...)
//   sources with the largest remainders (Q_e n[s, e]) mod N_e (ties: lower rank).
// Integer arithmetic only, so every rank and device computes identical shares.
// Requires n >= 0 and 0 <= Q_e <= N_e (then share <= n, since a source with a
// zero remainder never gets an extra: sum_s rem = N_e * extra and rem < N_e).
// O(W) per (s, e), so one (s, e) per thread on the device.
LRMOE_HD inline int64_t source_share(int64_t s, int64_t e, const int32_t* counts_WE, int64_t W,
                                     int64_t E, int64_t quota_e) {
  int64_t total = 0;
  for (int64_t j = 0; j < W; ++j) total += counts_WE[j * E + e];
  if (total <= 0) total = 1;  // N_e = 0 forces Q_e = 0: every share is 0
  int64_t base_sum = 0;
  for (int64_t j = 0; j < W; ++j) base_sum += quota_e * counts_WE[j * E + e] / total;
  const int64_t extra = quota_e - base_sum;
  const int64_t num_s = quota_e * counts_WE[s * E + e];
  const int64_t base_s = num_s / total;
  const int64_t rem_s = num_s % total;
  // rank of s by remainder descending, then rank ascending
  int64_t rank = 0;
  for (int64_t j = 0; j < W; ++j) {
    if (j == s) continue;
    const int64_t rem_j = quota_e * counts_WE[j * E + e] % total;
    if (rem_j > rem_s || (rem_j == rem_s && j < s)) ++rank;
  }
  return base_s + (rank < extra ? 1 : 0);
}

// ---- host: all quotas of one layer at once, O(E log E) -------------------------------
// The same rules and integer arithmetic as expert_quota above, whose per-expert form
// (one GPU thread per expert) costs O(E) per expert: all E of them on the host would
// be O(E^2) (about 70 us at E = 128, more than a whole placement plan may take). Here
// one sort ranks the experts instead. tests/cpp/test_quota.cpp checks every quota of
// this form against expert_quota (and both against exact references).

namespace detail {

// Proportional: Q_e = floor(keep n_e / q) plus one for the `extra` experts with the
// largest remainders (keep n_e) mod q, ties to the lower index (proportional_quota).
template <typename In, typename Out>
inline void proportional_all(const In* n_E, int64_t E, double c, Out* quota_E) {
  const RateFraction f = rate_fraction(c);
  const int64_t keep = f.q - f.p;
  int64_t total = 0, base_sum = 0;
  std::vector<int32_t> order;
  order.reserve(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = n_E[e];
    total += n;
    quota_E[e] = static_cast<Out>(keep * n / f.q);
    base_sum += keep * n / f.q;
    if (keep * n % f.q != 0) order.push_back(static_cast<int32_t>(e));
  }
  const int64_t extra = keep * total / f.q - base_sum;  // < order.size()
  if (extra <= 0) return;
  auto rem = [&](int32_t e) { return keep * static_cast<int64_t>(n_E[e]) % f.q; };
  std::nth_element(order.begin(), order.begin() + (extra - 1), order.end(),
                   [&](int32_t a, int32_t b) {
                     const int64_t ra = rem(a), rb = rem(b);
                     return ra > rb || (ra == rb && a < b);
                   });
  for (int64_t k = 0; k < extra; ++k) quota_E[order[static_cast<size_t>(k)]] += 1;
}

// Water level: the largest level L in [0, max n] with sum_e min(n_e, L) <= S, S =
// retained_total; Q_e = min(n_e, L), then one more for the S - filled experts above
// L, most loaded first, ties to the lower index (water_level_quota).
template <typename In, typename Out>
inline void water_level_all(const In* n_E, int64_t E, double c, Out* quota_E) {
  std::vector<int32_t> order(static_cast<size_t>(E));
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return n_E[a] > n_E[b] || (n_E[a] == n_E[b] && a < b);
  });
  int64_t total = 0;
  for (int64_t e = 0; e < E; ++e) total += n_E[e];
  const int64_t target = retained_total(total, c);
  // Walk the loads ascending (order reversed): with prefix = sum of loads below v_k and
  // m = E - k loads at or above it, filled(L) = prefix + L m for L in (v_{k-1}, v_k].
  int64_t level = E > 0 ? static_cast<int64_t>(n_E[order[0]]) : 0, prefix = 0;
  for (int64_t k = 0; k < E; ++k) {
    const int64_t v = n_E[order[static_cast<size_t>(E - 1 - k)]];
    const int64_t m = E - k;
    if (prefix + v * m > target) {
      level = (target - prefix) / m;  // >= previous v, since filled(previous v) <= target
      break;
    }
    prefix += v;
  }
  int64_t filled = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t q = std::min(static_cast<int64_t>(n_E[e]), level);
    quota_E[e] = static_cast<Out>(q);
    filled += q;
  }
  int64_t extra = target - filled;
  for (int64_t k = 0; k < E && extra > 0; ++k, --extra) {
    const int32_t e = order[static_cast<size_t>(k)];
    if (n_E[e] <= level) break;
    quota_E[e] += 1;
  }
}

}  // namespace detail

// Q_E for loads n_E (each in [0, 2^31); In, Out: int32_t or int64_t);
// sum(Q) = floor((1 - c) sum(n)). Host only.
template <typename In, typename Out>
inline void compute_quotas(QuotaRule rule, const In* n_E, int64_t E,
                           double recalibration_rate, Out* quota_E) {
  if (rule == QuotaRule::kWaterLevel)
    detail::water_level_all(n_E, E, recalibration_rate, quota_E);
  else
    detail::proportional_all(n_E, E, recalibration_rate, quota_E);
}

}  // namespace core
}  // namespace lrmoe
