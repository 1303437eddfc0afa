// Batch pressure (sim.h simulate_pressure): the loads multiplied by m, split into
// micro-batches until one fits, with the whole model's activations of activations.h
// added to the resident (docs/simulation.md, "Batch pressure").
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "planner/common.h"
#include "sim/activations.h"
#include "sim/sim.h"

namespace lrmoe {
namespace sim {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// A micro-batch whose all-layer activations (act bytes) alone exceed budget - resident:
// infeasible on memory before any plan (simulate_pressure), its times NaN.
LayerResult activations_do_not_fit(const planner::PlanInput& in, int64_t act) {
  LayerResult r;
  r.feasible = false;
  r.binding = planner::Binding::kMemory;
  r.limit_bytes = in.memory.budget_bytes - in.memory.resident_bytes - act;
  r.reason = "the activations of all layers (" + planner::detail::format_bytes(act) +
             ") exceed budget - resident (" +
             planner::detail::format_bytes(in.memory.budget_bytes - in.memory.resident_bytes) +
             "); more micro-batches, --activations recompute or a smaller resident";
  for (int64_t v : in.load_WE) r.pairs += v;
  for (double* t : {&r.fwd_ms, &r.bwd_ms, &r.src_fwd_ms, &r.dispatch_ms, &r.expert_fwd_ms,
                    &r.combine_ms, &r.src_bwd_ms, &r.grad_a2a_ms, &r.expert_bwd_ms,
                    &r.dx_a2a_ms, &r.replica_ms, &r.offload_ms, &r.broadcast_ms,
                    &r.overlap_fwd_ms, &r.overlap_bwd_ms})
    *t = kNaN;
  return r;
}

}  // namespace

PressureResult simulate_pressure(const std::string& policy, const planner::PlanInput& base,
                                 double multiplier, int32_t max_micro, const SimConfig& cfg) {
  if (!(multiplier > 0)) throw std::invalid_argument("batch multiplier must be > 0");
  if (max_micro < 1) throw std::invalid_argument("max_micro_batches must be >= 1");
  validate_activations(cfg.activations);
  const bool all_layers = cfg.activations.mode != ActivationMode::kLayer;
  const bool recompute = cfg.activations.mode == ActivationMode::kRecompute;
  const int64_t free_bytes = base.memory.budget_bytes - base.memory.resident_bytes;
  PressureResult pr;
  planner::PlanInput in = base;
  for (int32_t k = 1; k <= max_micro; ++k) {
    for (size_t j = 0; j < base.load_WE.size(); ++j)
      in.load_WE[j] = static_cast<int64_t>(std::ceil(static_cast<double>(base.load_WE[j]) * multiplier / k - 1e-9));
    int64_t act = 0;
    if (all_layers)
      act = activation_bytes(cfg.activations,
                             tokens_per_gpu(in.load_WE, in.num_ranks, in.num_experts,
                                            cfg.activations.top_k)).total();
    LayerResult r;
    if (act > free_bytes) {
      r = activations_do_not_fit(in, act);
    } else {
      in.memory.resident_bytes = base.memory.resident_bytes + act;
      r = simulate_layer(policy, in, cfg);
    }
    if (k == 1 || r.feasible) {
      pr.layer = r;
      pr.activation_bytes = act;
    }
    if (r.feasible) {
      pr.micro_batches = k;
      pr.recompute_ms = recompute ? k * r.fwd_ms : 0.0;
      pr.time_ms = k * (r.fwd_ms + r.bwd_ms) + pr.recompute_ms;
      return pr;
    }
  }
  pr.time_ms = kNaN;
  pr.recompute_ms = kNaN;
  return pr;
}

}  // namespace sim
}  // namespace lrmoe
