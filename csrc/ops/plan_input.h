// The planner's settings from the arguments the plan and sim ops share
// (csrc/ops/plan.cpp, csrc/ops/sim.cpp): one place that checks and converts them.
#pragma once

#include <ATen/ATen.h>

#include <string>

#include "ops/common.h"
#include "planner/plan.h"

namespace lrmoe {

// W ranks, E experts; memory_bytes: the 7 sizes of lrmoe/planner.py MemoryModel.as_list
// (weight, grad, optimizer, forward row, backward row, budget, resident; bytes).
// Raises ValueError-style LRMOE_CHECK errors naming memory_bytes / quota_rule.
inline planner::PlanInput plan_input(int64_t W, int64_t E, c10::IntArrayRef memory_bytes,
                                     bool optimizer_on_device, double recalibration_rate,
                                     c10::string_view quota_rule, int64_t replica_slots,
                                     int64_t symi_slots, double max_expert_cut,
                                     int64_t backward_row_capacity, int64_t min_replica_rows,
                                     double balance_slack) {
  LRMOE_CHECK(memory_bytes.size() == 7, "memory_bytes must hold 7 sizes (weight, grad, "
              "optimizer, forward row, backward row, budget, resident), got ", memory_bytes.size());
  const std::string rule(quota_rule);
  LRMOE_CHECK(rule == "proportional" || rule == "water_level",
              "quota_rule must be 'proportional' or 'water_level', got '", rule, "'");
  // the planner holds slot counts as int32: bound them first, by E, which no policy can
  // use more of (a rank holds at most one instance of each expert), so that a huge value
  // is refused instead of wrapping around
  LRMOE_CHECK(replica_slots <= E, "replica_slots must be <= the number of experts (E=", E,
              "; a rank holds at most one instance of each expert), got ", replica_slots);
  LRMOE_CHECK(symi_slots <= E, "symi_slots must be <= the number of experts (E=", E,
              "; 0: ceil(E / W) + replica_slots), got ", symi_slots);
  planner::PlanInput in;
  in.num_ranks = static_cast<int32_t>(W);
  in.num_experts = static_cast<int32_t>(E);
  in.memory = {memory_bytes[0], memory_bytes[1], memory_bytes[2], optimizer_on_device,
               memory_bytes[3], memory_bytes[4], memory_bytes[5], memory_bytes[6]};
  in.recalibration_rate = recalibration_rate;
  in.quota_rule = rule == "water_level" ? core::QuotaRule::kWaterLevel : core::QuotaRule::kProportional;
  in.replica_slots = static_cast<int32_t>(replica_slots);
  in.symi_slots = static_cast<int32_t>(symi_slots);
  in.max_expert_cut = max_expert_cut;
  in.backward_row_capacity = backward_row_capacity;
  in.min_replica_rows = min_replica_rows;
  in.balance_slack = balance_slack;
  return in;
}

}  // namespace lrmoe
