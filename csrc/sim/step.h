// The terms of one training step outside the MoE layers' forward and backward (issue 30):
// the data-parallel all-reduce of the gradients, the optimizer step and SYMI's per-step
// weight broadcast. Each is a closed formula (below, with its source); cluster.h's layer
// times plus these give the simulated step. docs/simulation.md, "Step terms".
//
// Units: bytes plain, GB/s 1e9 bytes per second, latencies us, times ms.
#pragma once

#include <cstdint>

#include "planner/plan.h"
#include "sim/sim.h"

namespace lrmoe {
namespace sim {

// Ring all-reduce of `bytes` over n ranks at `GBps` per rank with `latency_us` per
// step: 2 (n - 1) steps, each moving bytes / n per rank, so
//   t = 2 (n - 1) / n x bytes / GBps + 2 (n - 1) x latency
// (Patarasuk and Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
// workstations", JPDC 2009; NCCL's bus bandwidth busbw = algbw x 2 (n - 1) / n is the
// same factor). 0 for n = 1 or bytes = 0. Throws std::invalid_argument for n < 1,
// bytes < 0, latency_us < 0, or GBps <= 0 where bytes move.
double ring_allreduce_ms(double bytes, int32_t n, double GBps, double latency_us);

// One Adam step of `params` parameters, bandwidth-bound (elementwise: Kingma and Ba,
// ICLR 2015, Algorithm 1, a few FLOPs per element against tens of bytes): every
// parameter reads its fp32 gradient, master weight and two moments (16 B), writes the
// master and moments back (12 B) and writes the bf16 weight (2 B): 30 B, so
//   t = params x bytes_per_param / HBM GB/s.
// Throws std::invalid_argument for params < 0, bytes_per_param <= 0 or hbm_GBps <= 0.
constexpr double kAdamBytesPerParam = 30.0;
double adam_step_ms(double params, double hbm_GBps, double bytes_per_param = kAdamBytesPerParam);

// SYMI's per-step weight broadcast: after the optimizer step every placed copy beyond an
// expert's first gets the expert's new weights (in.memory.expert_weight_bytes) from the
// rank holding the first copy; the copies move together as one all-to-all of
// weight-byte rows (all_to_all_ms: hierarchical, per-peer latency, chunks, no dedup).
// 0 when the plan has no replicas. Throws std::invalid_argument when the plan's sizes do
// not match (instance_offsets not E + 1).
double symi_broadcast_ms(const planner::Plan& plan, const planner::PlanInput& in,
                         const LinkModel& link);

// The step's non-MoE-layer terms (ms) of one EP group of W ranks in a cluster of
// dp_size such groups: the expert gradients of a rank (its owned experts'
// expert_grad_bytes) ring-all-reduced over the dp_size groups at the network's GB/s and
// latency (the copies of an expert sit in different groups, on different nodes), the
// dense gradients (dense_grad_bytes per rank) over all W x dp_size GPUs (over NVLink when
// they fit in one node of link.gpus_per_node, else at the network's link), the Adam step
// of the rank's owned expert and dense parameters, and SYMI's broadcast (0 for the other
// policies). The terms run one after the other, none hidden behind the backward (an
// upper bound where a runtime overlaps the all-reduce with the backward).
struct StepTerms {
  double expert_allreduce_ms = 0, dense_allreduce_ms = 0, optimizer_ms = 0, broadcast_ms = 0;
  double total_ms() const { return expert_allreduce_ms + dense_allreduce_ms + optimizer_ms + broadcast_ms; }
};
struct StepModel {
  int32_t dp_size = 1;            // EP groups (data-parallel copies)
  double dense_grad_bytes = 0;    // per rank, already its share of the dense gradients
  double dense_params = 0;        // per rank (for the optimizer)
  double expert_params = 0;       // one expert's parameters (for the optimizer)
  double hbm_GBps = 0;            // the device's memory bandwidth
  // MoE layers of the model a step has (cluster.h cluster_steps): the simulated layers
  // are a sample of them and their sums are scaled up to this many (0: as simulated)
  int64_t moe_layers = 0;
};

// The step terms from their inputs: `owned_experts`, the experts the busiest rank owns
// over all the step's MoE layers (one layer: its plan's most per rank), and
// `broadcast_ms`, SYMI's weight broadcast of the step (0 for the other policies), with
// `num_ranks` W of one group, `expert_grad_bytes` per expert (in.memory) and `link`,
// `m` as above. step_terms(plan, ...) and cluster.h's cluster_steps are this.
// Throws std::invalid_argument for num_ranks < 1, owned_experts < 0, broadcast_ms < 0
// (NaN included) and as step_terms below.
StepTerms step_terms(int32_t num_ranks, double owned_experts, double broadcast_ms,
                     double expert_grad_bytes, const LinkModel& link, const StepModel& m);

// One layer's plan: the most experts a rank owns (first copies; for symi, whose
// optimizer state is sharded over the W ranks, ceil(E / W)) and, for a symi plan,
// symi_broadcast_ms. Throws std::invalid_argument for dp_size < 1 or negative sizes
// (naming the StepModel field), hbm_GBps <= 0 where parameters are given.
StepTerms step_terms(const planner::Plan& plan, const planner::PlanInput& in,
                     const LinkModel& link, const StepModel& m);

}  // namespace sim
}  // namespace lrmoe
