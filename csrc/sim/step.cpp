// Step terms outside the MoE layers (step.h; docs/simulation.md, "Step terms").
#include "sim/step.h"

#include <algorithm>
#include <stdexcept>
#include <vector>

namespace lrmoe {
namespace sim {

double ring_allreduce_ms(double bytes, int32_t n, double GBps, double latency_us) {
  if (n < 1) throw std::invalid_argument("ring_allreduce_ms: n (ranks) must be >= 1");
  if (bytes < 0) throw std::invalid_argument("ring_allreduce_ms: bytes must be >= 0");
  if (latency_us < 0) throw std::invalid_argument("ring_allreduce_ms: latency_us must be >= 0");
  if (n == 1 || bytes == 0) return 0.0;
  if (!(GBps > 0)) throw std::invalid_argument("ring_allreduce_ms: GBps must be > 0");
  const double steps = 2.0 * (n - 1);
  return steps / n * bytes / (GBps * 1e6) + steps * latency_us * 1e-3;
}

double adam_step_ms(double params, double hbm_GBps, double bytes_per_param) {
  if (params < 0) throw std::invalid_argument("adam_step_ms: params must be >= 0");
  if (!(bytes_per_param > 0)) throw std::invalid_argument("adam_step_ms: bytes_per_param must be > 0");
  if (!(hbm_GBps > 0)) throw std::invalid_argument("adam_step_ms: hbm_GBps must be > 0");
  return params * bytes_per_param / (hbm_GBps * 1e6);
}

double symi_broadcast_ms(const planner::Plan& plan, const planner::PlanInput& in,
                         const LinkModel& link) {
  const int32_t W = plan.num_ranks, E = plan.num_experts;
  if (plan.instance_offsets.size() != static_cast<size_t>(E) + 1)
    throw std::invalid_argument("symi_broadcast_ms: plan.instance_offsets must hold E + 1 entries");
  if (plan.replicas == 0) return 0.0;
  const size_t Wz = static_cast<size_t>(W);
  std::vector<int64_t> M(Wz * Wz, 0);
  for (int32_t e = 0; e < E; ++e) {
    const int32_t first = plan.instance_rank[static_cast<size_t>(plan.instance_offsets[e])];
    for (int32_t i = plan.instance_offsets[e] + 1; i < plan.instance_offsets[e + 1]; ++i)
      M[static_cast<size_t>(first) * Wz + static_cast<size_t>(plan.instance_rank[static_cast<size_t>(i)])] +=
          in.memory.expert_weight_bytes;
  }
  return all_to_all_ms(M, W, 1.0, link);
}

StepTerms step_terms(int32_t num_ranks, double owned_experts, double broadcast_ms,
                     double expert_grad_bytes, const LinkModel& link, const StepModel& m) {
  if (m.dp_size < 1) throw std::invalid_argument("step_terms: StepModel.dp_size must be >= 1");
  if (m.dense_grad_bytes < 0 || m.dense_params < 0 || m.expert_params < 0)
    throw std::invalid_argument("step_terms: StepModel.dense_grad_bytes, dense_params and "
                                "expert_params must be >= 0");
  if (num_ranks < 1) throw std::invalid_argument("step_terms: num_ranks must be >= 1");
  if (!(owned_experts >= 0)) throw std::invalid_argument("step_terms: owned_experts must be >= 0");
  if (!(broadcast_ms >= 0)) throw std::invalid_argument("step_terms: broadcast_ms must be >= 0");
  if (expert_grad_bytes < 0) throw std::invalid_argument("step_terms: expert_grad_bytes must be >= 0");
  StepTerms t;
  const int32_t all = num_ranks * m.dp_size;
  t.expert_allreduce_ms = ring_allreduce_ms(owned_experts * expert_grad_bytes, m.dp_size,
                                            link.inter_GBps, link.inter_latency_us);
  // a ring inside one node runs over NVLink; one that leaves it is as slow as its
  // network hops
  const bool one_node = all <= link.gpus_per_node;
  t.dense_allreduce_ms =
      ring_allreduce_ms(m.dense_grad_bytes, all, one_node ? link.intra_GBps : link.inter_GBps,
                        one_node ? link.intra_latency_us : link.inter_latency_us);
  if (m.hbm_GBps > 0)
    t.optimizer_ms = adam_step_ms(owned_experts * m.expert_params + m.dense_params, m.hbm_GBps);
  else if (m.dense_params > 0 || m.expert_params > 0)
    throw std::invalid_argument("step_terms: StepModel.hbm_GBps must be > 0 to time the optimizer");
  t.broadcast_ms = broadcast_ms;
  return t;
}

StepTerms step_terms(const planner::Plan& plan, const planner::PlanInput& in,
                     const LinkModel& link, const StepModel& m) {
  const int32_t W = plan.num_ranks, E = plan.num_experts;
  if (plan.instance_offsets.size() != static_cast<size_t>(E) + 1)
    throw std::invalid_argument("step_terms: plan.instance_offsets must hold E + 1 entries");
  // experts owned per rank (the first copy; replicas' gradients were reduced into the
  // owner within the layer): the most any rank holds decides
  std::vector<int32_t> owned(static_cast<size_t>(W), 0);
  for (int32_t e = 0; e < E; ++e)
    ++owned[static_cast<size_t>(plan.instance_rank[static_cast<size_t>(plan.instance_offsets[e])])];
  int32_t most = 0;
  for (int32_t k : owned) most = std::max(most, k);
  // symi's optimizer state is sharded over the ranks (sim.cpp time_plan says why)
  if (plan.policy == planner::PolicyKind::kSymi) most = (E + W - 1) / W;
  const double bcast =
      plan.policy == planner::PolicyKind::kSymi ? symi_broadcast_ms(plan, in, link) : 0.0;
  return step_terms(W, most, bcast, static_cast<double>(in.memory.expert_grad_bytes), link, m);
}

}  // namespace sim
}  // namespace lrmoe
