// exact_optimum (exact.h): branch and bound over placements with a max-flow check.
#include "planner/exact.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "planner/bound.h"
#include "planner/common.h"

namespace lrmoe {
namespace planner {
namespace {

constexpr int64_t kInf = std::numeric_limits<int64_t>::max() / 4;
constexpr int kMaxRanks = 8, kMaxExperts = 16, kMaxSpareSlots = 2;

[[noreturn]] void fail(const std::string& msg) { throw std::invalid_argument("exact_optimum: " + msg); }

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Dinic's max-flow on a graph of a few dozen nodes (rebuilt at every placement).
class MaxFlow {
 public:
  explicit MaxFlow(int n) : head_(n, -1), level_(n), it_(n) {}
  int add(int u, int v, int64_t c) {  // returns the edge's index
    to_.push_back(v); cap_.push_back(c); next_.push_back(head_[u]); head_[u] = int(to_.size()) - 1;
    to_.push_back(u); cap_.push_back(0); next_.push_back(head_[v]); head_[v] = int(to_.size()) - 1;
    return int(to_.size()) - 2;
  }
  int64_t run(int s, int t) {
    int64_t flow = 0;
    while (bfs(s, t)) {
      it_ = head_;
      while (int64_t f = push(s, t, kInf)) flow += f;
    }
    return flow;
  }
  // after run(): nodes reachable from s in the residual graph (the source side of a min cut)
  std::vector<char> reachable(int s) {
    bfs(s, -1);
    std::vector<char> r(head_.size());
    for (size_t v = 0; v < head_.size(); ++v) r[v] = level_[v] >= 0;
    return r;
  }
  int64_t flow_on(int edge) const { return cap_[edge ^ 1]; }

 private:
  bool bfs(int s, int t) {
    std::fill(level_.begin(), level_.end(), -1);
    std::vector<int> q{s};
    level_[s] = 0;
    for (size_t k = 0; k < q.size(); ++k)
      for (int e = head_[q[k]]; e >= 0; e = next_[e])
        if (cap_[e] > 0 && level_[to_[e]] < 0) {
          level_[to_[e]] = level_[q[k]] + 1;
          q.push_back(to_[e]);
        }
    return t >= 0 && level_[t] >= 0;
  }
  int64_t push(int u, int t, int64_t f) {
    if (u == t) return f;
    for (int& e = it_[u]; e >= 0; e = next_[e]) {
      const int v = to_[e];
      if (cap_[e] <= 0 || level_[v] != level_[u] + 1) continue;
      if (int64_t got = push(v, t, std::min(f, cap_[e]))) {
        cap_[e] -= got;
        cap_[e ^ 1] += got;
        return got;
      }
    }
    return 0;
  }
  std::vector<int> head_, level_, it_, to_, next_;
  std::vector<int64_t> cap_;
};

struct Key {  // a placement: W masks of 16 bits packed into 128 bits
  uint64_t lo = 0, hi = 0;
  bool operator==(const Key& o) const { return lo == o.lo && hi == o.hi; }
};
struct KeyHash {
  size_t operator()(const Key& k) const { return std::hash<uint64_t>()(k.lo * 0x9E3779B97F4A7C15ull ^ k.hi); }
};

class Search {
 public:
  explicit Search(const ExactInput& in) : in_(in), W_(in.num_ranks), E_(in.num_experts) {
    mask_.assign(W_, 0);
    inst_.assign(E_, 0);
    reps_.assign(W_, 0);
    total_ = std::accumulate(in.demand_E.begin(), in.demand_E.end(), int64_t(0));
    if (in.model == PlacementModel::kOwners)
      for (int e = 0; e < E_; ++e) hold(e, detail::fixed_owner(e, E_, W_), false);
  }

