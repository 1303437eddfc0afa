// A lower bound on the max rows per rank of any plan of an instance (reported with every
// plan: Plan::forward_bound, Plan::backward_bound; docs/planner.md, "Lower bound and
// exact optimum").
//
// Legend: W ranks, E experts, d_E rows per expert that some instance must compute
// (n_E for the forward, the quotas Q_E for the backward), D = sum(d), X spare
// instances (instances beyond one per expert that the slots allow in all).
#pragma once

#include <cstdint>
#include <vector>

#include "planner/plan.h"

namespace lrmoe {
namespace planner {

// The smallest T >= 0 (rows) such that
//   (a) W T >= D                                  (the rows fit on W ranks of T rows),
//   (b) d_e <= W T for every e                     (at most one instance per rank: an
//                                                   expert is spread over <= W ranks),
//   (c) sum_e max(0, ceil(d_e / T) - 1) <= X      (an instance on a rank computes at most
//                                                   that rank's T rows, so expert e needs
//                                                   ceil(d_e / T) instances, and only X
//                                                   exist beyond the first of each).
// Every plan whose ranks compute rows of these demands, with at most one instance of an
// expert per rank and at most E + X instances, has a rank with >= T rows: each of (a)-(c)
// fails below T for such a plan. Memory is not used: it can only forbid plans, so the
// bound holds for feasible and infeasible plans alike. O(E) when (c) holds at the bound
// of (a)-(b) (the usual case), else O(E log max(d)). Throws std::invalid_argument on
// W < 1, X < 0 or a negative demand.
int64_t rows_lower_bound(const std::vector<int64_t>& d_E, int32_t W, int64_t X);

// X of an instance, the most spare instances any policy's slots allow:
// max(R W, S W - E) with R = replica_slots (fixed ownership plus R replicas per rank:
// fixed [R unused], ultraep, lrmoe) and S = symi's slots per GPU (symi_slots, or
// ceil(E / W) + R), E instances being the one per expert that every policy places.
// With E % W == 0 and the default S both are R W.
int64_t spare_instances(const PlanInput& in);

}  // namespace planner
}  // namespace lrmoe
