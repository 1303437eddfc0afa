// Retention quotas: how many routed pairs of each expert keep their backward.
//
// Plain C++17, no torch. Every function is also compiled for the device
// (LRMOE_HD): the CUDA quota kernel runs one thread per expert on exactly this
// code, so the CPU path, the GPU path and the GoogleTests share one definition.
//
// Legend: E experts, n_E routed pairs per expert (tokens_per_expert),
// N = sum(n_E), c = recalibration rate in [0, 1), keep = 1 - c.
// Source: docs/algorithm.md section 3 ("Retention quotas").
#pragma once

#include <math.h>  // llrint, ldexp: host and device (CUDA math API)
#include <cstdint>

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

// Host helper: all quotas at once (O(E^2 log N); E is at most a few thousand).
inline void compute_quotas(QuotaRule rule, const int32_t* n_E, int64_t E,
                           double recalibration_rate, int32_t* quota_E) {
  for (int64_t e = 0; e < E; ++e)
    quota_E[e] = static_cast<int32_t>(expert_quota(rule, e, n_E, E, recalibration_rate));
}

}  // namespace core
}  // namespace lrmoe
