// A whole cluster: every expert-parallel group of W / ep data-parallel copies simulated
// on its own loads (issue 30: one representative group made the cost per token flat
// beyond 128 GPUs by construction). The step's MoE layer waits for its slowest group:
// the groups' data-parallel gradient reduction synchronises them (docs/simulation.md,
// "64-1024 GPUs").
//
// Legend: S steps, Gr groups, Lyr layers, W ranks of one group, E experts.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "sim/sim.h"

namespace lrmoe {
namespace sim {

// One (step, layer) of the cluster: the slowest group's time and which group it was.
struct ClusterLayer {
  bool feasible = true;      // every group's plan fits
  double time_ms = 0;        // max over groups of fwd_ms + bwd_ms (NaN when infeasible)
  int32_t slowest_group = -1;
  double mean_group_ms = 0;  // mean over the feasible groups (NaN when none)
};

// Every (step, group, layer) of loads_SGLWE (S x Gr x Lyr x W x E, row-major) under
// `policy` on `threads` threads; symi gets the same group's same layer one step earlier
// (previous_GLWE, Gr x Lyr x W x E, for the first step when given). Returns S x Lyr
// results in (step, layer) order. Throws std::invalid_argument on sizes that do not
// match (naming the argument) and whatever simulate_trace throws.
std::vector<ClusterLayer> simulate_cluster(const std::string& policy,
                                           const planner::PlanInput& base,
                                           const std::vector<int64_t>& loads_SGLWE,
                                           int64_t steps, int64_t groups, int64_t layers,
                                           const SimConfig& cfg, int32_t threads,
                                           const std::vector<int64_t>* previous_GLWE = nullptr);

// The same over loads the caller keeps (sim.h CellLoads): cell j = (step x groups +
// group) x layers + layer; j < 0 asks for the first step's previous cell j + groups x
// layers (nullptr: none). bench_sim points into its pool of draws instead of copying
// them. Throws as above.
std::vector<ClusterLayer> simulate_cluster(const std::string& policy,
                                           const planner::PlanInput& base,
                                           const CellLoads& loads, int64_t steps,
                                           int64_t groups, int64_t layers,
                                           const SimConfig& cfg, int32_t threads);

}  // namespace sim
}  // namespace lrmoe
