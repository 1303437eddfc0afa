// UltraEP refinement passes (ultraep_refine.h).
#include "planner/ultraep_refine.h"

#include <algorithm>
#include <limits>

namespace lrmoe {
namespace planner {
namespace detail {

int64_t ultraep_refine(const PlanInput& in, const std::vector<int64_t>& n_E,
                       std::vector<Replica>* exports) {
  const int32_t W = in.num_ranks, E = in.num_experts;
  const int32_t G = node_size(in);
  const int64_t umin = in.min_replica_rows;
  std::vector<Replica>& X = *exports;
  // inst_EW[e * W + j]: -2 none, -1 the owner, else the index into X
  std::vector<int32_t> inst_EW(static_cast<size_t>(E) * W, -2);
  std::vector<int64_t> owner_rows(n_E), load(static_cast<size_t>(W), 0);
  std::vector<int32_t> free_slots(static_cast<size_t>(W), in.replica_slots);
  for (int32_t e = 0; e < E; ++e) inst_EW[static_cast<size_t>(e) * W + fixed_owner(e, E, W)] = -1;
  for (size_t k = 0; k < X.size(); ++k) {
    inst_EW[static_cast<size_t>(X[k].expert) * W + X[k].rank] = static_cast<int32_t>(k);
    owner_rows[X[k].expert] -= X[k].rows;
    load[X[k].rank] += X[k].rows;
    free_slots[X[k].rank] -= 1;
  }
  for (int32_t e = 0; e < E; ++e) load[fixed_owner(e, E, W)] += owner_rows[e];
  auto rows_at = [&](int32_t e, int32_t j) -> int64_t& {
    const int32_t k = inst_EW[static_cast<size_t>(e) * W + j];
    return k == -1 ? owner_rows[e] : X[k].rows;
  };

  int64_t moves = 0;
  const int64_t guard = 64 * (static_cast<int64_t>(E) + W) + 1024;
  for (; moves < guard;) {
    int32_t rs = 0;
    for (int32_t r = 1; r < W; ++r)
      if (load[r] > load[rs]) rs = r;
    const int64_t T = load[rs];
    int64_t best_value = T, best_x = 0;
    int32_t best_e = -1, best_j = -1;
    bool best_fresh = true, best_far = true;
    for (int32_t e = 0; e < E; ++e) {
      const int32_t here = inst_EW[static_cast<size_t>(e) * W + rs];
      if (here == -2) continue;
      const int64_t avail = rows_at(e, rs) - (here == -1 ? 1 : umin);
      if (avail <= 0) continue;
      for (int32_t j = 0; j < W; ++j) {
        if (j == rs) continue;
        const bool fresh = inst_EW[static_cast<size_t>(e) * W + j] == -2;
        if (fresh && free_slots[j] <= 0) continue;
        const int64_t x = std::min((T - load[j]) / 2, avail);
        if (x < (fresh ? umin : 1)) continue;
        const int64_t value = std::max(T - x, load[j] + x);
        const bool far = j / G != rs / G;
        const bool better = value != best_value ? value < best_value
                            : fresh != best_fresh ? !fresh
                            : far != best_far     ? !far
                                                  : false;  // then the first found: lower e, j
        if (better) {
          best_value = value; best_x = x; best_e = e; best_j = j;
          best_fresh = fresh; best_far = far;
        }
      }
    }
    if (best_e < 0 || best_value >= T) break;
    if (best_fresh) {
      inst_EW[static_cast<size_t>(best_e) * W + best_j] = static_cast<int32_t>(X.size());
      X.push_back({best_e, best_j, 0});
      free_slots[best_j] -= 1;
    }
    rows_at(best_e, rs) -= best_x;
    rows_at(best_e, best_j) += best_x;
    load[rs] -= best_x;
    load[best_j] += best_x;
    ++moves;
  }
  return moves;
}

}  // namespace detail
}  // namespace planner
}  // namespace lrmoe
