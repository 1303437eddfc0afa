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

// Bits of x's binary length (0 for x = 0), without a loop per bit.
inline int32_t bit_length(uint64_t x) {
  int32_t bits = 0;
  for (int32_t step = 32; step > 0; step >>= 1)
    if (x >> step) {
      x >>= step;
      bits += step;
    }
  return bits + static_cast<int32_t>(x);
}

}  // namespace

void largest_remainder(int64_t total, const int64_t* w, int32_t n, int64_t* out) {
  // scratch on the stack for the usual sizes (n <= 128 sources or instances), else kept
  // per thread: this runs once per (expert, instance) of every plan, and the divisions
  // are most of a plan's time (hence floor_div)
  constexpr int32_t kStack = 128;
  int64_t rem_stack[kStack];
  int32_t idx_stack[kStack], cand_stack[kStack];
  thread_local std::vector<int64_t> rem_heap;
  thread_local std::vector<int32_t> idx_heap, cand_heap;
  int64_t* rem = rem_stack;
  int32_t* idx = idx_stack;
  int32_t* cand = cand_stack;
  if (n > kStack) {
    rem_heap.resize(static_cast<size_t>(n));
    idx_heap.resize(static_cast<size_t>(n));
    cand_heap.resize(static_cast<size_t>(n));
    rem = rem_heap.data();
    idx = idx_heap.data();
    cand = cand_heap.data();
  }
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
  // the entries with weight: one of weight 0 gets 0 and no remainder, so skipping it
  // changes nothing (a replica's row of an expert's cells is mostly 0)
  int32_t m = 0;
  for (int32_t i = 0; i < n; ++i) {
    idx[m] = i;
    m += w[i] != 0;
    out[i] = 0;
  }
  // the remainders (total w[i]) mod sum < sum, counted by their top kBits bits: every
  // remainder of a higher bucket is larger than every one of a lower bucket, so the
  // `extra` largest are the buckets above a threshold bucket plus the largest of it
  // (a selection over the few remainders of one bucket, not over all: nth_element's
  // mispredicted branches were most of this function's time)
  constexpr int32_t kBits = 6;
  const int32_t shift = std::max(0, bit_length(static_cast<uint64_t>(sum - 1)) - kBits);
  int32_t count[1 << kBits] = {};
  int64_t given = 0;
  const double inv_sum = 1.0 / static_cast<double>(sum);
  for (int32_t k = 0; k < m; ++k) {
    const int32_t i = idx[k];
    const int64_t num = total * w[i];
    const int64_t q = floor_div(num, sum, inv_sum);
    const int64_t r = num - q * sum;
    out[i] = q;
    rem[k] = r;
    given += q;
    count[r >> shift] += r != 0;
  }
  int64_t extra = total - given;  // < the entries with a remainder
  if (extra <= 0) return;
  int32_t t = (1 << kBits) - 1;
  while (t > 0 && count[t] < extra) extra -= count[t--];
  int32_t c = 0;
  for (int32_t k = 0; k < m; ++k) {  // branch-free where the outcome is a coin flip
    const int64_t b = rem[k] >> shift;
    const int64_t any = rem[k] != 0;
    out[idx[k]] += any & static_cast<int64_t>(b > t);
    if (b == t && any) cand[c++] = k;
  }
  // the threshold bucket's `extra` largest remainders, ties to the lower index
  // (candidates are in index order)
  if (extra > c) extra = c;  // only for totals outside [0, sum(w)]
  if (extra < c) {
    auto before = [&](int32_t a, int32_t b) { return rem[a] > rem[b] || (rem[a] == rem[b] && a < b); };
    std::nth_element(cand, cand + (extra - 1), cand + c, before);
  }
  for (int64_t k = 0; k < extra; ++k) out[idx[cand[k]]] += 1;
}

void split_forward(const int64_t* L_W, int32_t W, const int32_t* rank_n,
                   const int64_t* quota_n, int32_t n, int64_t* F_nW,
                   int32_t gpus_per_node, bool spare) {
  if (n == 1) {  // one instance with room for every row (what experts without a
    // replica are): each pass would take each source's rows whole
    int64_t sum = 0;
    for (int32_t s = 0; s < W; ++s) sum += L_W[s];
    if (quota_n[0] >= sum) {
      std::copy(L_W, L_W + W, F_nW);
      return;
    }
  }
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
  // north-west corner, the counts in registers (through the scratch vectors every step
  // waited on the previous one's store)
  int32_t i = 0;
  int64_t need = n > 0 ? need_n[0] : 0;
  for (int32_t s = 0; s < W && i < n; ++s) {
    int64_t left = left_W[s];
    while (left > 0 && i < n) {
      const int64_t take = std::min(left, need);
      F_nW[static_cast<int64_t>(i) * W + s] += take;
      left -= take;
      need -= take;
      if (need == 0 && ++i < n) need = need_n[i];
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
