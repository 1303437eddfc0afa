// Input checks, plan assembly, memory accounting and the policy registry.
#include "planner/common.h"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <utility>

#include "planner/bound.h"
#include "planner/hysteresis.h"
#include "planner/route.h"

namespace lrmoe {
namespace planner {
namespace detail {
namespace {

constexpr int64_t kUnbounded = std::numeric_limits<int64_t>::max() / 4;
constexpr int64_t kMaxRows = std::numeric_limits<int32_t>::max();

[[noreturn]] void fail(const std::string& msg) { throw std::invalid_argument(msg); }

std::string num(int64_t v) { return std::to_string(v); }

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", v);
  return buf;
}

}  // namespace

std::string format_bytes(int64_t bytes) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.3f GiB (%lld bytes)",
                static_cast<double>(bytes) / static_cast<double>(int64_t(1) << 30),
                static_cast<long long>(bytes));
  return buf;
}

void validate(const PlanInput& in, PolicyKind kind) {
  const char* policy = policy_name(kind);
  if (in.num_ranks < 1) fail("num_ranks must be >= 1 (the EP size W), got " + num(int64_t(in.num_ranks)));
  if (in.num_experts < 1) fail("num_experts must be >= 1, got " + num(int64_t(in.num_experts)));
  const int64_t W = in.num_ranks, E = in.num_experts;
  if (static_cast<int64_t>(in.load_WE.size()) != W * E)
    fail("load must hold num_ranks x num_experts = " + num(W) + " x " + num(E) + " = " +
         num(W * E) + " entries (L[s][e], row-major), got " + num(int64_t(in.load_WE.size())));
  std::vector<int64_t> n_E(static_cast<size_t>(E), 0);
  for (int64_t s = 0; s < W; ++s)
    for (int64_t e = 0; e < E; ++e) {
      const int64_t v = in.load_WE[static_cast<size_t>(s * E + e)];
      if (v < 0) fail("load must be >= 0, got " + num(v) + " at [source " + num(s) + ", expert " + num(e) + "]");
      n_E[static_cast<size_t>(e)] += v;
      if (n_E[static_cast<size_t>(e)] > kMaxRows)
        fail("load of expert " + num(e) + " summed over sources exceeds 2^31 - 1 rows; split "
             "the micro-batch");
    }
  if (!(in.recalibration_rate >= 0.0 && in.recalibration_rate < 1.0))
    fail("recalibration_rate must be in [0, 1), got " + num(in.recalibration_rate));
  if (!(in.max_expert_cut >= 0.0 && in.max_expert_cut < 1.0))
    fail("max_expert_cut must be in [0, 1) (the most of one expert's demand lrmoe may cut), "
         "got " + num(in.max_expert_cut));
  const MemoryModel& m = in.memory;
  const std::pair<const char*, int64_t> sizes[] = {
      {"expert_weight_bytes", m.expert_weight_bytes}, {"expert_grad_bytes", m.expert_grad_bytes},
      {"expert_optimizer_bytes", m.expert_optimizer_bytes},
      {"forward_row_bytes", m.forward_row_bytes}, {"backward_row_bytes", m.backward_row_bytes},
      {"budget_bytes", m.budget_bytes}, {"resident_bytes", m.resident_bytes}};
  for (const auto& kv : sizes)
    if (kv.second < 0) fail(std::string(kv.first) + " must be >= 0, got " + num(kv.second));
  if (m.budget_bytes < m.resident_bytes)
    fail("budget_bytes (" + format_bytes(m.budget_bytes) + ") is smaller than resident_bytes (" +
         format_bytes(m.resident_bytes) + "): nothing is left for experts and token buffers; "
         "raise the budget or lower the resident bytes");
  if (in.replica_slots < 0) fail("replica_slots must be >= 0, got " + num(int64_t(in.replica_slots)));
  if (in.symi_slots < 0) fail("symi_slots must be >= 0 (0: ceil(E / W) + replica_slots), got " + num(int64_t(in.symi_slots)));
  if (!(in.balance_slack == in.balance_slack))  // NaN
    fail("balance_slack must be a number (< 0: off), got NaN");
  if (in.backward_row_capacity < 0)
    fail("backward_row_capacity must be >= 0 (0: bounded by memory only), got " + num(in.backward_row_capacity));
  if (in.replica_cost_rows < 0)
    fail("replica_cost_rows must be >= 0 (one replica's weight and grad traffic in the time of "
         "computing one row; 0: replicas cost only their slot), got " + num(in.replica_cost_rows));
  if (in.gpus_per_node < 0 || in.gpus_per_node > in.num_ranks)
    fail("gpus_per_node must be in [0, num_ranks] (0: one node of all W=" + num(W) +
         " ranks), got " + num(int64_t(in.gpus_per_node)));
  if (in.min_replica_rows < 1) fail("min_replica_rows must be >= 1, got " + num(in.min_replica_rows));
  if (!in.previous_load_E.empty()) {
    if (static_cast<int64_t>(in.previous_load_E.size()) != E)
      fail("previous_load must have one entry per expert (" + num(E) + "), got " +
           num(int64_t(in.previous_load_E.size())));
    for (int64_t e = 0; e < E; ++e)
      if (in.previous_load_E[static_cast<size_t>(e)] < 0 || in.previous_load_E[static_cast<size_t>(e)] > kMaxRows)
        fail("previous_load must be in [0, 2^31), got " + num(in.previous_load_E[static_cast<size_t>(e)]) +
             " at expert " + num(e));
  }
  if (kind != PolicyKind::kSymi && E % W != 0)
    fail("num_experts (E=" + num(E) + ") must be a multiple of num_ranks (W=" + num(W) +
         ") for policy " + policy + " (fixed ownership owner(e) = e / (E/W)); use policy symi "
         "or change the EP size");
  if (kind == PolicyKind::kUltraEP && in.replica_slots < 1)
    fail("replica_slots must be >= 1 for policy ultraep (R spare slots per rank); with 0 it "
         "is fixed ownership: use policy fixed");
  if (kind == PolicyKind::kSymi) {
    if (in.symi_slots > 0 && int64_t(in.symi_slots) * W < E)
      fail("symi_slots (S=" + num(int64_t(in.symi_slots)) + ") x num_ranks (W=" + num(W) +
           ") cannot hold num_experts (E=" + num(E) + "); use symi_slots >= " + num((E + W - 1) / W));
    if (in.symi_slots > E)
      fail("symi_slots (S=" + num(int64_t(in.symi_slots)) + ") must be <= num_experts (E=" +
           num(E) + "): a GPU holds at most one instance of an expert");
  }
}