  // rows rank r may compute holding k replicas (its memory); -1: the copies do not fit
  int64_t memory_rows(int k) const {
    if (in_.row_bytes <= 0) return kInf;
    const int64_t left = in_.limit_bytes - in_.base_bytes - k * in_.replica_bytes;
    return left < 0 ? -1 : left / in_.row_bytes;
  }
  int64_t cap(int r, int64_t T) const { return std::min(T, memory_rows(reps_[r])); }
  int capacity_slots(int r) const {  // instances rank r may still take
    return in_.model == PlacementModel::kOwners ? in_.slots - reps_[r] : in_.slots - __builtin_popcount(mask_[r]);
  }

  // the max-flow at T; fills rows_EW when `rows` is given; returns the flow
  int64_t flow(int64_t T, std::vector<char>* side = nullptr, std::vector<int64_t>* rows = nullptr) const {
    const int s = E_ + W_, t = s + 1;
    MaxFlow g(E_ + W_ + 2);
    std::vector<std::pair<int, int>> edges;  // (edge index, e * W + r)
    for (int e = 0; e < E_; ++e)
      if (in_.demand_E[e] > 0) g.add(s, e, in_.demand_E[e]);
    for (int e = 0; e < E_; ++e)
      for (int r = 0; r < W_; ++r)
        if (mask_[r] >> e & 1) edges.push_back({g.add(e, E_ + r, kInf), e * W_ + r});
    for (int r = 0; r < W_; ++r) g.add(E_ + r, t, std::max<int64_t>(0, cap(r, T)));
    const int64_t f = g.run(s, t);
    if (side) *side = g.reachable(s);
    if (rows) {
      rows->assign(static_cast<size_t>(E_) * W_, 0);
      for (const auto& x : edges) (*rows)[x.second] = g.flow_on(x.first);
    }
    return f;
  }

  // the smallest T in [lo, hi] at which this placement carries every row (hi: it does)
  int64_t value(int64_t lo, int64_t hi) const {
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (flow(mid) == total_) hi = mid; else lo = mid + 1;
    }
    return lo;
  }

  // is there a placement containing the current one that carries every row at T?
  bool feasible(int64_t T) {
    seen_.clear();
    return dfs(T);
  }

  void hold(int e, int r, bool replica) {
    mask_[r] |= uint16_t(1u << e);
    inst_[e] += 1;
    if (replica) reps_[r] += 1;
  }
  void drop(int e, int r, bool replica) {
    mask_[r] &= uint16_t(~(1u << e));
    inst_[e] -= 1;
    if (replica) reps_[r] -= 1;
  }

  const ExactInput& in_;
  const int W_, E_;
  int64_t total_ = 0;
  std::vector<uint16_t> mask_;
  std::vector<int> inst_, reps_;
  int64_t nodes_ = 0;
  bool aborted_ = false;

 private:
  Key key() const {
    std::vector<uint16_t> m(mask_);
    // kFree: ranks are interchangeable, so a placement is the multiset of its masks
    if (in_.model == PlacementModel::kFree) std::sort(m.begin(), m.end());
    Key k;
    for (int r = 0; r < W_; ++r) (r < 4 ? k.lo : k.hi) |= uint64_t(m[r]) << (16 * (r % 4));
    return k;
  }

