// The per-trace driver of the simulator (sim.h simulate_trace): every (step, layer) cell
// of a routing trace planned and timed on a thread pool; with hysteresis (or resident
// replicas) each layer's steps in order, the plan of one step handed to the next.
//
// Legend as in sim.h: S steps, Lyr layers, W ranks, E experts, I instances.
#include <atomic>
#include <functional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "planner/plan.h"
#include "sim/sim.h"

namespace lrmoe {
namespace sim {

std::vector<LayerResult> simulate_trace(const std::string& policy, const planner::PlanInput& base,
                                        const std::vector<int64_t>& loads_SLWE, int64_t steps,
                                        int64_t layers, const SimConfig& cfg, int32_t threads,
                                        const std::vector<int64_t>* previous_LWE) {
  const size_t cell = static_cast<size_t>(base.num_ranks) * base.num_experts;
  if (steps < 1 || layers < 1 || loads_SLWE.size() != static_cast<size_t>(steps * layers) * cell)
    throw std::invalid_argument("loads must hold steps x layers x W x E entries");
  if (previous_LWE && previous_LWE->size() != static_cast<size_t>(layers) * cell)
    throw std::invalid_argument("previous loads must hold layers x W x E entries");
  const CellLoads at = [&](int64_t j) -> const int64_t* {
    if (j >= 0) return loads_SLWE.data() + static_cast<size_t>(j) * cell;
    return previous_LWE ? previous_LWE->data() + static_cast<size_t>(j + layers) * cell : nullptr;
  };
  return simulate_trace(policy, base, at, steps, layers, cfg, threads);
}

namespace detail {

Chaining chaining(const SimConfig& cfg, bool symi) {
  if (!(cfg.replan_threshold < 1.0))
    throw std::invalid_argument("replan_threshold must be < 0 (hysteresis off) or in [0, 1) "
                                "(the fraction of the kept plan's max rank time a fresh plan "
                                "must save), got " + std::to_string(cfg.replan_threshold));
  Chaining c;
  c.hysteresis = cfg.replan_threshold >= 0.0;
  if (c.hysteresis && symi)
    throw std::invalid_argument("replan_threshold (hysteresis, --replan-threshold) applies to "
                                "fixed, ultraep and lrmoe; symi re-places its slots every step "
                                "by design: set it < 0 for symi");
  // a layer's cells depend on its previous step: hysteresis keeps that placement, and
  // resident replicas pay for the ones it does not have (sim.h SimConfig)
  c.chained = c.hysteresis || (cfg.resident_replicas && !symi);
  return c;
}

void hand_on(const planner::Plan& plan, planner::PlanInput* in) {
  const size_t W = static_cast<size_t>(plan.num_ranks);
  in->previous_instance_offsets = plan.instance_offsets;
  in->previous_instance_rank = plan.instance_rank;
  in->previous_instance_rows.assign(plan.instance_rank.size(), 0);
  for (size_t i = 0; i < plan.instance_rank.size(); ++i)
    for (size_t s = 0; s < W; ++s) in->previous_instance_rows[i] += plan.forward_IW[i * W + s];
}

void clear_previous(planner::PlanInput* in) {
  in->previous_instance_offsets.clear();
  in->previous_instance_rank.clear();
  in->previous_instance_rows.clear();
}

void on_threads(int32_t threads, const std::function<void(int32_t)>& work) {
  std::vector<std::string> errors(static_cast<size_t>(threads));
  auto guarded = [&](int32_t t) {
    try {
      work(t);
    } catch (const std::exception& e) {
      errors[static_cast<size_t>(t)] = e.what();
    }
  };
  if (threads == 1) {
    guarded(0);
  } else {
    std::vector<std::thread> pool;
    for (int32_t t = 0; t < threads; ++t) pool.emplace_back(guarded, t);
    for (auto& th : pool) th.join();
  }
  for (const auto& e : errors)
    if (!e.empty()) throw std::invalid_argument(e);
}

}  // namespace detail

std::vector<LayerResult> simulate_trace(const std::string& policy, const planner::PlanInput& base,
                                        const CellLoads& loads, int64_t steps, int64_t layers,
                                        const SimConfig& cfg, int32_t threads) {
  const size_t cell = static_cast<size_t>(base.num_ranks) * base.num_experts;
  if (steps < 1 || layers < 1) throw std::invalid_argument("steps and layers must be >= 1");
  if (threads < 1) throw std::invalid_argument("threads must be >= 1");
  const auto pol = planner::make_policy(policy);
  const bool symi = pol->kind() == planner::PolicyKind::kSymi;
  const detail::Chaining chain = detail::chaining(cfg, symi);
  const bool hysteresis = chain.hysteresis, chained = chain.chained;
  const int64_t N = steps * layers;
  std::vector<LayerResult> out(static_cast<size_t>(N));
  // work units (a cell, or a whole layer when chained) are taken one at a time from a
  // shared counter: their planning cost varies (replicas, infeasible plans), and a fixed
  // interleaving left a thread idle at the end of every chunk (tests/cpp/bench_sim.cpp
  // ran at 179 % of 2 cores)
  const int64_t units = chained ? layers : N;
  std::atomic<int64_t> next{0};
  auto work = [&](int32_t) {
    planner::PlanInput in = base;
    detail::clear_previous(&in);
    if (hysteresis) in.replan_threshold = cfg.replan_threshold;
    std::optional<GemmTable> gemm;  // built once per thread (time_plan)
    std::vector<int32_t> prev_off, prev_rank;  // the layer's previous-step placement
    // one cell: plan (against the previous placement when chained), time, hand on
    auto run_cell = [&](int64_t j) {
      const int64_t* now = loads(j);
      if (!now) throw std::invalid_argument("simulate_trace: no loads for cell " + std::to_string(j));
      in.load_WE.assign(now, now + cell);
      in.previous_load_E.clear();
      // the same layer one step earlier (for the first step: the caller's, if any)
      const int64_t* prev = symi ? loads(j - layers) : nullptr;
      if (prev) {
        in.previous_load_E.assign(static_cast<size_t>(base.num_experts), 0);
        for (size_t k = 0; k < cell; ++k) in.previous_load_E[k % base.num_experts] += prev[k];
      }
      if (!chained) {
        out[static_cast<size_t>(j)] = detail::time_plan(pol->plan(in), in, cfg, &gemm);
        return;
      }
      // make_plan applies hysteresis.h when in has a previous placement (not on the first step)
      const planner::Plan p = hysteresis ? planner::make_plan(policy, in) : pol->plan(in);
      out[static_cast<size_t>(j)] = detail::time_plan(p, in, cfg, &gemm, &prev_off, &prev_rank);
      prev_off = p.instance_offsets;
      prev_rank = p.instance_rank;
      if (hysteresis) detail::hand_on(p, &in);  // the next step's previous placement
    };
    for (int64_t u = next++; u < units; u = next++) {
      if (!chained) {
        run_cell(u);
        continue;
      }
      prev_off.clear();  // a layer's first step: no previous placement
      prev_rank.clear();
      detail::clear_previous(&in);
      for (int64_t s = 0; s < steps; ++s) run_cell(s * layers + u);
    }
  };
  detail::on_threads(threads, work);
  return out;
}

}  // namespace sim
}  // namespace lrmoe
