// Capacity-aware routing of one expert's rows (route.h states the rules).
#include "planner/route.h"

#include <algorithm>
#include <vector>

namespace lrmoe {
namespace planner {
namespace {

// floor(num / den) for 0 <= num < 2^62 and den > 0: a double estimate (relative error
// 2^-52, so off by at most a few units) corrected with exact integer steps. Same
// result as num / den, about ten times cheaper than a 64-bit division.
inline int64_t floor_div(int64_t num, int64_t den, double inv_den) {
  int64_t q = static_cast<int64_t>(static_cast<double>(num) * inv_den);
  int64_t r = num - q * den;
  while (r < 0) { --q; r += den; }
  while (r >= den) { ++q; r -= den; }
  return q;
}

}  // namespace

void largest_remainder(int64_t total, const int64_t* w, int32_t n, int64_t* out) {
  int64_t sum = 0;
  for (int32_t i = 0; i < n; ++i) sum += w[i];
  if (sum <= 0 || total == 0) {  // total must be 0 when sum is
    for (int32_t i = 0; i < n; ++i) out[i] = 0;
    return;
  }
  if (total == sum) {  // everything kept (every baseline, c = 0): no division needed
    for (int32_t i = 0; i < n; ++i) out[i] = w[i];
    return;
  }
  // scratch on the stack for the usual sizes (n <= 128 sources or instances), else kept
  // per thread: this runs once per (expert, instance) of every plan, and the divisions
  // are most of a plan's time (hence floor_div)
  constexpr int32_t kStack = 128;
  int64_t rem_stack[kStack];
  int32_t order_stack[kStack];
  thread_local std::vector<int64_t> rem_heap;
  thread_local std::vector<int32_t> order_heap;
  int64_t* rem = rem_stack;
  int32_t* order = order_stack;
  if (n > kStack) {
    rem_heap.resize(static_cast<size_t>(n));
    order_heap.resize(static_cast<size_t>(n));
    rem = rem_heap.data();
    order = order_heap.data();
  }
  int32_t with_rem = 0;
  int64_t given = 0;
  const double inv_sum = 1.0 / static_cast<double>(sum);
  for (int32_t i = 0; i < n; ++i) {
    const int64_t num = total * w[i];
    out[i] = floor_div(num, sum, inv_sum);
    rem[i] = num - out[i] * sum;
    given += out[i];
    if (rem[i] != 0) order[with_rem++] = i;
  }
  const int64_t extra = total - given;  // < with_rem
  if (extra <= 0) return;
  auto before = [&](int32_t a, int32_t b) { return rem[a] > rem[b] || (rem[a] == rem[b] && a < b); };
  if (with_rem > extra) std::nth_element(order, order + (extra - 1), order + with_rem, before);
  for (int64_t k = 0; k < extra; ++k) out[order[k]] += 1;
}

void split_forward(const int64_t* L_W, int32_t W, const int32_t* rank_n,
                   const int64_t* quota_n, int32_t n, int64_t* F_nW,
                   int32_t gpus_per_node, bool spare) {
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
  if (gpus_per_node > 0 && gpus_per_node < W && n > 1) {  // same node before the network
    for (int32_t s = 0; s < W; ++s)
      for (int32_t i = 0; i < n && left_W[s] > 0; ++i) {
        if (rank_n[i] / gpus_per_node != s / gpus_per_node) continue;
        const int64_t take = std::min(left_W[s], need_n[i]);
        F_nW[static_cast<int64_t>(i) * W + s] += take;
        left_W[s] -= take;
        need_n[i] -= take;
      }
  }
  if (spare && n > 1) {
    thread_local std::vector<int64_t> add_n;
    add_n.resize(static_cast<size_t>(n));
    for (int32_t s = 0; s < W; ++s) {
      if (left_W[s] == 0) continue;
      largest_remainder(left_W[s], need_n.data(), n, add_n.data());
      for (int32_t k = 0; k < n; ++k) {
        F_nW[static_cast<int64_t>(k) * W + s] += add_n[k];
        need_n[k] -= add_n[k];
      }
      left_W[s] = 0;
    }
    return;
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
