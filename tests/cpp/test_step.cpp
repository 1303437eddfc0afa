// GoogleTests for csrc/sim/step.h: the step terms outside the MoE layers, every
// expected number worked out by hand in the comments from the formulas' sources
// (ring all-reduce: 2 (n - 1) / n x bytes / GBps + 2 (n - 1) x latency; Adam: 30 B per
// parameter over HBM), never from the code under test.
#include <gtest/gtest.h>

#include <cmath>
#include <stdexcept>
#include <vector>

#include "planner/plan.h"
#include "sim/cluster.h"
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
  // dense: 1000 B over the 2 x 4 GPUs of one node of 8, over NVLink:
  // 2 x 7 / 8 x 1000 / 1e6 + 14 x 0.01
  EXPECT_NEAR(t.dense_allreduce_ms, 0.00175 + 0.14, 1e-15);
  // Adam: (50 + 150) x 30 B at 1e6 B/ms
  EXPECT_NEAR(t.optimizer_ms, 0.006, 1e-15);
  EXPECT_NEAR(t.broadcast_ms, 0.0101, 1e-15);
  EXPECT_NEAR(t.total_ms(), 0.0303 + 0.14175 + 0.006 + 0.0101, 1e-15);
  // nodes of 4: the 8 GPUs span two, the ring runs at the network's latency:
  // 0.00175 + 14 x 0.005 (the broadcast's 2 ranks stay on one node)
  sim::LinkModel four = link;
  four.gpus_per_node = 4;
  EXPECT_NEAR(sim::step_terms(p, in, four, m).dense_allreduce_ms, 0.00175 + 0.07, 1e-15);
  // no broadcast outside symi (its copies stream per layer, sim.h)
  planner::Plan u = p;
  u.policy = planner::PolicyKind::kUltraEP;
  EXPECT_EQ(sim::step_terms(u, in, link, m).broadcast_ms, 0.0);
  m.dp_size = 0;
  EXPECT_THROW(sim::step_terms(p, in, link, m), std::invalid_argument);
}

// Links of the cluster tests: nodes of 8, NVLink 2 GB/s and 10 us, network 1 GB/s and
// 5 us (1 GB/s = 1e6 B/ms).
sim::LinkModel two_class_link() {
  sim::LinkModel link;
  link.gpus_per_node = 8;
  link.intra_GBps = 2.0;
  link.intra_latency_us = 10.0;
  link.inter_GBps = 1.0;
  link.inter_latency_us = 5.0;
  return link;
}

TEST(Step, TermsOfAStepFromItsInputsByHand) {
  // W 16 ranks x 2 groups = 32 GPUs over 4 nodes; the busiest rank owns 3 experts over
  // the step's layers, 1000 gradient bytes each; dense 4000 B per rank, 100 dense and 10
  // parameters per expert at 2 GB/s of HBM; a broadcast of 0.5 ms
  sim::StepModel m;
  m.dp_size = 2;
  m.dense_grad_bytes = 4000;
  m.dense_params = 100;
  m.expert_params = 10;
  m.hbm_GBps = 2.0;
  const sim::StepTerms t = sim::step_terms(16, 3, 0.5, 1000, two_class_link(), m);
  // experts: 3000 B over 2 groups: 2 x 1 / 2 x 3000 / 1e6 + 2 x 0.005 = 0.003 + 0.01
  EXPECT_NEAR(t.expert_allreduce_ms, 0.013, 1e-15);
  // dense over 32 GPUs (beyond a node): 2 x 31 / 32 x 4000 / 1e6 + 62 x 0.005
  EXPECT_NEAR(t.dense_allreduce_ms, 0.00775 + 0.31, 1e-15);
  // Adam: (3 x 10 + 100) x 30 B at 2e6 B/ms = 0.00195
  EXPECT_NEAR(t.optimizer_ms, 0.00195, 1e-15);
  EXPECT_EQ(t.broadcast_ms, 0.5);
  // one group: no expert all-reduce (nothing to reduce with), dense over 16 GPUs
  m.dp_size = 1;
  EXPECT_EQ(sim::step_terms(16, 3, 0, 1000, two_class_link(), m).expert_allreduce_ms, 0.0);
  EXPECT_THROW(sim::step_terms(0, 3, 0, 1000, two_class_link(), m), std::invalid_argument);
  EXPECT_THROW(sim::step_terms(16, -1, 0, 1000, two_class_link(), m), std::invalid_argument);
  EXPECT_THROW(sim::step_terms(16, 3, std::nan(""), 1000, two_class_link(), m),
               std::invalid_argument);
}

