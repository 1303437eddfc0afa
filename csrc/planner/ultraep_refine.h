// Optional passes over UltraEP's plan (PlanInput::ultraep_refine; docs/planner.md,
// "ultraep"): a local search that lowers the max rank load the bisection left.
//
// Legend as in plan.h: W ranks, E experts, n_E demand; an export is a replica of
// expert e on rank t computing `rows` of e's rows (detail::Replica), the owner keeping
// n_e - the exports of e.
#pragma once

#include <cstdint>
#include <vector>

#include "planner/common.h"

namespace lrmoe {
namespace planner {
namespace detail {

// Refinement passes from the oracle's exports. Each step takes the most loaded rank r*
// (the lowest index at the max T) and, over every instance of r* and every rank j != r*,
// the move of x rows to e's instance on j (or to a new replica there, if j has a free
// slot of replica_slots and x >= min_replica_rows) that minimises max(T - x, load_j + x),
// x <= (T - load_j) / 2, the donor keeping >= 1 row (an owner) or >= min_replica_rows (a
// replica), as the oracle does. Ties: an existing instance before a new replica, the
// node of r* (gpus_per_node) before others, then the lower rank. Applied only when it
// ends strictly below T; the sorted loads then decrease lexicographically, so it stops,
// and the max rank load never rises above the oracle's (tests/cpp/test_ultraep.cpp).
// Returns the number of moves made.
int64_t ultraep_refine(const PlanInput& in, const std::vector<int64_t>& n_E,
                       std::vector<Replica>* exports);

}  // namespace detail
}  // namespace planner
}  // namespace lrmoe
