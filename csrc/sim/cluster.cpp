// A whole cluster of expert-parallel groups (cluster.h).
#include "sim/cluster.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

namespace lrmoe {
namespace sim {
namespace {
std::vector<ClusterLayer> reduce(const std::vector<LayerResult>& r, int64_t steps,
                                 int64_t groups, int64_t layers);
}  // namespace

std::vector<ClusterLayer> simulate_cluster(const std::string& policy,
                                           const planner::PlanInput& base,
                                           const std::vector<int64_t>& loads_SGLWE,
                                           int64_t steps, int64_t groups, int64_t layers,
                                           const SimConfig& cfg, int32_t threads,
                                           const std::vector<int64_t>* previous_GLWE) {
  if (groups < 1) throw std::invalid_argument("simulate_cluster: groups must be >= 1");
  if (steps < 1 || layers < 1)
    throw std::invalid_argument("simulate_cluster: steps and layers must be >= 1");
  // (group, layer) flattened into one layer axis of Gr x Lyr: simulate_trace's "same
  // layer one step earlier" is then the same group's same layer, as symi needs
  return reduce(simulate_trace(policy, base, loads_SGLWE, steps, groups * layers, cfg, threads,
                               previous_GLWE),
                steps, groups, layers);
}

std::vector<ClusterLayer> simulate_cluster(const std::string& policy,
                                           const planner::PlanInput& base,
                                           const CellLoads& loads, int64_t steps,
                                           int64_t groups, int64_t layers,
                                           const SimConfig& cfg, int32_t threads) {
  if (groups < 1) throw std::invalid_argument("simulate_cluster: groups must be >= 1");
  if (steps < 1 || layers < 1)
    throw std::invalid_argument("simulate_cluster: steps and layers must be >= 1");
  return reduce(simulate_trace(policy, base, loads, steps, groups * layers, cfg, threads), steps,
                groups, layers);
}

namespace {

// Per (step, layer): the slowest group's time, which group, the mean over groups.
std::vector<ClusterLayer> reduce(const std::vector<LayerResult>& r, int64_t steps,
                                 int64_t groups, int64_t layers) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  std::vector<ClusterLayer> out(static_cast<size_t>(steps * layers));
  for (int64_t s = 0; s < steps; ++s)
    for (int64_t l = 0; l < layers; ++l) {
      ClusterLayer& c = out[static_cast<size_t>(s * layers + l)];
      double sum = 0;
      int64_t ok = 0;
      for (int64_t g = 0; g < groups; ++g) {
        const LayerResult& x = r[static_cast<size_t>((s * groups + g) * layers + l)];
        if (!x.feasible) {
          c.feasible = false;
          continue;
        }
        const double t = x.fwd_ms + x.bwd_ms;
        sum += t;
        ++ok;
        c.owned_experts_max = std::max(c.owned_experts_max, x.owned_experts_max);
        c.broadcast_ms = std::max(c.broadcast_ms, x.broadcast_ms);
        if (c.slowest_group < 0 || t > c.time_ms) {
          c.time_ms = t;
          c.slowest_group = static_cast<int32_t>(g);
        }
      }
      c.mean_group_ms = ok ? sum / static_cast<double>(ok) : nan;
      if (!c.feasible) c.time_ms = c.broadcast_ms = nan;
    }
  return out;
}

}  // namespace

std::vector<ClusterStep> cluster_steps(const std::vector<ClusterLayer>& layers_SL, int64_t steps,
                                       int64_t layers, int32_t num_ranks,
                                       double expert_grad_bytes, const LinkModel& link,
                                       const StepModel& m) {
  if (steps < 1 || layers < 1)
    throw std::invalid_argument("cluster_steps: steps and layers must be >= 1");
  if (layers_SL.size() != static_cast<size_t>(steps * layers))
    throw std::invalid_argument("cluster_steps: layers_SL must hold steps x layers = " +
                                std::to_string(steps * layers) + " results, got " +
                                std::to_string(layers_SL.size()));
  if (m.moe_layers < 0)
    throw std::invalid_argument("cluster_steps: StepModel.moe_layers must be >= 0 (0: the "
                                "simulated layers)");
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double per = m.moe_layers > 0 ? static_cast<double>(m.moe_layers) / layers : 1.0;
  std::vector<ClusterStep> out(static_cast<size_t>(steps));
  for (int64_t s = 0; s < steps; ++s) {
    ClusterStep& st = out[static_cast<size_t>(s)];
    double owned = 0, bcast = 0;
    for (int64_t l = 0; l < layers; ++l) {
      const ClusterLayer& c = layers_SL[static_cast<size_t>(s * layers + l)];
      if (!c.feasible) { st.feasible = false; break; }
      st.moe_ms += c.time_ms;
      st.mean_group_moe_ms += c.mean_group_ms;
      owned += c.owned_experts_max;
      bcast += c.broadcast_ms;
    }
    if (!st.feasible) {
      st.moe_ms = st.mean_group_moe_ms = nan;
      st.terms.expert_allreduce_ms = st.terms.dense_allreduce_ms = nan;
      st.terms.optimizer_ms = st.terms.broadcast_ms = nan;
      continue;
    }
    st.moe_ms *= per;
    st.mean_group_moe_ms *= per;
    st.terms = step_terms(num_ranks, owned * per, bcast * per, expert_grad_bytes, link, m);
  }
  return out;
}

}  // namespace sim
}  // namespace lrmoe
