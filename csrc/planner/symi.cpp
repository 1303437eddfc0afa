// SYMI (arXiv 2504.19925): S expert slots per GPU, replica counts proportional to the
// previous step's popularity, tokens split evenly over an expert's instances, each
// expert's optimizer state sharded over all ranks. docs/planner.md, "symi".
//
//   r_e = largest remainder of S W P_e / sum(P)   (sum r = S W; P: previous loads)
//   then r_e <= W (one instance per GPU: the overflow is re-dealt over the others in
//   proportion to P) and r_e >= 1 (an expert at 0 takes a slot from the expert with
//   the most instances, lower index on ties).
//   Placement: experts by r_e descending; each instance on a distinct GPU with a free
//   slot, least placed load first (load = P_e / r_e per instance); if that greedy
//   strands an expert, the GPUs with the most free slots first (always succeeds:
//   sum r = S W and r_e <= W).
//
// Backward exact (Q_e = n_e). Memory per rank: S slots of weights + grads (ceil(E/W)
// of them counted as base experts, the rest as replicas) and E x optimizer / W (the
// sharded optimizer, where it lives on the device).
#include <algorithm>
#include <numeric>

#include "planner/common.h"
#include "planner/policies.h"
#include "planner/route.h"

namespace lrmoe {
namespace planner {
namespace {

// Instances per expert (see the file comment). P_E >= 0; slots = S W, E <= slots <= E W.
std::vector<int64_t> replica_counts(const std::vector<int64_t>& P_E, int64_t slots, int32_t W) {
  const int32_t E = static_cast<int32_t>(P_E.size());
  std::vector<int64_t> r_E(static_cast<size_t>(E), 0);
  std::vector<int64_t> w_E(P_E);
  if (std::accumulate(w_E.begin(), w_E.end(), int64_t(0)) == 0) std::fill(w_E.begin(), w_E.end(), 1);
  largest_remainder(slots, w_E.data(), E, r_E.data());
  // cap at W, re-deal the overflow over the uncapped experts in proportion to P
  for (;;) {
    int64_t over = 0;
    std::vector<int64_t> open_w(static_cast<size_t>(E), 0);
    for (int32_t e = 0; e < E; ++e) {
      if (r_E[e] >= W) {
        over += r_E[e] - W;
        r_E[e] = W;
      } else {
        open_w[e] = w_E[e];
      }
    }
    if (over == 0) break;
    if (std::accumulate(open_w.begin(), open_w.end(), int64_t(0)) == 0)
      for (int32_t e = 0; e < E; ++e) open_w[e] = r_E[e] < W ? 1 : 0;
    std::vector<int64_t> add(static_cast<size_t>(E), 0);
    largest_remainder(over, open_w.data(), E, add.data());
    for (int32_t e = 0; e < E; ++e) r_E[e] += add[e];
  }
  // every expert keeps at least one instance
  for (int32_t e = 0; e < E; ++e) {
    if (r_E[e] > 0) continue;
    const int32_t donor = static_cast<int32_t>(std::max_element(r_E.begin(), r_E.end()) - r_E.begin());
    r_E[donor] -= 1;
    r_E[e] = 1;
  }
  return r_E;
}

// Ranks of each expert's instances into rank_I (expert e at offsets[e]...); false
// when the least-load greedy strands an expert.
bool place(const std::vector<int64_t>& r_E, const std::vector<int64_t>& unit_E,
           const std::vector<int32_t>& order, int32_t W, int32_t S, bool most_free_first,
           const std::vector<int32_t>& offsets, std::vector<int32_t>* rank_I) {
  std::vector<int32_t> free_W(static_cast<size_t>(W), S);
  std::vector<int64_t> load_W(static_cast<size_t>(W), 0);
  auto before = [&](int32_t a, int32_t b) {
    if (most_free_first && free_W[a] != free_W[b]) return free_W[a] > free_W[b];
    if (load_W[a] != load_W[b]) return load_W[a] < load_W[b];
    return a < b;
  };
  // the GPUs with a free slot, kept sorted by `before` (a strict order: the index is
  // the last key): an expert's r_e instances go to the first r_e, and only those change
  // their keys, so they alone move (selecting r_e minima of a fresh list per expert
  // was r_e scans of W)
  std::vector<int32_t> cand(static_cast<size_t>(W));
  std::iota(cand.begin(), cand.end(), 0);
  if (S <= 0) cand.clear();
  std::sort(cand.begin(), cand.end(), before);
  std::vector<int32_t> picked;
  for (int32_t e : order) {
    if (static_cast<int64_t>(cand.size()) < r_E[e]) return false;
    picked.assign(cand.begin(), cand.begin() + r_E[e]);
    cand.erase(cand.begin(), cand.begin() + r_E[e]);
    for (int64_t k = 0; k < r_E[e]; ++k) {
      const int32_t r = picked[static_cast<size_t>(k)];
      (*rank_I)[offsets[e] + k] = r;
      free_W[r] -= 1;
      load_W[r] += unit_E[e];
    }
    for (int32_t r : picked)
      if (free_W[r] > 0) cand.insert(std::lower_bound(cand.begin(), cand.end(), r, before), r);
  }
  return true;
}

class SymiPolicy final : public Policy {
 public:
  PolicyKind kind() const override { return PolicyKind::kSymi; }
  const char* name() const override { return "symi"; }

