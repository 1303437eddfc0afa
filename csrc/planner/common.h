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

// Megatron-LM fixed ownership: owner(e) = e / (E / W) (E a multiple of W).
inline int32_t fixed_owner(int32_t e, int32_t E, int32_t W) { return e / (E / W); }

// Where each expert's instances sit and how many forward rows each computes.
struct Layout {
  std::vector<std::vector<int32_t>> rank_E;  // per expert: owner first
  std::vector<std::vector<int64_t>> rows_E;  // forward rows per instance (sum = n_e)
};

// Layout of fixed ownership: one instance per expert at its owner with all n_e rows.
Layout fixed_layout(const PlanInput& in, const std::vector<int64_t>& n_E);

struct RankBytes {
  std::vector<int64_t> base_W;     // base expert bytes per rank
  std::vector<int64_t> replica_W;  // replica bytes per rank
};

// Builds the plan: forward split (route.h split_forward), retained shares (route.h,
// bounded by each rank's remaining backward rows when `bounded`), rows per rank,
// memory and feasibility. `hint` is appended to the reason of an infeasible plan.
Plan assemble(const PlanInput& in, PolicyKind kind, const Layout& layout,
              const std::vector<int64_t>& quota_E, const RankBytes& bytes, bool bounded,
              const std::string& hint = "");

// "1.234 GiB (1325000000 bytes)"
std::string format_bytes(int64_t bytes);

}  // namespace detail
}  // namespace planner
}  // namespace lrmoe