  bool dfs(int64_t T) {
    if (++nodes_ > in_.max_nodes) { aborted_ = true; return false; }
    if (!seen_.insert(key()).second) return false;  // refuted at this T already
    // instances still needed against the free slots (an instance computes <= T rows)
    int64_t top_cap = 0, slots = 0, need = 0;
    for (int r = 0; r < W_; ++r) {
      top_cap = std::max(top_cap, cap(r, T));
      slots += std::max(0, capacity_slots(r));
    }
    for (int e = 0; e < E_; ++e) {
      const int64_t d = in_.demand_E[e];
      int64_t want = d > 0 ? (top_cap > 0 ? ceil_div(d, top_cap) : kInf) : 0;
      if (in_.model == PlacementModel::kFree) want = std::max<int64_t>(want, 1);
      if (want > W_) return false;
      need += std::max<int64_t>(0, want - inst_[e]);
    }
    if (need > slots) return false;
    std::vector<char> side;
    if (flow(T, &side) == total_) {
      if (in_.model == PlacementModel::kFree) place_idle();
      return true;
    }
    // branches: an expert of the violated set A on a rank outside N(A) with a free slot,
    // memory for the copy, and rows left for it at T
    std::vector<std::pair<int64_t, std::pair<int, int>>> branch;
    std::vector<uint16_t> used_class;
    for (int r = 0; r < W_; ++r) {
      if (side[E_ + r] || capacity_slots(r) <= 0) continue;
      if (in_.model == PlacementModel::kFree) {  // one rank per class of identical ranks
        if (std::find(used_class.begin(), used_class.end(), mask_[r]) != used_class.end()) continue;
        used_class.push_back(mask_[r]);
      }
      const bool replica = in_.model == PlacementModel::kOwners;
      const int64_t room = std::min(T, memory_rows(reps_[r] + (replica ? 1 : 0)));
      if (room <= 0) continue;
      for (int e = 0; e < E_; ++e)
        if (side[e] && !(mask_[r] >> e & 1)) branch.push_back({room, {e, r}});
    }
    // most room first, then the heaviest expert: a feasible placement is found early
    std::stable_sort(branch.begin(), branch.end(), [&](const auto& a, const auto& b) {
      if (a.first != b.first) return a.first > b.first;
      return in_.demand_E[a.second.first] > in_.demand_E[b.second.first];
    });
    const bool replica = in_.model == PlacementModel::kOwners;
    for (const auto& b : branch) {
      hold(b.second.first, b.second.second, replica);
      if (dfs(T)) return true;
      drop(b.second.first, b.second.second, replica);
      if (aborted_) return false;
    }
    return false;
  }

  // kFree: experts without rows and without an instance take any free slot (they carry
  // nothing; the slot count was checked before the flow)
  void place_idle() {
    for (int e = 0; e < E_; ++e) {
      if (inst_[e] > 0) continue;
      for (int r = 0; r < W_; ++r)
        if (capacity_slots(r) > 0) { hold(e, r, false); break; }
    }
  }