TEST(Step, ClusterStepsSumTheLayersAndAddTheTermsByHand) {
  // 2 steps x 2 layers of a cluster of 2 groups of W = 4 (8 GPUs, one node); step 1's
  // second layer does not fit
  std::vector<sim::ClusterLayer> r(4);
  r[0].time_ms = 10; r[0].mean_group_ms = 9; r[0].owned_experts_max = 2; r[0].broadcast_ms = 0.25;
  r[1].time_ms = 20; r[1].mean_group_ms = 15; r[1].owned_experts_max = 3; r[1].broadcast_ms = 0.5;
  r[2].time_ms = 5; r[2].mean_group_ms = 5; r[2].owned_experts_max = 2;
  r[3].feasible = false;
  r[3].time_ms = std::nan("");
  sim::StepModel m;
  m.dp_size = 2;
  m.dense_grad_bytes = 1000;
  m.dense_params = 100;
  m.expert_params = 10;
  m.hbm_GBps = 2.0;
  const auto out = sim::cluster_steps(r, 2, 2, 4, 100, two_class_link(), m);
  ASSERT_EQ(out.size(), 2u);
  EXPECT_TRUE(out[0].feasible);
  EXPECT_EQ(out[0].moe_ms, 30.0);
  EXPECT_EQ(out[0].mean_group_moe_ms, 24.0);
  // 2 + 3 = 5 owned experts x 100 B over 2 groups: 500 / 1e6 + 2 x 0.005
  EXPECT_NEAR(out[0].terms.expert_allreduce_ms, 0.0105, 1e-15);
  // dense over the 8 GPUs of one node (NVLink): 2 x 7 / 8 x 1000 / 2e6 + 14 x 0.01
  EXPECT_NEAR(out[0].terms.dense_allreduce_ms, 0.000875 + 0.14, 1e-15);
  // Adam: (5 x 10 + 100) x 30 B / 2e6 B/ms
  EXPECT_NEAR(out[0].terms.optimizer_ms, 0.00225, 1e-15);
  EXPECT_NEAR(out[0].terms.broadcast_ms, 0.75, 1e-15);
  EXPECT_NEAR(out[0].total_ms(), 30 + 0.0105 + 0.140875 + 0.00225 + 0.75, 1e-12);
  // the 2 simulated layers standing for 6: every sum x 3 (owned 15, broadcast 2.25)
  m.moe_layers = 6;
  const auto six = sim::cluster_steps(r, 2, 2, 4, 100, two_class_link(), m);
  EXPECT_EQ(six[0].moe_ms, 90.0);
  EXPECT_EQ(six[0].mean_group_moe_ms, 72.0);
  EXPECT_NEAR(six[0].terms.expert_allreduce_ms, 1500 / 1e6 + 0.01, 1e-15);
  EXPECT_NEAR(six[0].terms.optimizer_ms, (15 * 10 + 100) * 30 / 2e6, 1e-15);
  EXPECT_NEAR(six[0].terms.broadcast_ms, 2.25, 1e-15);
  EXPECT_NEAR(six[0].terms.dense_allreduce_ms, 0.000875 + 0.14, 1e-15);  // per step
  m.moe_layers = -1;
  EXPECT_THROW(sim::cluster_steps(r, 2, 2, 4, 100, two_class_link(), m), std::invalid_argument);
  m.moe_layers = 0;
  EXPECT_FALSE(out[1].feasible);
  EXPECT_TRUE(std::isnan(out[1].moe_ms));
  EXPECT_TRUE(std::isnan(out[1].total_ms()));
  EXPECT_THROW(sim::cluster_steps(r, 3, 2, 4, 100, two_class_link(), m), std::invalid_argument);
}

}  // namespace
