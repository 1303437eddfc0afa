// The parts of the lrmoe._C module (csrc/python/module.cpp) that bind the plain C++
// programs: lrmoe._C.planner (planner_bindings.cpp) and lrmoe._C.sim (sim_bindings.cpp).
#pragma once

#include <pybind11/pybind11.h>

#include "planner/plan.h"

namespace lrmoe {
namespace python {

// Enums, MemoryModel, PlanInput, MemoryBreakdown, Plan and plan(policy, input).
void bind_planner(pybind11::module_ m);
// The cost and link structs, SimConfig, LayerResult, PressureResult and the simulator's
// entry points; after bind_planner (its structs name the planner's).
void bind_sim(pybind11::module_ m);

// Raises ValueError naming replica_slots / symi_slots when one exceeds num_experts.
void check_slots(const planner::PlanInput& in);

}  // namespace python
}  // namespace lrmoe