  std::unordered_set<Key, KeyHash> seen_;
};

void check(const ExactInput& in) {
  const int W = in.num_ranks, E = in.num_experts;
  if (W < 1 || W > kMaxRanks)
    fail("num_ranks must be in [1, 8] (the search is exponential in W), got " + std::to_string(W));
  if (E < 1 || E > kMaxExperts)
    fail("num_experts must be in [1, 16] (the search is exponential in E), got " + std::to_string(E));
  if (static_cast<int>(in.demand_E.size()) != E)
    fail("demand_E must hold num_experts = " + std::to_string(E) + " entries, got " +
         std::to_string(in.demand_E.size()));
  for (int64_t d : in.demand_E)
    if (d < 0 || d > std::numeric_limits<int32_t>::max())
      fail("demand_E must be in [0, 2^31), got " + std::to_string(d));
  const int per = (E + W - 1) / W;
  if (in.model == PlacementModel::kOwners) {
    if (E % W != 0)
      fail("num_experts (E=" + std::to_string(E) + ") must be a multiple of num_ranks (W=" +
           std::to_string(W) + ") for the owners model (fixed ownership); use the free model");
    if (in.slots < 0 || in.slots > kMaxSpareSlots)
      fail("slots (replica slots per rank) must be in [0, 2] for the owners model, got " + std::to_string(in.slots));
  } else {
    if (in.slots * W < E || in.slots > std::min(E, per + kMaxSpareSlots))
      fail("slots (instance slots per rank) must be in [ceil(E/W), min(E, ceil(E/W) + 2)] = [" +
           std::to_string(per) + ", " + std::to_string(std::min(E, per + kMaxSpareSlots)) +
           "] for the free model, got " + std::to_string(in.slots));
  }
  if (in.row_bytes < 0 || in.limit_bytes < 0 || in.base_bytes < 0 || in.replica_bytes < 0)
    fail("limit_bytes, base_bytes, replica_bytes and row_bytes must be >= 0");
  if (in.max_nodes < 1) fail("max_nodes must be >= 1, got " + std::to_string(in.max_nodes));
}

}  // namespace

ExactResult exact_optimum(const ExactInput& in) {
  check(in);
  const int W = in.num_ranks, E = in.num_experts;
  ExactResult res;
  const int64_t spare = in.model == PlacementModel::kOwners ? int64_t(in.slots) * W
                                                            : int64_t(in.slots) * W - E;
  res.lower_bound = rows_lower_bound(in.demand_E, W, spare);
  Search s(in);
  // every placement must fit its copies: the owners alone, or the S prepaid slots
  if (s.memory_rows(0) < 0) {
    res.proven = true;
    return res;
  }
  int64_t best = kInf;
  std::vector<uint16_t> best_mask;
  if (in.model == PlacementModel::kOwners && s.flow(kInf) == s.total_) {
    best = s.value(res.lower_bound, std::max(res.lower_bound, s.total_));
    best_mask = s.mask_;
  }
  // binary search for the smallest T some placement reaches (each probe a fresh search)
  int64_t lo = res.lower_bound, hi = std::min(best - 1, s.total_);
  const std::vector<uint16_t> start(s.mask_);
  const std::vector<int> start_inst(s.inst_), start_reps(s.reps_);
  bool first = true;
  while (lo <= hi) {
    // the bound first: the optimum usually reaches it, and then one search suffices
    const int64_t mid = first ? lo : lo + (hi - lo) / 2;
    first = false;
    s.mask_ = start; s.inst_ = start_inst; s.reps_ = start_reps;
    if (s.feasible(mid)) {
      best = s.value(lo, mid);
      best_mask = s.mask_;
      hi = best - 1;
    } else if (s.aborted_) {
      break;
    } else {
      lo = mid + 1;
    }
  }
  res.nodes = s.nodes_;
  res.proven = !s.aborted_;
  res.feasible = best < kInf;
  if (!res.feasible) return res;
  res.optimum = best;
  s.mask_ = best_mask;
  s.flow(best, nullptr, &res.rows_EW);
  res.holds_EW.assign(static_cast<size_t>(E) * W, 0);
  for (int e = 0; e < E; ++e)
    for (int r = 0; r < W; ++r) res.holds_EW[e * W + r] = best_mask[r] >> e & 1;
  return res;
}

ExactInput exact_input(const PlanInput& in, PlacementModel model,
                       const std::vector<int64_t>& demand_E, bool with_memory) {
  ExactInput x;
  x.num_ranks = in.num_ranks;
  x.num_experts = in.num_experts;
  x.model = model;
  x.demand_E = demand_E.empty() ? detail::expert_loads(in) : demand_E;
  const int64_t W = in.num_ranks, E = in.num_experts;
  const int64_t per = (E + W - 1) / W;
  const MemoryModel& m = in.memory;
  const int64_t copy = m.expert_weight_bytes + m.expert_grad_bytes;
  const int64_t opt = m.optimizer_on_device ? m.expert_optimizer_bytes : 0;
  if (model == PlacementModel::kOwners) {
    x.slots = in.replica_slots;
    x.base_bytes = (copy + opt) * (E / W);
    x.replica_bytes = copy;
  } else {
    x.slots = static_cast<int32_t>(in.symi_slots > 0 ? in.symi_slots
                                                     : std::min<int64_t>(E, per + in.replica_slots));
    x.base_bytes = copy * x.slots + (opt * E + W - 1) / W;
    x.replica_bytes = 0;
  }
  if (with_memory) {
    x.limit_bytes = m.budget_bytes - m.resident_bytes;
    x.row_bytes = m.forward_row_bytes + m.backward_row_bytes;
  }
  return x;
}

}  // namespace planner
}  // namespace lrmoe
