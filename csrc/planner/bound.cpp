// rows_lower_bound (bound.h): the counting bound on the max rows per rank.
#include "planner/bound.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace lrmoe {
namespace planner {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// (c) at T > 0: the spare instances the demands need at T rows per rank, stopping once
// over X (the sum can only grow)
bool spares_fit(const std::vector<int64_t>& d_E, int64_t T, int64_t X) {
  int64_t need = 0;
  for (int64_t d : d_E) {
    if (d > T) need += ceil_div(d, T) - 1;
    if (need > X) return false;
  }
  return true;
}

}  // namespace

int64_t rows_lower_bound(const std::vector<int64_t>& d_E, int32_t W, int64_t X) {
  if (W < 1) throw std::invalid_argument("rows_lower_bound: W must be >= 1, got " + std::to_string(W));
  if (X < 0) throw std::invalid_argument("rows_lower_bound: spare instances X must be >= 0, got " + std::to_string(X));
  int64_t total = 0, top = 0;
  for (int64_t d : d_E) {
    if (d < 0) throw std::invalid_argument("rows_lower_bound: demands must be >= 0, got " + std::to_string(d));
    total += d;
    top = std::max(top, d);
  }
  if (total == 0) return 0;
  // (a) and (b); any T >= top satisfies (c) with no spare instance at all
  int64_t lo = std::max(ceil_div(total, W), ceil_div(top, W));
  int64_t hi = top;
  if (lo >= hi || spares_fit(d_E, lo, X)) return lo;
  // (c) is monotone in T: the smallest T in (lo, hi] where it holds
  while (lo + 1 < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (spares_fit(d_E, mid, X)) hi = mid; else lo = mid;
  }
  return hi;
}

int64_t spare_instances(const PlanInput& in) {
  const int64_t W = in.num_ranks, E = in.num_experts;
  const int64_t R = std::max<int32_t>(0, in.replica_slots);
  int64_t S = in.symi_slots > 0 ? in.symi_slots : std::min(E, (E + W - 1) / W + R);
  S = std::min(S, E);  // a GPU holds at most one instance of each expert
  return std::max(R * W, std::max<int64_t>(0, S * W - E));
}

}  // namespace planner
}  // namespace lrmoe
