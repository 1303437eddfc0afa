// Hysteresis: keep the previous placement unless replanning pays (hysteresis.h).
#include "planner/hysteresis.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "planner/common.h"
#include "planner/joint.h"
#include "planner/route.h"

namespace lrmoe {
namespace planner {
namespace detail {
namespace {

[[noreturn]] void fail(const std::string& msg) { throw std::invalid_argument(msg); }

int64_t max_time(const PlanInput& in, const Plan& p) {
  const std::vector<int64_t> t = rank_times(p, in.joint ? in.replica_cost_rows : 0);
  return t.empty() ? 0 : *std::max_element(t.begin(), t.end());
}

}  // namespace

Plan kept_plan(const PlanInput& in, const Plan& fresh) {
  const int32_t W = in.num_ranks, E = in.num_experts;
  const PolicyKind kind = fresh.policy;
  if (kind == PolicyKind::kSymi)
    fail("previous_plan applies to policies fixed, ultraep and lrmoe; symi re-places its "
         "slots every step by design (drop previous_plan)");
  const std::vector<int32_t>& off = in.previous_instance_offsets;
  const std::vector<int32_t>& rank = in.previous_instance_rank;
  const std::vector<int64_t>& rows = in.previous_instance_rows;
  if (static_cast<int32_t>(off.size()) != E + 1 || off[0] != 0)
    fail("previous_instance_offsets must have num_experts + 1 = " + std::to_string(E + 1) +
         " entries starting at 0 (a previous Plan's instance_offsets), got " +
         std::to_string(off.size()));
  for (int32_t e = 0; e < E; ++e)
    if (off[e + 1] <= off[e])
      fail("previous_instance_offsets must increase (every expert has an instance), not at "
           "expert " + std::to_string(e));
  const int32_t I = off[E];
  if (static_cast<int32_t>(rank.size()) != I || static_cast<int32_t>(rows.size()) != I)
    fail("previous_instance_rank and previous_instance_rows must have one entry per "
         "instance (" + std::to_string(I) + "), got " + std::to_string(rank.size()) + " and " +
         std::to_string(rows.size()));
  std::vector<int32_t> reps_W(static_cast<size_t>(W), 0);
  std::vector<uint8_t> held(static_cast<size_t>(W), 0);
  const std::vector<int64_t> n_E = expert_loads(in);
  Layout lay;
  lay.offsets = off;
  lay.rank = rank;
  lay.rows.assign(static_cast<size_t>(I), 0);
  for (int32_t e = 0; e < E; ++e) {
    std::fill(held.begin(), held.end(), 0);
    int64_t prev = 0;
    for (int32_t i = off[e]; i < off[e + 1]; ++i) {
      const int32_t r = rank[i];
      if (r < 0 || r >= W)
        fail("previous_instance_rank must be in [0, num_ranks=" + std::to_string(W) + "), got " +
             std::to_string(r) + " for expert " + std::to_string(e));
      if (held[r]++) fail("previous_instance_rank holds two instances of expert " +
                          std::to_string(e) + " on rank " + std::to_string(r));
      if (i == off[e] && r != fixed_owner(e, E, W))
        fail("previous_instance_rank: the first instance of expert " + std::to_string(e) +
             " must be its owner, rank " + std::to_string(fixed_owner(e, E, W)));
      if (i > off[e] && ++reps_W[r] > in.replica_slots)
        fail("previous placement has more replicas on rank " + std::to_string(r) +
             " than replica_slots=" + std::to_string(in.replica_slots));
      if (rows[i] < 0) fail("previous_instance_rows must be >= 0, got " + std::to_string(rows[i]));
      prev += rows[i];
    }
    const int32_t n = off[e + 1] - off[e];
    if (prev > 0) {
      // n_e * rows[i] < 2^31 * 2^31: within largest_remainder's 2^63
      largest_remainder(n_E[e], rows.data() + off[e], n, lay.rows.data() + off[e]);
    } else {
      lay.rows[off[e]] = n_E[e];
    }
  }
  if (kind == PolicyKind::kFixed && I > E)
    fail("previous placement has replicas; policy fixed has none (drop previous_plan)");

  const MemoryModel& m = in.memory;
  const int64_t copy = m.expert_weight_bytes + m.expert_grad_bytes;
  RankBytes bytes;
  bytes.base_W.assign(static_cast<size_t>(W),
                      (copy + (m.optimizer_on_device ? m.expert_optimizer_bytes : 0)) * (E / W));
  bytes.replica_W.resize(static_cast<size_t>(W));
  for (int32_t r = 0; r < W; ++r)
    bytes.replica_W[r] = copy * (kind == PolicyKind::kUltraEP ? in.replica_slots : reps_W[r]);
  int64_t target = 0;
  if (kind == PolicyKind::kLRMoE && in.balance_slack >= 0.0) {  // as lrmoe.cpp computes it
    int64_t kept = 0;
    for (int64_t q : fresh.quota_E) kept += q;
    target = std::max<int64_t>(
        1, static_cast<int64_t>(std::ceil((1.0 + in.balance_slack) * static_cast<double>(kept) / W)));
  }
  return assemble(in, kind, lay, fresh.quota_E, bytes, kind == PolicyKind::kLRMoE, target);
}

Plan with_hysteresis(const PlanInput& in, Plan fresh) {
  if (!(in.replan_threshold >= 0.0 && in.replan_threshold < 1.0))
    fail("replan_threshold must be in [0, 1) (the fraction of the kept plan's max rank "
         "time a new plan must save), got " + std::to_string(in.replan_threshold));
  Plan kept = kept_plan(in, fresh);
  const int64_t t_kept = max_time(in, kept), t_fresh = max_time(in, fresh);
  const bool keep = kept.feasible &&
                    (!fresh.feasible || static_cast<double>(t_fresh) >=
                                            (1.0 - in.replan_threshold) * static_cast<double>(t_kept));
  Plan out = keep ? std::move(kept) : std::move(fresh);
  out.kept_previous = keep;
  out.moved_replicas = 0;
  if (!keep) {
    const int32_t W = in.num_ranks;
    std::vector<uint8_t> had(static_cast<size_t>(in.num_experts) * W, 0);
    for (int32_t e = 0; e < in.num_experts; ++e)
      for (int32_t i = in.previous_instance_offsets[e]; i < in.previous_instance_offsets[e + 1]; ++i)
        had[static_cast<size_t>(e) * W + in.previous_instance_rank[i]] = 1;
    for (int32_t e = 0; e < out.num_experts; ++e)
      for (int32_t i = out.instance_offsets[e] + 1; i < out.instance_offsets[e + 1]; ++i)
        if (!had[static_cast<size_t>(e) * W + out.instance_rank[i]]) out.moved_replicas += 1;
  }
  out.moved_bytes = static_cast<int64_t>(out.moved_replicas) * in.memory.expert_weight_bytes;
  return out;
}

}  // namespace detail
}  // namespace planner
}  // namespace lrmoe