std::vector<int64_t> expert_loads(const PlanInput& in) {
  const int64_t W = in.num_ranks, E = in.num_experts;
  std::vector<int64_t> n_E(static_cast<size_t>(E), 0);
  for (int64_t s = 0; s < W; ++s)
    for (int64_t e = 0; e < E; ++e) n_E[static_cast<size_t>(e)] += in.load_WE[static_cast<size_t>(s * E + e)];
  return n_E;
}

Layout fixed_layout(const PlanInput& in, const std::vector<int64_t>& n_E,
                    const std::vector<Replica>& replicas) {
  const int32_t E = in.num_experts, W = in.num_ranks;
  Layout lay;
  lay.offsets.assign(static_cast<size_t>(E) + 1, 0);
  for (const Replica& x : replicas) lay.offsets[x.expert + 1] += 1;
  for (int32_t e = 0; e < E; ++e) lay.offsets[e + 1] += lay.offsets[e] + 1;
  const int32_t I = lay.offsets[E];
  lay.rank.resize(static_cast<size_t>(I));
  lay.rows.resize(static_cast<size_t>(I));
  std::vector<int32_t> next(static_cast<size_t>(E));
  for (int32_t e = 0; e < E; ++e) {
    lay.rank[lay.offsets[e]] = fixed_owner(e, E, W);
    lay.rows[lay.offsets[e]] = n_E[e];
    next[e] = lay.offsets[e] + 1;
  }
  for (const Replica& x : replicas) {
    lay.rank[next[x.expert]] = x.rank;
    lay.rows[next[x.expert]++] = x.rows;
    lay.rows[lay.offsets[x.expert]] -= x.rows;
  }
  return lay;
}

