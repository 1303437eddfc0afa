// UltraEP (Dots-Infra/UltraEP, csrc/kernels/placement.cu): per micro-batch and layer,
// replicas into R spare slots per rank and the token split found by a quota oracle and
// bisection on the max rank load. docs/planner.md, "ultraep", gives the pseudo-code.
//
//   ORACLE(tau): excess[r] = max(load[r] - tau, 0), slack[r] = max(tau - load[r], 0);
//     fail if sum(excess) > sum(slack); for r by load desc, for e owned by r by n_e
//     desc, while excess[r] > 0: t = argmax slack over ranks with a free slot not
//     holding e, q = min(excess[r], slack[t], avail(e)) (the owner keeps >= 1 row),
//     stop when q < u_min; fail if excess[r] > 0 is left.
//   tau* = the smallest tau in [ceil(mean load), max load] the oracle accepts.
//
// Backward exact (Q_e = n_e). Memory: owners as fixed ownership; R slots of weights +
// grads reserved on every rank whether filled or not (UltraEP allocates them once and
// shares them across layers); forward and backward rows where the split puts them.
#include <algorithm>
#include <cstddef>
#include <numeric>
#include <utility>

#include "planner/common.h"
#include "planner/policies.h"
#include "planner/ultraep_refine.h"

namespace lrmoe {
namespace planner {
namespace {

using Export = detail::Replica;

// A candidate target of the oracle: ordered by slack descending, then rank ascending
// (plain fields, so that moving entries of a sorted array is a memmove).
struct Key {
  int64_t neg_slack;
  int32_t rank;
  bool operator<(const Key& o) const {
    return neg_slack != o.neg_slack ? neg_slack < o.neg_slack : rank < o.rank;
  }
};

class UltraEPPolicy final : public Policy {
 public:
  PolicyKind kind() const override { return PolicyKind::kUltraEP; }
  const char* name() const override { return "ultraep"; }

  Plan plan(const PlanInput& in) const override {
    detail::validate(in, kind());
    const int32_t W = in.num_ranks, E = in.num_experts, per = E / W;
    const std::vector<int64_t> n_E = detail::expert_loads(in);
    std::vector<int64_t> load_W(static_cast<size_t>(W), 0);
    for (int32_t e = 0; e < E; ++e) load_W[detail::fixed_owner(e, E, W)] += n_E[e];
    // visiting orders, fixed for every probe
    std::vector<int32_t> ranks(static_cast<size_t>(W));
    std::iota(ranks.begin(), ranks.end(), 0);
    std::stable_sort(ranks.begin(), ranks.end(),
                     [&](int32_t a, int32_t b) { return load_W[a] > load_W[b]; });
    std::vector<int32_t> experts(static_cast<size_t>(E));
    std::iota(experts.begin(), experts.end(), 0);
    for (int32_t r = 0; r < W; ++r)
      std::stable_sort(experts.begin() + r * per, experts.begin() + (r + 1) * per,
                       [&](int32_t a, int32_t b) { return n_E[a] > n_E[b]; });

    // ranks by (load, rank) ascending: the probes' candidate order by (slack desc, rank
    // asc) while no export has changed a slack, for every tau
    std::vector<int32_t> by_load(static_cast<size_t>(W));
    std::iota(by_load.begin(), by_load.end(), 0);
    std::sort(by_load.begin(), by_load.end(), [&](int32_t a, int32_t b) {
      return load_W[a] != load_W[b] ? load_W[a] < load_W[b] : a < b;
    });
    const int64_t total = std::accumulate(load_W.begin(), load_W.end(), int64_t(0));
    int64_t hi = *std::max_element(load_W.begin(), load_W.end());
    int64_t lo = std::min(hi, (total + W - 1) / W);
    std::vector<Export> best, probe;
    // the oracle accepts hi with no replica; bisect for the smallest accepted tau
    // (best: the exports of the last accepted probe, which is tau*)
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (oracle(in, mid, n_E, load_W, ranks, by_load, experts, &probe)) {
        hi = mid;
        best.swap(probe);
      } else {
        lo = mid + 1;
      }
    }
    // never accepted below the max load: tau* = max load, which needs no replica
    if (in.ultraep_refine) detail::ultraep_refine(in, n_E, &best);

