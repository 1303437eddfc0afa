// Hysteresis across micro-batches and layers: keep the previous placement (its
// replica slots reused, no weights copied) unless a new plan is better by more than a
// threshold (docs/planner.md, "Hysteresis").
//
// Legend as in plan.h: W ranks, E experts, I instances. Rank time in rows, as in
// joint.h: t_r = forward rows + retained rows (+ replica_cost_rows per replica with
// PlanInput::joint); T = max_r t_r.
#pragma once

#include "planner/plan.h"

namespace lrmoe {
namespace planner {
namespace detail {

// The plan of `in` on the previous placement (PlanInput::previous_instance_*): the same
// instances, each expert's n_e split over them by largest remainder in proportion to
// their previous forward rows (all to the owner when those are 0), the forward split,
// retained shares (the fresh plan's quotas) and memory assembled as the policy does
// (ultraep: R slots reserved; lrmoe: placed replicas, bounded retained shares and its
// balance target). Throws std::invalid_argument naming the field when the placement is
// malformed (offsets not E + 1 increasing from 0, a rank out of [0, W), two instances
// of an expert on one rank, an owner not first, more replicas on a rank than
// replica_slots, rows not one per instance or negative) or the policy is symi.
Plan kept_plan(const PlanInput& in, const Plan& fresh);

// Chooses between `fresh` (the policy's plan of `in`) and kept_plan: the kept one iff it
// is feasible and (fresh is not, or T_fresh >= (1 - replan_threshold) T_kept, i.e. the
// new plan is not better by more than the threshold fraction). Sets kept_previous,
// moved_replicas and moved_bytes on the result. Throws std::invalid_argument when
// replan_threshold is not in [0, 1).
Plan with_hysteresis(const PlanInput& in, Plan fresh);

}  // namespace detail
}  // namespace planner
}  // namespace lrmoe
