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
#include "sim/step.h"

namespace lrmoe {
namespace sim {

// One (step, layer) of the cluster: the slowest group's time and which group it was.
struct ClusterLayer {
  bool feasible = true;      // every group's plan fits
  double time_ms = 0;        // max over groups of fwd_ms + bwd_ms (NaN when infeasible)
  int32_t slowest_group = -1;
  double mean_group_ms = 0;  // mean over the feasible groups (NaN when none)
  // the step terms' inputs (step.h), each the largest over groups: the most experts a
  // rank owns, and symi's weight broadcast of this layer's copies (NaN when infeasible)
  int32_t owned_experts_max = 0;
  double broadcast_ms = 0;
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

// One step of the cluster: its MoE layers (each the slowest group's, ClusterLayer) and
// the terms outside them (step.h), in sequence; a step of StepModel::moe_layers layers.
struct ClusterStep {
  bool feasible = true;       // every layer of every group fits
  double moe_ms = 0;          // sum over layers of ClusterLayer::time_ms (NaN: infeasible)
  double mean_group_moe_ms = 0;  // sum over layers of the mean group's (NaN: infeasible)
  StepTerms terms;            // NaN fields when infeasible
  double total_ms() const { return moe_ms + terms.total_ms(); }
};

// The steps of simulate_cluster's S x Lyr results `layers_SL` (step, layer order) on a
// cluster of m.dp_size groups of `num_ranks` ranks: the MoE layers summed per step, plus
// step_terms(num_ranks, sum over layers of owned_experts_max, sum over layers of
// broadcast_ms, expert_grad_bytes, link, m), every sum over the simulated layers times
// m.moe_layers / layers when m.moe_layers > 0 (the simulated layers stand for the
// model's, as their mean) -- the rank that owns the most experts of
// each layer taken as one rank, an upper bound where the busiest owners differ (they do
// not under the balanced ownership every policy starts from: E / W per rank), and each
// layer's broadcast its own all-to-all, the slowest group's. Throws
// std::invalid_argument when layers_SL does not hold steps x layers results (naming
// them), m.moe_layers < 0, and as step_terms.
std::vector<ClusterStep> cluster_steps(const std::vector<ClusterLayer>& layers_SL, int64_t steps,
                                       int64_t layers, int32_t num_ranks,
                                       double expert_grad_bytes, const LinkModel& link,
                                       const StepModel& m);

}  // namespace sim
}  // namespace lrmoe