    const detail::Layout lay = detail::fixed_layout(in, n_E, best);
    const MemoryModel& m = in.memory;
    const int64_t copy = m.expert_weight_bytes + m.expert_grad_bytes;
    detail::RankBytes bytes;
    bytes.base_W.assign(static_cast<size_t>(W),
                        (copy + (m.optimizer_on_device ? m.expert_optimizer_bytes : 0)) * per);
    bytes.replica_W.assign(static_cast<size_t>(W), copy * in.replica_slots);
    return detail::assemble(in, kind(), lay, n_E, bytes, false);
  }

 private:
  bool oracle(const PlanInput& in, int64_t tau, const std::vector<int64_t>& n_E,
              const std::vector<int64_t>& load_W, const std::vector<int32_t>& ranks,
              const std::vector<int32_t>& by_load, const std::vector<int32_t>& experts,
              std::vector<Export>* out) const {
    const int32_t W = in.num_ranks, E = in.num_experts, per = E / W;
    const int32_t G = detail::node_size(in);  // node(r) = r / G
    out->clear();
    std::vector<int64_t> excess(static_cast<size_t>(W)), slack(static_cast<size_t>(W));
    std::vector<int32_t> free_slots(static_cast<size_t>(W), in.replica_slots);
    int64_t sum_excess = 0, sum_slack = 0;
    for (int32_t r = 0; r < W; ++r) {
      excess[r] = std::max<int64_t>(load_W[r] - tau, 0);
      slack[r] = std::max<int64_t>(tau - load_W[r], 0);
      sum_excess += excess[r];
      sum_slack += slack[r];
    }
    if (sum_excess > sum_slack) return false;
    // candidate targets by (slack desc, rank asc), a sorted array of (-slack, rank): the
    // first one not hosting e is the argmax of the oracle (ties to the lower rank). It
    // starts as the ranks below tau in load order (no sort per probe), and an export
    // moves one entry (a std::set allocated a node for every rank of every probe)
    thread_local std::vector<Key> open;
    open.clear();
    for (int32_t j : by_load)
      if (free_slots[j] > 0 && slack[j] > 0) open.push_back({-slack[j], j});
    std::vector<int32_t> hosts;
    for (int32_t r : ranks) {
      if (excess[r] == 0) break;  // ranks are visited by load descending
      for (int32_t k = r * per; k < (r + 1) * per && excess[r] > 0; ++k) {
        const int32_t e = experts[k];
        int64_t avail = n_E[e] - 1;  // the owner keeps at least one row
        hosts.assign(1, r);
        while (excess[r] > 0 && avail > 0) {
          // the most slack on r's node first (UltraEP keeps replicas inside the NVLink
          // domain: ../shared/policies.md), else anywhere
          int32_t t = -1, t_far = -1;
          size_t at = 0, at_far = 0;  // t's entry in `open`
          for (size_t c = 0; c < open.size(); ++c) {
            const int32_t j = open[c].rank;
            if (std::find(hosts.begin(), hosts.end(), j) != hosts.end()) continue;
            if (j / G == r / G) { t = j; at = c; break; }
            if (t_far < 0) { t_far = j; at_far = c; }
          }
          if (t < 0) { t = t_far; at = at_far; }
          if (t < 0) break;
          const int64_t q = std::min({excess[r], slack[t], avail});
          if (q < in.min_replica_rows) break;  // a replica carries at least u_min rows
          out->push_back({e, t, q});
          hosts.push_back(t);
          slack[t] -= q;
          free_slots[t] -= 1;
          if (free_slots[t] > 0 && slack[t] > 0) {
            // less slack: the entry moves towards the end, past the entries now before it
            const Key k{-slack[t], t};
            const auto to = std::lower_bound(open.begin() + static_cast<std::ptrdiff_t>(at) + 1,
                                             open.end(), k);
            std::copy(open.begin() + static_cast<std::ptrdiff_t>(at) + 1, to,
                      open.begin() + static_cast<std::ptrdiff_t>(at));
            *(to - 1) = k;
          } else {
            open.erase(open.begin() + static_cast<std::ptrdiff_t>(at));
          }
          excess[r] -= q;
          avail -= q;
        }
      }
      if (excess[r] > 0) return false;
    }
    return true;
  }
};

}  // namespace

std::unique_ptr<Policy> make_ultraep_policy() { return std::make_unique<UltraEPPolicy>(); }

}  // namespace planner
}  // namespace lrmoe
