// Building blocks of `select` shared by the CPU and CUDA kernels, so both paths
// order, sum and sample in exactly the same way (bit-identical results).
//
// Plain C++17 (LRMOE_HD host+device), no torch.
//
// Legend: n rows of one expert, Q its quota, s score, w importance weight,
// p inclusion probability, C prefix sum of p in row order, u the expert's
// systematic-sampling offset in [0, 1), k = 0..Q-1 the sampling points u + k.
#pragma once

#include <cfloat>
#include <cstdint>
#include <cstring>

#include "quota.h"  // LRMOE_HD

namespace lrmoe {
namespace core {

// Sort key: ascending key = descending score. NaN ranks below every number
// (-inf included); -0 and +0 tie (then the lower row wins, as for any tie).
LRMOE_HD inline uint32_t score_order_key(float s) {
  if (s != s) return 0xFFFFFFFFu;
  if (s == 0.0f) s = 0.0f;  // -0 -> +0
  uint32_t u;
#if defined(__CUDA_ARCH__)
  u = __float_as_uint(s);
#else
  std::memcpy(&u, &s, sizeof(u));
#endif
  const uint32_t ascending = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return ~ascending;
}

// Importance weight of a score: negatives, zeros and NaN weigh 0; +inf is
// clamped to FLT_MAX so every sum stays finite in double.
LRMOE_HD inline double importance_weight(float s) {
  if (!(s > 0.0f)) return 0.0;
  return s > FLT_MAX ? static_cast<double>(FLT_MAX) : static_cast<double>(s);
}

// The canonical summation order of the per-expert prefix sums. A sequence of
// n values is cut into kScanLanes chunks of chunk_len(n) (the last ones
// shorter or empty). Chunk l has total t_l (summed left to right from 0.0) and
// base b_l = ((0 + t_0) + t_1) + ... + t_{l-1}; element i of chunk l gets
// b_l + (x_lo + ... + x_i) (the local sum from 0.0, left to right). The CUDA
// kernel runs one warp lane per chunk; the CPU loops emulate the lanes. The
// result is non-decreasing for non-negative x (the last value of chunk l equals
// b_{l+1}, and fl(b + x) is monotone in x).
constexpr int kScanLanes = 32;

LRMOE_HD inline int64_t scan_chunk_len(int64_t n) { return (n + kScanLanes - 1) / kScanLanes; }

// First index i in [0, n) with C[i] > x (n if none); C non-decreasing. Also
// finds the expert owning a row or slot in inclusive ends (int32 C, int64 x).
template <typename T, typename X>
LRMOE_HD inline int64_t first_above(const T* C, int64_t n, X x) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (C[mid] > x) hi = mid; else lo = mid + 1;
  }
  return lo;
}

// Systematic sampling, one point per kept slot: point k = u + k selects the
// first row whose prefix sum exceeds it. In exact arithmetic these rows are
// distinct and increasing; rounding may (very rarely) repeat a row or run off
// the end. The repair keeps exactly Q distinct increasing rows and changes
// nothing when there is no such glitch:
//   j_k = min(first_above(C, n, u + k), n - 1),  d_k = j_k - k,
//   row_k = min(k + max_{l <= k} d_l, n - Q + k).
// sample_point gives j_k - k (the prefix maximum of it is a scan on the GPU);
// sample_row applies the final clamp to that prefix maximum.
LRMOE_HD inline int64_t sample_point(const double* C, int64_t n, double u, int64_t k) {
  int64_t j = first_above(C, n, u + static_cast<double>(k));
  if (j > n - 1) j = n - 1;
  return j - k;
}

LRMOE_HD inline int64_t sample_row(int64_t prefix_max_d, int64_t n, int64_t Q, int64_t k) {
  const int64_t a = k + prefix_max_d, b = n - Q + k;
  return a < b ? a : b;
}

// The kept scale 1/p (p > 0); a row with p == 0 can only be kept through the
// repair above and then gets scale 1, so no inf reaches a gradient.
LRMOE_HD inline float inverse_probability(double p) {
  return p > 0.0 ? static_cast<float>(1.0 / p) : 1.0f;
}

// How one expert's Q slots are spread over its n rows (npos of them weigh > 0):
//   kZero:  npos <= Q: positives p = 1, zero-weight rows share the remaining
//           Q - npos slots uniformly (pz).
//   kWater: npos > Q: water-filling, the m_star best rows capped at 1, the
//           rest lambda * w, with sum p = Q (m_star, T_m from water_level_feasible).
enum class ImportanceMode : int { kZero = 1, kWater = 2 };

struct ImportancePlan {
  ImportanceMode mode;
  int64_t m_star;
  double lambda;
  double pz;
};

LRMOE_HD inline ImportancePlan zero_weight_plan(int64_t n, int64_t npos, int64_t Q) {
  const double pz = n > npos ? static_cast<double>(Q - npos) / static_cast<double>(n - npos) : 0.0;
  return {ImportanceMode::kZero, 0, 0.0, pz};
}

LRMOE_HD inline ImportancePlan water_plan(int64_t m_star, int64_t Q, double T_m_star) {
  return {ImportanceMode::kWater, m_star, static_cast<double>(Q - m_star) / T_m_star, 0.0};
}

// Inclusion probability of the expert's j-th best row (0-based, weight w).
LRMOE_HD inline double inclusion_probability(const ImportancePlan& plan, int64_t j, double w) {
  if (plan.mode == ImportanceMode::kZero) return w > 0.0 ? 1.0 : plan.pz;
  if (j < plan.m_star) return 1.0;
  const double v = plan.lambda * w;
  return v < 1.0 ? v : 1.0;
}

// Water-filling test at the m-th best row: with T_m = sum of weights from
// position m on (canonical order over the reversed sorted weights), rows
// before m capped at 1 leave lambda = (Q - m) / T_m, feasible iff
// lambda * w_m <= 1. m_star is the smallest feasible m in [0, Q); m = Q - 1 is
// always feasible since T_{Q-1} >= w_{Q-1}.
LRMOE_HD inline bool water_level_feasible(double w_m, int64_t m, int64_t Q, double T_m) {
  return w_m * static_cast<double>(Q - m) <= T_m;
}

}  // namespace core
}  // namespace lrmoe
