// Capacity-aware routing of one expert's rows (route.h states the rules).
#include "planner/route.h"

#include <algorithm>
#include <vector>

namespace lrmoe {
namespace planner {

void largest_remainder(int64_t total, const int64_t* w, int32_t n, int64_t* out) {
  int64_t sum = 0;
  for (int32_t i = 0; i < n; ++i) sum += w[i];
  if (sum <= 0) {  // total must be 0 then
    for (int32_t i = 0; i < n; ++i) out[i] = 0;
    return;
  }
  int64_t given = 0;
  for (int32_t i = 0; i < n; ++i) {
    out[i] = total * w[i] / sum;
    given += out[i];
  }
  int64_t extra = total - given;  // < number of entries with a remainder
  if (extra <= 0) return;
  // scratch kept per thread: this runs once per (expert, instance) of every plan
  thread_local std::vector<int32_t> order;
  order.clear();
  for (int32_t i = 0; i < n; ++i)
    if (total * w[i] % sum != 0) order.push_back(i);
  auto before = [&](int32_t a, int32_t b) {
    const int64_t ra = total * w[a] % sum, rb = total * w[b] % sum;
    return ra > rb || (ra == rb && a < b);
  };
  if (static_cast<int64_t>(order.size()) > extra)
    std::nth_element(order.begin(), order.begin() + (extra - 1), order.end(), before);
  for (int64_t k = 0; k < extra; ++k) out[order[static_cast<size_t>(k)]] += 1;
}

void split_forward(const int64_t* L_W, int32_t W, const int32_t* rank_n,
                   const int64_t* quota_n, int32_t n, int64_t* F_nW) {
  thread_local std::vector<int64_t> left_W, need_n;
  left_W.assign(L_W, L_W + W);
  need_n.assign(quota_n, quota_n + n);
  std::fill(F_nW, F_nW + static_cast<int64_t>(n) * W, int64_t(0));
  for (int32_t i = 0; i < n; ++i) {  // locality: rows whose source is the instance's rank
    const int32_t s = rank_n[i];
    const int64_t take = std::min(left_W[s], need_n[i]);
    F_nW[static_cast<int64_t>(i) * W + s] += take;
    left_W[s] -= take;
    need_n[i] -= take;
  }
  int32_t i = 0;
  for (int32_t s = 0; s < W; ++s) {
    while (left_W[s] > 0 && i < n) {
      const int64_t take = std::min(left_W[s], need_n[i]);
      F_nW[static_cast<int64_t>(i) * W + s] += take;
      left_W[s] -= take;
      need_n[i] -= take;
      if (need_n[i] == 0) ++i;
    }
  }
}

int64_t split_over_instances(int64_t quota, const int64_t* f_n, const int64_t* room_n,
                             int32_t n, int64_t* b_n) {
  thread_local std::vector<int64_t> cap_n, slack_n, add_n;
  cap_n.resize(static_cast<size_t>(n));
  int64_t cap_sum = 0;
  for (int32_t i = 0; i < n; ++i) {
    cap_n[i] = std::max<int64_t>(0, std::min(f_n[i], room_n[i]));
    cap_sum += cap_n[i];
  }
  if (cap_sum <= quota) {
    for (int32_t i = 0; i < n; ++i) b_n[i] = cap_n[i];
    return quota - cap_sum;
  }
  largest_remainder(quota, f_n, n, b_n);  // quota <= sum(cap) <= sum(f)
  int64_t over = 0, slack_sum = 0;
  slack_n.assign(static_cast<size_t>(n), 0);
  for (int32_t i = 0; i < n; ++i) {
    if (b_n[i] > cap_n[i]) {
      over += b_n[i] - cap_n[i];
      b_n[i] = cap_n[i];
    } else {
      slack_n[i] = cap_n[i] - b_n[i];
      slack_sum += slack_n[i];
    }
  }
  if (over == 0) return 0;
  // over <= slack_sum because sum(cap) >= quota; shares <= slack, so one pass suffices
  add_n.resize(static_cast<size_t>(n));
  largest_remainder(over, slack_n.data(), n, add_n.data());
  for (int32_t i = 0; i < n; ++i) b_n[i] += add_n[i];
  return 0;
}

void split_cells(const int64_t* b_n, const int64_t* F_nW, int32_t n, int32_t W, int64_t* B_nW) {
  for (int32_t i = 0; i < n; ++i)
    largest_remainder(b_n[i], F_nW + static_cast<int64_t>(i) * W, W,
                      B_nW + static_cast<int64_t>(i) * W);
}

}  // namespace planner
}  // namespace lrmoe