  Plan plan(const PlanInput& in) const override {
    detail::validate(in, kind());
    const int32_t W = in.num_ranks, E = in.num_experts;
    const int32_t per = (E + W - 1) / W;
    const int32_t S = in.symi_slots > 0 ? in.symi_slots : std::min(E, per + in.replica_slots);
    const std::vector<int64_t> n_E = detail::expert_loads(in);
    const std::vector<int64_t>& P_E = in.previous_load_E.empty() ? n_E : in.previous_load_E;
    const std::vector<int64_t> r_E = replica_counts(P_E, int64_t(S) * W, W);

    // per-instance load in fixed point (integers: every rank places identically)
    std::vector<int64_t> unit_E(static_cast<size_t>(E));
    for (int32_t e = 0; e < E; ++e) unit_E[e] = (P_E[e] << 10) / r_E[e];
    std::vector<int32_t> order(static_cast<size_t>(E));
    std::iota(order.begin(), order.end(), 0);
    // the order of a stable sort on (r, unit), with the index as the last key: std::sort
    // without stable_sort's buffer allocation (a sixth of the plan time at E = 128)
    std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
      if (r_E[a] != r_E[b]) return r_E[a] > r_E[b];
      if (unit_E[a] != unit_E[b]) return unit_E[a] > unit_E[b];
      return a < b;
    });
    detail::Layout lay;
    lay.offsets.assign(static_cast<size_t>(E) + 1, 0);
    for (int32_t e = 0; e < E; ++e) lay.offsets[e + 1] = lay.offsets[e] + static_cast<int32_t>(r_E[e]);
    lay.rank.resize(static_cast<size_t>(lay.offsets[E]));
    lay.rows.resize(static_cast<size_t>(lay.offsets[E]));
    if (!place(r_E, unit_E, order, W, S, false, lay.offsets, &lay.rank))
      place(r_E, unit_E, order, W, S, true, lay.offsets, &lay.rank);
    // even split of the current load over the instances
    const std::vector<int64_t> ones(static_cast<size_t>(W), 1);
    for (int32_t e = 0; e < E; ++e)
      largest_remainder(n_E[e], ones.data(), static_cast<int32_t>(r_E[e]),
                        lay.rows.data() + lay.offsets[e]);
    const MemoryModel& m = in.memory;
    const int64_t copy = m.expert_weight_bytes + m.expert_grad_bytes;
    const int64_t optimizer = m.optimizer_on_device ? (m.expert_optimizer_bytes * E + W - 1) / W : 0;
    detail::RankBytes bytes;
    bytes.base_W.assign(static_cast<size_t>(W), copy * per + optimizer);
    bytes.replica_W.assign(static_cast<size_t>(W), copy * (S - per));
    return detail::assemble(in, kind(), lay, n_E, bytes, false);
  }
};

}  // namespace

std::unique_ptr<Policy> make_symi_policy() { return std::make_unique<SymiPolicy>(); }

}  // namespace planner
}  // namespace lrmoe