Plan assemble(const PlanInput& in, PolicyKind kind, const Layout& lay,
              const std::vector<int64_t>& quota_E, const RankBytes& bytes, bool bounded,
              int64_t target_rows, const std::vector<int64_t>* retained_I) {
  const int32_t W = in.num_ranks, E = in.num_experts;
  const MemoryModel& m = in.memory;
  Plan p;
  p.policy = kind;
  p.num_ranks = W;
  p.num_experts = E;
  p.quota_E = quota_E;
  p.limit_bytes = m.budget_bytes - m.resident_bytes;
  p.instance_offsets = lay.offsets;
  p.instance_rank = lay.rank;
  const int32_t I = p.instance_offsets[E];
  p.replicas = I - E;
  p.forward_IW.assign(static_cast<size_t>(I) * W, 0);
  p.retained_IW.assign(static_cast<size_t>(I) * W, 0);
  p.fixed_rows_W.assign(static_cast<size_t>(W), 0);
  p.forward_rows_W.assign(static_cast<size_t>(W), 0);
  p.backward_rows_W.assign(static_cast<size_t>(W), 0);

  // forward split, locality first
  std::vector<int64_t> L_W(static_cast<size_t>(W));
  std::vector<int64_t> n_E(static_cast<size_t>(E), 0);
  for (int32_t e = 0; e < E; ++e) {
    const int32_t off = p.instance_offsets[e];
    const int32_t n = p.instance_offsets[e + 1] - off;
    int64_t n_e = 0;  // a local sum: through n_E[e] each add waited on the last store
    for (int32_t s = 0; s < W; ++s) {
      L_W[s] = in.load_WE[static_cast<size_t>(s) * E + e];
      n_e += L_W[s];
    }
    n_E[e] = n_e;
    split_forward(L_W.data(), W, lay.rank.data() + off, lay.rows.data() + off, n,
                  p.forward_IW.data() + static_cast<int64_t>(off) * W, node_size(in),
                  in.spare_capacity_split);
    if (E % W == 0) p.fixed_rows_W[fixed_owner(e, E, W)] += n_E[e];
    for (int32_t i = off; i < off + n; ++i) p.forward_rows_W[lay.rank[i]] += lay.rows[i];
  }
  if (E % W != 0) p.fixed_rows_W.clear();  // no fixed ownership to compare with

  // backward room of every rank, in rows, once the forward buffers are placed
  std::vector<int64_t> room_W(static_cast<size_t>(W), kUnbounded);
  std::vector<int64_t> hard_W(static_cast<size_t>(W), kUnbounded);  // without the target
  if (bounded)
    for (int32_t r = 0; r < W; ++r) {
      const int64_t free_bytes = p.limit_bytes - bytes.base_W[r] - bytes.replica_W[r] -
                                 p.forward_rows_W[r] * m.forward_row_bytes;
      int64_t rows = m.backward_row_bytes > 0 ? std::max<int64_t>(0, free_bytes) / m.backward_row_bytes
                                              : kUnbounded;
      if (free_bytes < 0) rows = 0;
      if (in.backward_row_capacity > 0) rows = std::min(rows, in.backward_row_capacity);
      hard_W[r] = rows;
      if (target_rows > 0) rows = std::min(rows, target_rows);
      room_W[r] = rows;
    }

  // retained shares: single-instance experts have no choice and go first; then the
  // replicated ones, most retained rows first, over what room is left
  std::vector<int32_t> order(static_cast<size_t>(E));
  std::iota(order.begin(), order.end(), 0);
  // a stable sort's order (the index as the last key) without its buffer allocation
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    const bool ra = lay.offsets[a + 1] - lay.offsets[a] > 1;
    const bool rb = lay.offsets[b + 1] - lay.offsets[b] > 1;
    if (ra != rb) return rb;
    if (quota_E[a] != quota_E[b]) return quota_E[a] > quota_E[b];
    return a < b;
  });
  std::vector<int64_t> f_n, room_n, b_n;
  int64_t unplaced = 0;
  int32_t unplaced_expert = -1;
  for (int32_t e : order) {
    const int32_t off = p.instance_offsets[e];
    const int32_t n = p.instance_offsets[e + 1] - off;
    f_n.assign(lay.rows.begin() + off, lay.rows.begin() + off + n);
    room_n.resize(static_cast<size_t>(n));
    b_n.resize(static_cast<size_t>(n));
    for (int32_t i = 0; i < n; ++i) room_n[i] = room_W[lay.rank[off + i]];
    int64_t left = 0;
    if (retained_I) {  // decided by the caller (joint.h): b <= f per instance
      for (int32_t i = 0; i < n; ++i) b_n[i] = (*retained_I)[static_cast<size_t>(off + i)];
    } else {
      left = split_over_instances(quota_E[e], f_n.data(), room_n.data(), n, b_n.data());
    }
    if (!retained_I && left > 0 && target_rows > 0) {  // the target cannot be met: the hard rooms only
      for (int32_t i = 0; i < n; ++i) room_n[i] = hard_W[lay.rank[off + i]];
      left = split_over_instances(quota_E[e], f_n.data(), room_n.data(), n, b_n.data());
    }
    if (left > 0) {  // over-commit on purpose: the memory check below marks it infeasible
      unplaced += left;
      if (unplaced_expert < 0) unplaced_expert = e;
      largest_remainder(quota_E[e], f_n.data(), n, b_n.data());
    }
    for (int32_t i = 0; i < n; ++i) {
      const int32_t r = lay.rank[off + i];
      room_W[r] = std::max<int64_t>(0, room_W[r] - b_n[i]);
      hard_W[r] = std::max<int64_t>(0, hard_W[r] - b_n[i]);
      p.backward_rows_W[r] += b_n[i];
    }
    split_cells(b_n.data(), p.forward_IW.data() + static_cast<int64_t>(off) * W, n, W,
                p.retained_IW.data() + static_cast<int64_t>(off) * W);
  }

  // memory and feasibility
  p.memory_W.resize(static_cast<size_t>(W));
  int64_t worst = 0;
  for (int32_t r = 0; r < W; ++r) {
    MemoryBreakdown& mb = p.memory_W[r];
    mb.base_experts = bytes.base_W[r];
    mb.replicas = bytes.replica_W[r];
    mb.forward_tokens = p.forward_rows_W[r] * m.forward_row_bytes;
    mb.backward_tokens = p.backward_rows_W[r] * m.backward_row_bytes;
    const int64_t over = mb.total() - p.limit_bytes;
    if (over > worst) {
      worst = over;
      p.binding_rank = r;
    }
  }
  if (worst > 0) {
    const MemoryBreakdown& mb = p.memory_W[p.binding_rank];
    p.feasible = false;
    p.binding = Binding::kMemory;
    p.shortfall = worst;
    p.reason = "memory: rank " + num(int64_t(p.binding_rank)) + " needs " + format_bytes(worst) +
               " more than budget - resident = " + format_bytes(p.limit_bytes) +
               " (base experts " + format_bytes(mb.base_experts) + ", replicas " +
               format_bytes(mb.replicas) + ", forward tokens " + format_bytes(mb.forward_tokens) +
               ", backward tokens " + format_bytes(mb.backward_tokens) + ")";
  } else if (in.backward_row_capacity > 0) {
    int64_t worst_rows = 0;
    for (int32_t r = 0; r < W; ++r)
      if (p.backward_rows_W[r] - in.backward_row_capacity > worst_rows) {
        worst_rows = p.backward_rows_W[r] - in.backward_row_capacity;
        p.binding_rank = r;
      }
    if (worst_rows > 0) {
      p.feasible = false;
      p.binding = Binding::kRowCapacity;
      p.shortfall = worst_rows;
      p.reason = "backward_row_capacity: rank " + num(int64_t(p.binding_rank)) + " computes " +
                 num(p.backward_rows_W[p.binding_rank]) + " retained rows, " + num(worst_rows) +
                 " over the capacity of " + num(in.backward_row_capacity);
    }
  }
  // lower bounds of the two objectives (plan.h; bound.h): the forward on the routed
  // demand, the backward on this plan's quotas
  const int64_t spare = spare_instances(in);
  p.forward_bound = rows_lower_bound(n_E, W, spare);
  p.backward_bound = quota_E == n_E ? p.forward_bound : rows_lower_bound(quota_E, W, spare);
  if (p.feasible) {
    p.binding_rank = -1;
  } else {
    if (unplaced > 0)
      p.reason += "; capacity-aware routing found no room for " + num(unplaced) +
                  " retained rows (first: expert " + num(int64_t(unplaced_expert)) + ")";
  }
  return p;
}

}  // namespace detail

