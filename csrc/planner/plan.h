// Plan types of the placement planner: what a policy reads and what it decides.
//
// Plain C++17, no torch: the runtime (through the lrmoe._C binding), the tests and
// the simulator share this code. docs/planner.md describes every field and policy.
//
// Legend: W ranks of the expert-parallel group (= source ranks), E experts,
// I expert instances of a plan (owner copies + replicas; NOT the intermediate size),
// L_WE routed pairs from source s to expert e (row-major, s * E + e),
// n_E = sum_s L_WE (routed demand per expert), Q_E retention quotas,
// F_IW forward rows from source s computed on instance i, B_IW retained rows
// (backward share) of the (source s, instance i) cell. Bytes are plain bytes.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/quota.h"

namespace lrmoe {
namespace planner {

// What one expert copy and one token row cost on a rank (docs/planner.md, "Memory model").
struct MemoryModel {
  int64_t expert_weight_bytes = 0;     // one copy's weights (bf16)
  int64_t expert_grad_bytes = 0;       // one copy's gradient buffer (fp32)
  int64_t expert_optimizer_bytes = 0;  // master weights + Adam moments of one expert
  bool optimizer_on_device = true;     // false: optimizer state offloaded to the host
  int64_t forward_row_bytes = 0;       // per routed row computed on the rank (dispatched x,
                                       // saved activations, expert output)
  int64_t backward_row_bytes = 0;      // per retained row (gradient row, gathered
                                       // activations, backward workspace, dx row)
  int64_t budget_bytes = 0;            // B: device memory per GPU
  int64_t resident_bytes = 0;          // parameters, optimizer, attention activations
                                       // outside this layer's experts and token buffers
                                       // (batch pressure adds the whole model's
                                       // activations here: sim/activations.h)
};

enum class PolicyKind : int { kFixed = 0, kUltraEP = 1, kSymi = 2, kLRMoE = 3 };

struct PlanInput {
  int32_t num_ranks = 1;         // W
  int32_t num_experts = 1;       // E
  std::vector<int64_t> load_WE;  // L[s][e] >= 0, W * E entries
  MemoryModel memory;
  double recalibration_rate = 0.0;  // c in [0, 1); only the lrmoe policy cuts demand
  core::QuotaRule quota_rule = core::QuotaRule::kProportional;
  int32_t replica_slots = 2;      // R: spare expert slots per rank (ultraep, symi, lrmoe)
  int32_t symi_slots = 0;         // S slots per GPU for symi; 0 = ceil(E / W) + R
  // symi plans from the previous step's popularity n_E (empty: the current loads)
  std::vector<int64_t> previous_load_E;
  double max_expert_cut = 0.5;       // lrmoe: no expert keeps fewer than (1 - this) n_e
  int64_t backward_row_capacity = 0; // most retained rows per rank (0: memory only); a
                                     // constraint for every policy
  // lrmoe: < 0 off; >= 0 aims at most (1 + balance_slack) x the mean retained rows per
  // rank: a target met with the replica slots the hard limits leave; it never cuts
  // demand and never makes a plan infeasible
  double balance_slack = -1.0;
  int64_t min_replica_rows = 1;      // ultraep u_min: fewest rows worth a replica
  // lrmoe: true refines the sequential plan (cut, then replicas) by local search on one
  // objective, max_r t_r with t_r = forward rows + retained rows + replica_cost_rows x
  // replicas placed on r, with c as a budget on the total rows dropped (joint.h)
  bool joint = false;
  int64_t replica_cost_rows = 0;     // kappa >= 0: one replica's traffic in row-times
  // Topology: ranks r and j share a node (an NVLink domain) iff r / G == j / G, with G =
  // gpus_per_node; 0 means G = W (one node), which reproduces the flat plans exactly.
  // lrmoe (and its joint refinement) and ultraep place a replica on a rank of the
  // owner's node when one can take rows, and the forward split of every policy fills a
  // source's own-node instances before remote ones (docs/planner.md, "Topology").
  int32_t gpus_per_node = 0;
  // Hysteresis (hysteresis.h; docs/planner.md, "Hysteresis"): the previous plan's
  // placement, instance_offsets (E + 1) and instance_rank (I) as in Plan, and the forward
  // rows of each of its instances (I); empty: none. make_plan keeps that placement (its
  // instances, their rows re-split in proportion to these) unless the new plan's max
  // rank time is lower by more than replan_threshold x the kept plan's. fixed, ultraep
  // and lrmoe only (symi's slots move every step by design).
  std::vector<int32_t> previous_instance_offsets;
  std::vector<int32_t> previous_instance_rank;
  std::vector<int64_t> previous_instance_rows;
  double replan_threshold = 0.0;     // in [0, 1): 0 replans whenever strictly better
  // ultraep: after the bisection, refinement passes (ultraep_refine.h) lower the max
  // rank load by local moves of rows between instances (off by default: the plans of
  // docs/planner.md's tables are without them)
  bool ultraep_refine = false;
  // every policy: the forward rows left after the own-rank (and own-node) passes are
  // dealt to the instances in proportion to their remaining capacity, source by source
  // (largest remainder; UltraEP's rule, ../shared/policies.md), instead of north-west
  bool spare_capacity_split = false;
};

// Per-rank bytes of the layer's experts and token buffers, against limit = B - resident.
struct MemoryBreakdown {
  int64_t base_experts = 0;     // owned experts: weights + grads (+ optimizer on device)
  int64_t replicas = 0;         // replica weights + grads (reserved slots or placed copies)
  int64_t forward_tokens = 0;   // forward rows x forward_row_bytes
  int64_t backward_tokens = 0;  // retained rows x backward_row_bytes
  int64_t total() const { return base_experts + replicas + forward_tokens + backward_tokens; }
};

// Which constraint makes a plan infeasible (kNone: it fits).
enum class Binding : int {
  kNone = 0,
  kMemory = 1,          // a rank's bytes exceed budget - resident
  kRowCapacity = 2,     // retained rows exceed backward_row_capacity on a rank
  kReplicaSlots = 3,    // the retained load needs more replicas than the free slots
};

struct Plan {
  PolicyKind policy = PolicyKind::kFixed;
  int32_t num_ranks = 0, num_experts = 0;
  // instances of expert e: indices [instance_offsets[e], instance_offsets[e + 1]);
  // the first is the owner (for symi: the copy placed first), the rest replicas
  std::vector<int32_t> instance_offsets;  // E + 1
  std::vector<int32_t> instance_rank;     // I, at most one instance of an expert per rank
  std::vector<int64_t> forward_IW;        // F: sum over an expert's instances = L[s][e]
  std::vector<int64_t> retained_IW;       // B <= F, sum over an expert's cells = Q_e
  std::vector<int64_t> quota_E;           // Q
  std::vector<int64_t> fixed_rows_W;      // rows per rank under fixed ownership ("before")
  std::vector<int64_t> forward_rows_W;    // rows each rank computes in the forward
  std::vector<int64_t> backward_rows_W;   // retained rows each rank computes in the backward
  std::vector<MemoryBreakdown> memory_W;
  int64_t limit_bytes = 0;                // budget - resident, the same for every rank
  int32_t replicas = 0;                   // instances beyond the owners
  bool feasible = true;
  Binding binding = Binding::kNone;
  int32_t binding_rank = -1;              // the rank worst over its limit (-1: none)
  int64_t shortfall = 0;                  // bytes (kMemory) or rows over the limit
  std::string reason;                     // empty when feasible
  // Lower bounds (rows) on the objectives max_r forward_rows_W[r] and max_r
  // backward_rows_W[r] (planner/bound.h rows_lower_bound; docs/planner.md, "Lower bound and
  // exact optimum"). forward_bound uses the routed demand n_E, which every policy computes
  // exactly once in the forward: the same for every policy of an instance, and <= the max
  // forward rows of every plan of it (feasible or not). backward_bound uses this plan's
  // quota_E: for the baselines Q = n (it equals forward_bound); for lrmoe it bounds every
  // plan that retains these quotas, i.e. it measures where the retained rows went, not
  // how many were cut (lrmoe may cut below Q(c) under the budget, so a bound from Q(c)
  // would not hold). Both use the spare instances of every policy's slots
  // (bound.h spare_instances) and no memory: memory can only forbid plans.
  int64_t forward_bound = 0;
  int64_t backward_bound = 0;
  // Hysteresis (set only when PlanInput has a previous placement): whether the previous
  // placement was kept, the replicas of this plan absent from it (expert, rank pairs),
  // and the weight bytes that placing them copies (moved_replicas x expert_weight_bytes;
  // a replica's grad buffer is zeroed in place, not transferred).
  bool kept_previous = false;
  int32_t moved_replicas = 0;
  int64_t moved_bytes = 0;

  int64_t max_forward_rows() const;       // max_r forward_rows_W[r] (0 when W = 0)
  int64_t max_backward_rows() const;      // max_r backward_rows_W[r]

  int32_t num_instances() const { return static_cast<int32_t>(instance_rank.size()); }
};

// One interface for every placement policy. plan() is a pure function of its input:
// every rank computes the same plan from the same all-gathered counts.
class Policy {
 public:
  virtual ~Policy() = default;
  virtual PolicyKind kind() const = 0;
  virtual const char* name() const = 0;
  // Throws std::invalid_argument naming the argument on bad input.
  virtual Plan plan(const PlanInput& input) const = 0;
};

// "fixed" | "ultraep" | "symi" | "lrmoe"; throws std::invalid_argument otherwise.
std::unique_ptr<Policy> make_policy(const std::string& name);
PolicyKind policy_kind(const std::string& name);
const char* policy_name(PolicyKind kind);

// Plan with the named policy (make_policy(name)->plan(input)), then, when the input has
// a previous placement, the hysteresis rule of hysteresis.h.
Plan make_plan(const std::string& policy, const PlanInput& input);

}  // namespace planner
}  // namespace lrmoe
