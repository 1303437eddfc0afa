// The joint lrmoe objective: where to cut and where to replicate decided together
// (docs/planner.md, "lrmoe, joint objective").
//
// Legend as in plan.h: W ranks, E experts, I instances; per instance i of expert e on
// rank r, f_i forward rows and b_i <= f_i retained rows. Rank time in rows:
//   t_r = F_r + B_r + kappa x (replicas placed on r),  F_r = sum f_i, B_r = sum b_i,
// kappa = PlanInput::replica_cost_rows (one replica's weight push and grad reduce,
// policies.md: W forward + W backward + Gr bytes, expressed in the time of one row).
#pragma once

#include <cstdint>
#include <vector>

#include "planner/plan.h"

namespace lrmoe {
namespace planner {

// t_r of every rank of `plan` (W entries, rows), with kappa = replica_cost_rows per
// replica (instances beyond an expert's first). Throws std::invalid_argument when
// replica_cost_rows < 0.
std::vector<int64_t> rank_times(const Plan& plan, int64_t replica_cost_rows);

namespace detail {

// Local search on T = max_r t_r from lrmoe's sequential plan `start` (lrmoe.cpp steps
// 1-4). Each step takes, at the bottleneck rank r* (the lowest index of those at T), the
// move that lowers max(t_r*, t_j) the most, strictly below T:
//   - rows of an instance on r* to expert e's instance on rank j, or to a new replica
//     there (a free slot of replica_slots; kappa charged to j): df forward rows carrying
//     db retained ones, b <= f kept on both sides;
//   - a cut moved (c as a budget): db retained rows of an expert on r* are dropped (not
//     below floor_E) and as many rows of another expert, already computed forward on a
//     rank j != r* but not retained, are retained instead; the total dropped is unchanged.
// A receiver must stay within its memory limit and backward_row_capacity; the donor only
// sheds rows. The sorted vector of t decreases lexicographically at every step, so the
// search ends; T never exceeds start's, and the plan is feasible whenever start is.
// Replicas left with no rows are removed. Returns the assembled plan (common.h).
Plan joint_refine(const PlanInput& in, const Plan& start, const std::vector<int64_t>& floor_E);

}  // namespace detail
}  // namespace planner
}  // namespace lrmoe
