// Internal helpers shared by the policies: input checks, the fixed owner map, and
// assemble(), which turns a layout (instances and their forward rows) plus quotas
// into a Plan with capacity-aware retained shares and the memory breakdown.
//
// Legend as in plan.h: W ranks, E experts, I instances, L_WE loads, n_E demand.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "planner/plan.h"

namespace lrmoe {
namespace planner {
namespace detail {

// Throws std::invalid_argument naming the argument and the fix.
void validate(const PlanInput& in, PolicyKind kind);

// n_E = sum_s L_WE.
std::vector<int64_t> expert_loads(const PlanInput& in);

// G of PlanInput::gpus_per_node (0 there: W, one node); node(r) = r / G.
inline int32_t node_size(const PlanInput& in) {
  return in.gpus_per_node > 0 && in.gpus_per_node < in.num_ranks ? in.gpus_per_node : in.num_ranks;
}

// Megatron-LM fixed ownership: owner(e) = e / (E / W) (E a multiple of W).
inline int32_t fixed_owner(int32_t e, int32_t E, int32_t W) { return e / (E / W); }

// Where each expert's instances sit and how many forward rows each computes, flat
// (one allocation per array: at E = 128 a vector per expert cost more than the plan).
struct Layout {
  std::vector<int32_t> offsets;  // E + 1: instances of e are [offsets[e], offsets[e + 1])
  std::vector<int32_t> rank;     // I: owner first
  std::vector<int64_t> rows;     // I: forward rows per instance (sum over e's = n_e)
};

// A replica added to fixed ownership: `rows` of the expert's rows move from its owner.
struct Replica {
  int32_t expert, rank;
  int64_t rows;
};

// Fixed ownership (one instance per expert at its owner with all n_e rows) plus
// `replicas`, each after its expert's owner in the order given.
Layout fixed_layout(const PlanInput& in, const std::vector<int64_t>& n_E,
                    const std::vector<Replica>& replicas = {});

struct RankBytes {
  std::vector<int64_t> base_W;     // base expert bytes per rank
  std::vector<int64_t> replica_W;  // replica bytes per rank
};

// Builds the plan: forward split (route.h split_forward), retained shares (route.h,
// bounded by each rank's remaining backward rows when `bounded`, and then also by
// `target_rows` > 0 per rank where it can be met), rows per rank, memory and
// feasibility (the reason names the binding constraint and by how much). With
// `retained_I` (I entries, 0 <= retained_I[i] <= layout.rows[i], summing to quota_E[e]
// over e's instances) the retained rows per instance are taken as given instead.
Plan assemble(const PlanInput& in, PolicyKind kind, const Layout& layout,
              const std::vector<int64_t>& quota_E, const RankBytes& bytes, bool bounded,
              int64_t target_rows = 0, const std::vector<int64_t>* retained_I = nullptr);

// "1.234 GiB (1325000000 bytes)"
std::string format_bytes(int64_t bytes);

}  // namespace detail
}  // namespace planner
}  // namespace lrmoe
