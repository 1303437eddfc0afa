// GoogleTests for csrc/sim/step.h: the step terms outside the MoE layers, every
// expected number worked out by hand in the comments from the formulas' sources
// (ring all-reduce: 2 (n - 1) / n x bytes / GBps + 2 (n - 1) x latency; Adam: 30 B per
// parameter over HBM), never from the code under test.
#include <gtest/gtest.h>

#include <stdexcept>

#include "planner/plan.h"
#include "sim/step.h"

namespace {

using namespace lrmoe;

TEST(Step, RingAllReduceByHand) {
  // 1 GB over 8 ranks at 50 GB/s, 20 us: 2 x 7 / 8 x 1e9 B / 5e7 B/ms = 35 ms, plus
  // 14 steps x 0.02 ms = 0.28
  EXPECT_NEAR(sim::ring_allreduce_ms(1e9, 8, 50, 20), 35.28, 1e-12);
  // two ranks: one step each way, the whole buffer: 1e9 / 5e7 = 20 ms + 2 x 0.02
  EXPECT_NEAR(sim::ring_allreduce_ms(1e9, 2, 50, 20), 20.04, 1e-12);
  EXPECT_EQ(sim::ring_allreduce_ms(1e9, 1, 50, 20), 0.0);
  EXPECT_EQ(sim::ring_allreduce_ms(0, 8, 0, 20), 0.0);
  EXPECT_THROW(sim::ring_allreduce_ms(1, 0, 50, 20), std::invalid_argument);
  EXPECT_THROW(sim::ring_allreduce_ms(1, 2, 0, 20), std::invalid_argument);
  EXPECT_THROW(sim::ring_allreduce_ms(-1, 2, 50, 20), std::invalid_argument);
}

TEST(Step, AdamIsBandwidthBound) {
  // 1e9 parameters x 30 B at 4,800 GB/s (4.8e9 B/ms): 6.25 ms
  EXPECT_NEAR(sim::adam_step_ms(1e9, 4800), 6.25, 1e-12);
  EXPECT_NEAR(sim::adam_step_ms(1e9, 4800, 16), 1e9 * 16 / 4.8e9, 1e-12);
  EXPECT_THROW(sim::adam_step_ms(1, 0), std::invalid_argument);
  EXPECT_THROW(sim::adam_step_ms(-1, 4800), std::invalid_argument);
}

// A hand-made symi plan: W 2 (one node), E 2; expert 0 on ranks 0 and 1 (a copy on
// rank 1), expert 1 on rank 1.
planner::Plan two_rank_plan() {
  planner::Plan p;
  p.policy = planner::PolicyKind::kSymi;
  p.num_ranks = 2;
  p.num_experts = 2;
  p.instance_offsets = {0, 2, 3};
  p.instance_rank = {0, 1, 1};
  p.replicas = 1;
  return p;
}

TEST(Step, TermsOfATwoRankGroupByHand) {
  planner::PlanInput in;
  in.num_ranks = 2;
  in.num_experts = 2;
  in.memory.expert_weight_bytes = 100;
  in.memory.expert_grad_bytes = 200;
  sim::LinkModel link;
  link.gpus_per_node = 8;
  link.intra_GBps = 1.0;
  link.intra_latency_us = 10.0;
  link.inter_GBps = 1.0;
  link.inter_latency_us = 5.0;
  const planner::Plan p = two_rank_plan();
  // broadcast: 100 B from rank 0 to rank 1 over NVLink: 100 / 1e6 + 0.01 ms
  EXPECT_NEAR(sim::symi_broadcast_ms(p, in, link), 0.0101, 1e-15);
  sim::StepModel m;
  m.dp_size = 4;
  m.dense_grad_bytes = 1000;
  m.dense_params = 150;
  m.expert_params = 50;
  m.hbm_GBps = 1.0;
  const sim::StepTerms t = sim::step_terms(p, in, link, m);
  // expert gradients: each rank owns one expert, 200 B over 4 groups: 2 x 3 / 4 x 200 /
  // 1e6 + 6 x 0.005 = 0.0003 + 0.03
  EXPECT_NEAR(t.expert_allreduce_ms, 0.0303, 1e-15);
  // dense: 1000 B over 2 x 4 GPUs: 2 x 7 / 8 x 1000 / 1e6 + 14 x 0.005
  EXPECT_NEAR(t.dense_allreduce_ms, 0.00175 + 0.07, 1e-15);
  // Adam: (50 + 150) x 30 B at 1e6 B/ms
  EXPECT_NEAR(t.optimizer_ms, 0.006, 1e-15);
  EXPECT_NEAR(t.broadcast_ms, 0.0101, 1e-15);
  EXPECT_NEAR(t.total_ms(), 0.0303 + 0.07175 + 0.006 + 0.0101, 1e-15);
  // no broadcast outside symi (its copies stream per layer, sim.h)
  planner::Plan u = p;
  u.policy = planner::PolicyKind::kUltraEP;
  EXPECT_EQ(sim::step_terms(u, in, link, m).broadcast_ms, 0.0);
  m.dp_size = 0;
  EXPECT_THROW(sim::step_terms(p, in, link, m), std::invalid_argument);
}

}  // namespace
