// Retention quotas: how many routed pairs of each expert keep their backward.
//
// Plain C++17, no torch. Every function is also compiled for the device
// (LRMOE_HD): the CUDA quota kernel runs one thread per expert on exactly this
// code, so the CPU path, the GPU path and the GoogleTests share one definition.
//
// Legend: E experts, n_E routed pairs per expert (tokens_per_expert),
// N = sum(n_E), c = recalibration rate in [0, 1), keep = 1 - c.
// Source: docs/algorithm.md and ../shared/DESIGN.md section 1 ("Quotas").
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define LRMOE_HD __host__ __device__
#else
#define LRMOE_HD
#endif

namespace lrmoe {
namespace core {

enum class QuotaRule : int { kProportional = 0, kWaterLevel = 1 };

// floor(x) that forgives binary rounding just below an integer:
// (1 - 1/3) * 9 is 5.999999999999999 in double, and must count as 6.
LRMOE_HD inline int64_t robust_floor(double x) {
  return static_cast<int64_t>(std::floor(x + 1e-9 * (1.0 + std::fabs(x))));
}

// Total number of retained pairs: floor((1 - c) * N). Known on the host from
// N = T * top_k alone, which is why retained buffers need no host sync.
LRMOE_HD inline int64_t retained_total(int64_t num_pairs, double recalibration_rate) {
  const int64_t r = robust_floor((1.0 - recalibration_rate) * static_cast<double>(num_pairs));
  return r < 0 ? 0 : (r > num_pairs ? num_pairs : r);
}

// Proportional rule: Q_e = (1 - c) * n_e rounded by largest remainder so that
// sum(Q) = floor((1 - c) * N). Remainder ties go to the lower expert index.
// O(E) per expert, so one expert per thread on the device.
LRMOE_HD inline int64_t proportional_quota(int64_t e, const int32_t* n_E, int64_t E,
                                           double recalibration_rate) {
  const double keep = 1.0 - recalibration_rate;
  int64_t total_pairs = 0, base_sum = 0;
  for (int64_t j = 0; j < E; ++j) {
    total_pairs += n_E[j];
    const int64_t b = robust_floor(keep * n_E[j]);
    base_sum += b < n_E[j] ? b : n_E[j];
  }
  const int64_t extra = retained_total(total_pairs, recalibration_rate) - base_sum;
  int64_t base_e = robust_floor(keep * n_E[e]);
  if (base_e > n_E[e]) base_e = n_E[e];
  if (base_e >= n_E[e]) return base_e;  // nothing left to round up
  const double rem_e = keep * n_E[e] - static_cast<double>(base_e);
  // rank of e among experts that can still take one more pair, by remainder
  // descending, then index ascending
  int64_t rank = 0;
  for (int64_t j = 0; j < E; ++j) {
    int64_t b = robust_floor(keep * n_E[j]);
    if (b > n_E[j]) b = n_E[j];
    if (b >= n_E[j] || j == e) continue;
    const double rem_j = keep * n_E[j] - static_cast<double>(b);
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

// Host helper: all quotas at once (O(E^2 log N); E is at most a few thousand).
inline void compute_quotas(QuotaRule rule, const int32_t* n_E, int64_t E,
                           double recalibration_rate, int32_t* quota_E) {
  for (int64_t e = 0; e < E; ++e)
    quota_E[e] = static_cast<int32_t>(expert_quota(rule, e, n_E, E, recalibration_rate));
}

}  // namespace core
}  // namespace lrmoe
