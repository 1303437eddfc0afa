// The four placement policies (one file each; docs/planner.md, "Policies").
#pragma once

#include <memory>

#include "planner/plan.h"

namespace lrmoe {
namespace planner {

std::unique_ptr<Policy> make_fixed_policy();    // fixed.cpp: Megatron-LM fixed ownership
std::unique_ptr<Policy> make_ultraep_policy();  // ultraep.cpp: quota oracle + bisection
std::unique_ptr<Policy> make_symi_policy();     // symi.cpp: popularity-proportional slots
std::unique_ptr<Policy> make_lrmoe_policy();    // lrmoe.cpp: quotas and replicas jointly

}  // namespace planner
}  // namespace lrmoe
