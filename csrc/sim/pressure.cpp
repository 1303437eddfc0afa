// Batch pressure (sim.h simulate_pressure): the loads multiplied by m, split into
// micro-batches until one fits, with the whole model's activations of activations.h
// added to the resident (docs/simulation.md, "Batch pressure").
#include <atomic>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "planner/common.h"
#include "planner/plan.h"
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

// simulate_pressure of in.load_WE with the GEMM table cached per thread, moves counted
// against prev_off / prev_rank (time_plan; null: none) and the plan of the reported
// micro-batch (the one that fits, else k = 1's) stored in *plan_out when non-null.
PressureResult pressure_cell(const std::string& policy, const planner::PlanInput& base,
                             double multiplier, int32_t max_micro, const SimConfig& cfg,
                             std::optional<GemmTable>* gemm, const std::vector<int32_t>* prev_off,
                             const std::vector<int32_t>* prev_rank, planner::Plan* plan_out) {
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
    planner::Plan plan;
    if (act > free_bytes) {
      r = activations_do_not_fit(in, act);
    } else {
      in.memory.resident_bytes = base.memory.resident_bytes + act;
      // make_plan: hysteresis when `in` carries a previous placement
      plan = planner::make_plan(policy, in);
      r = detail::time_plan(plan, in, cfg, gemm, prev_off, prev_rank);
    }
    if (k == 1 || r.feasible) {
      pr.layer = r;
      pr.activation_bytes = act;
      if (plan_out) *plan_out = std::move(plan);
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

}  // namespace

PressureResult simulate_pressure(const std::string& policy, const planner::PlanInput& base,
                                 double multiplier, int32_t max_micro, const SimConfig& cfg) {
  std::optional<GemmTable> gemm;
  const bool prev = !base.previous_instance_offsets.empty();
  return pressure_cell(policy, base, multiplier, max_micro, cfg, &gemm,
                       prev ? &base.previous_instance_offsets : nullptr,
                       prev ? &base.previous_instance_rank : nullptr, nullptr);
}

std::vector<PressureResult> simulate_pressure_trace(const std::string& policy,
                                                    const planner::PlanInput& base,
                                                    const std::vector<int64_t>& loads_SLWE,
                                                    int64_t steps, int64_t layers,
                                                    double multiplier, int32_t max_micro,
                                                    const SimConfig& cfg, int32_t threads) {
  const size_t cell = static_cast<size_t>(base.num_ranks) * base.num_experts;
  if (steps < 1 || layers < 1 || loads_SLWE.size() != static_cast<size_t>(steps * layers) * cell)
    throw std::invalid_argument("loads must hold steps x layers x W x E entries");
  if (threads < 1) throw std::invalid_argument("threads must be >= 1");
  const bool symi = planner::policy_kind(policy) == planner::PolicyKind::kSymi;
  // as simulate_trace: whole layers per thread when a layer's steps depend on each other
  const detail::Chaining chain = detail::chaining(cfg, symi);
  const bool hysteresis = chain.hysteresis, chained = chain.chained;
  const int64_t N = steps * layers, units = chained ? layers : N;
  std::vector<PressureResult> out(static_cast<size_t>(N));
  std::atomic<int64_t> next{0};
  auto work = [&](int32_t) {
    planner::PlanInput in = base;
    detail::clear_previous(&in);
    if (hysteresis) in.replan_threshold = cfg.replan_threshold;
    std::optional<GemmTable> gemm;
    std::vector<int32_t> prev_off, prev_rank;
    planner::Plan plan;
    for (int64_t u = next++; u < units; u = next++) {
      prev_off.clear();
      prev_rank.clear();
      detail::clear_previous(&in);
      for (int64_t s = 0; s < (chained ? steps : 1); ++s) {
        const int64_t j = chained ? s * layers + u : u;
        const int64_t* now = loads_SLWE.data() + static_cast<size_t>(j) * cell;
        in.load_WE.assign(now, now + cell);
        plan = planner::Plan();
        out[static_cast<size_t>(j)] =
            pressure_cell(policy, in, multiplier, max_micro, cfg, &gemm,
                          chained ? &prev_off : nullptr, chained ? &prev_rank : nullptr,
                          chained ? &plan : nullptr);
        if (!chained || plan.instance_offsets.empty()) continue;  // no plan: keep the last
        prev_off = plan.instance_offsets;
        prev_rank = plan.instance_rank;
        if (hysteresis) detail::hand_on(plan, &in);
      }
    }
  };
  detail::on_threads(threads, work);
  return out;
}

}  // namespace sim
}  // namespace lrmoe