int64_t Plan::max_forward_rows() const {
  return forward_rows_W.empty() ? 0 : *std::max_element(forward_rows_W.begin(), forward_rows_W.end());
}

int64_t Plan::max_backward_rows() const {
  return backward_rows_W.empty() ? 0 : *std::max_element(backward_rows_W.begin(), backward_rows_W.end());
}

PolicyKind policy_kind(const std::string& name) {
  if (name == "fixed") return PolicyKind::kFixed;
  if (name == "ultraep") return PolicyKind::kUltraEP;
  if (name == "symi") return PolicyKind::kSymi;
  if (name == "lrmoe") return PolicyKind::kLRMoE;
  throw std::invalid_argument("policy must be one of fixed, ultraep, symi, lrmoe; got '" + name + "'");
}

const char* policy_name(PolicyKind kind) {
  switch (kind) {
    case PolicyKind::kFixed: return "fixed";
    case PolicyKind::kUltraEP: return "ultraep";
    case PolicyKind::kSymi: return "symi";
    case PolicyKind::kLRMoE: return "lrmoe";
  }
  return "?";
}

Plan make_plan(const std::string& policy, const PlanInput& input) {
  Plan fresh = make_policy(policy)->plan(input);
  if (input.previous_instance_offsets.empty() && input.previous_instance_rank.empty() &&
      input.previous_instance_rows.empty())
    return fresh;
  return detail::with_hysteresis(input, std::move(fresh));
}

}  // namespace planner
}  // namespace lrmoe

#include "planner/policies.h"

namespace lrmoe {
namespace planner {

std::unique_ptr<Policy> make_policy(const std::string& name) {
  switch (policy_kind(name)) {
    case PolicyKind::kFixed: return make_fixed_policy();
    case PolicyKind::kUltraEP: return make_ultraep_policy();
    case PolicyKind::kSymi: return make_symi_policy();
    case PolicyKind::kLRMoE: return make_lrmoe_policy();
  }
  return nullptr;
}

}  // namespace planner
}  // namespace lrmoe
