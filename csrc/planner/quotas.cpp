// All quotas at once: see quotas.h for why this exists beside csrc/core/quota.h.
#include "planner/quotas.h"

#include <algorithm>
#include <numeric>
#include <vector>

namespace lrmoe {
namespace planner {
namespace {

// Proportional: Q_e = floor(keep n_e / q) plus one for the `extra` experts with the
// largest remainders (keep n_e) mod q, ties to the lower index (core::proportional_quota).
void proportional(const int64_t* n_E, int64_t E, double c, int64_t* quota_E) {
  const core::RateFraction f = core::rate_fraction(c);
  const int64_t keep = f.q - f.p;
  int64_t total = 0, base_sum = 0;
  std::vector<int32_t> order;
  order.reserve(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) {
    total += n_E[e];
    quota_E[e] = keep * n_E[e] / f.q;
    base_sum += quota_E[e];
    if (keep * n_E[e] % f.q != 0) order.push_back(static_cast<int32_t>(e));
  }
  const int64_t extra = keep * total / f.q - base_sum;  // < order.size()
  if (extra <= 0) return;
  auto rem = [&](int32_t e) { return keep * n_E[e] % f.q; };
  std::nth_element(order.begin(), order.begin() + (extra - 1), order.end(),
                   [&](int32_t a, int32_t b) {
                     const int64_t ra = rem(a), rb = rem(b);
                     return ra > rb || (ra == rb && a < b);
                   });
  for (int64_t k = 0; k < extra; ++k) quota_E[order[static_cast<size_t>(k)]] += 1;
}

// Water level: the largest level L in [0, max n] with sum_e min(n_e, L) <= S, S =
// retained_total; Q_e = min(n_e, L), then one more for the S - filled experts above
// L, most loaded first, ties to the lower index (core::water_level_quota).
void water_level(const int64_t* n_E, int64_t E, double c, int64_t* quota_E) {
  std::vector<int32_t> order(static_cast<size_t>(E));
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return n_E[a] > n_E[b] || (n_E[a] == n_E[b] && a < b);
  });
  int64_t total = 0;
  for (int64_t e = 0; e < E; ++e) total += n_E[e];
  const int64_t target = core::retained_total(total, c);
  // Walk the loads ascending (order reversed): with prefix = sum of loads below v_k and
  // m = E - k loads at or above it, filled(L) = prefix + L m for L in (v_{k-1}, v_k].
  int64_t level = E > 0 ? n_E[order[0]] : 0, prefix = 0;
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
    quota_E[e] = std::min(n_E[e], level);
    filled += quota_E[e];
  }
  int64_t extra = target - filled;
  for (int64_t k = 0; k < E && extra > 0; ++k, --extra) {
    const int32_t e = order[static_cast<size_t>(k)];
    if (n_E[e] <= level) break;
    quota_E[e] += 1;
  }
}

}  // namespace

void all_quotas(core::QuotaRule rule, const int64_t* n_E, int64_t E, double recalibration_rate,
                int64_t* quota_E) {
  if (rule == core::QuotaRule::kWaterLevel)
    water_level(n_E, E, recalibration_rate, quota_E);
  else
    proportional(n_E, E, recalibration_rate, quota_E);
}

}  // namespace planner
}  // namespace lrmoe
