// GoogleTests of hysteresis inside simulate_trace and of the price of a move
// (csrc/sim/sim.h SimConfig::replan_threshold, resident_replicas,
// derived_replica_cost_rows), against hand-computed values on a 2-GPU toy cluster:
// 2 experts (e owned by rank e), one replica slot per rank, link 1 GB/s and 10 us, so
// one expert's 100 weight bytes take 10 us + 100 B / 1 GB/s = 0.0101 ms to move.
// (The per-cell reference loop over the planner is tests/python/sim/test_sim_hysteresis.py.)
#include <gtest/gtest.h>

#include <cstdint>
#include <stdexcept>
#include <vector>

#include "planner/plan.h"
#include "sim/sim.h"

namespace {

using namespace lrmoe;

sim::SimConfig toy_config() {
  sim::SimConfig cfg;
  cfg.cost.gemm = {sim::GemmPoint{1, 10, 1.0, 2.0}};
  cfg.cost.per_row.router = 0.01;
  cfg.link.gpus_per_node = 8;
  cfg.link.intra_GBps = 1.0;
  cfg.link.intra_latency_us = 10.0;
  cfg.hidden = 500;
  return cfg;
}

planner::PlanInput toy_input() {
  planner::PlanInput in;
  in.num_ranks = 2;
  in.num_experts = 2;
  in.load_WE = {90, 0, 90, 0};
  in.memory.expert_weight_bytes = 100;
  in.memory.expert_grad_bytes = 200;
  in.memory.forward_row_bytes = 1;
  in.memory.backward_row_bytes = 1;
  in.memory.budget_bytes = int64_t(1) << 40;
  in.replica_slots = 1;
  return in;
}

constexpr double kMoveMs = 0.01 + 100.0 / 1e6;  // latency + 100 B at 1 GB/s, ms

// hot expert 0 (all 180 rows), then hot expert 1, then expert 0 again: ultraep places
// one replica of the hot expert on the other rank each step
std::vector<int64_t> alternating() { return {90, 0, 90, 0, 0, 90, 0, 90, 90, 0, 90, 0}; }

TEST(SimMoves, ResidentReplicaPaysItsFetchOnlyWhenPlacedAnew) {
  sim::SimConfig cfg = toy_config();
  cfg.resident_replicas = true;
  cfg.replan_threshold = 0.5;
  const planner::PlanInput in = toy_input();
  const std::vector<int64_t> two = {90, 0, 90, 0, 90, 0, 90, 0};  // one step repeated
  const auto r = sim::simulate_trace("ultraep", in, two, 2, 1, cfg, 1);
  ASSERT_EQ(r[0].replicas, 1);
  // step 0: no previous placement, the replica is new: its 100 weight bytes fetched
  EXPECT_EQ(r[0].moved_replicas, 1);
  EXPECT_FALSE(r[0].kept_previous);
  EXPECT_NEAR(r[0].move_ms, kMoveMs, 1e-12);
  EXPECT_DOUBLE_EQ(r[0].move_bytes, 100.0);
  // step 1: the same loads, the placement kept, nothing fetched
  EXPECT_TRUE(r[1].kept_previous);
  EXPECT_EQ(r[1].moved_replicas, 0);
  EXPECT_EQ(r[1].move_ms, 0.0);
  EXPECT_NEAR(r[0].fwd_ms - r[1].fwd_ms, kMoveMs, 1e-12);
  EXPECT_DOUBLE_EQ(r[1].bwd_ms, r[0].bwd_ms);
  // no per-layer stream: only the gradient (200 B) back to the owner, plus the fetch
  EXPECT_DOUBLE_EQ(r[1].replica_bytes, 200.0);
  EXPECT_DOUBLE_EQ(r[0].replica_bytes, 300.0);
  // every replica refreshed after the optimizer step, as symi's copies
  EXPECT_NEAR(r[1].broadcast_ms, kMoveMs, 1e-12);
}

TEST(SimMoves, StreamedReplicasCostTheSameMovedOrKept) {
  sim::SimConfig cfg = toy_config();
  cfg.replan_threshold = 0.5;
  const std::vector<int64_t> two = {90, 0, 90, 0, 90, 0, 90, 0};
  const auto r = sim::simulate_trace("ultraep", toy_input(), two, 2, 1, cfg, 1);
  EXPECT_EQ(r[0].moved_replicas, 1);  // counted, not charged
  EXPECT_EQ(r[0].move_ms, 0.0);
  EXPECT_DOUBLE_EQ(r[0].fwd_ms, r[1].fwd_ms);
  EXPECT_DOUBLE_EQ(r[1].replica_bytes, 400.0);  // 2 x 100 weights + 200 gradient per layer
  EXPECT_EQ(r[1].broadcast_ms, 0.0);
}

// the fresh plan of a hot expert 1 halves the kept plan's max rank time (rows 90 + 90
// per rank against 180 + 180 on rank 1): replanned below a threshold of 0.5, kept above
TEST(SimMoves, HysteresisKeepsOrMovesAsTheThresholdSays) {
  sim::SimConfig cfg = toy_config();
  cfg.resident_replicas = true;
  for (double t : {0.3, 0.9}) {
    cfg.replan_threshold = t;
    const auto r = sim::simulate_trace("ultraep", toy_input(), alternating(), 3, 1, cfg, 2);
    for (int s = 1; s < 3; ++s) {
      EXPECT_EQ(r[s].kept_previous, t > 0.5) << "threshold " << t << " step " << s;
      EXPECT_EQ(r[s].moved_replicas, t > 0.5 ? 0 : 1) << "threshold " << t << " step " << s;
      EXPECT_NEAR(r[s].move_ms, t > 0.5 ? 0.0 : kMoveMs, 1e-12);
    }
  }
  // off: every step planned afresh, moves still counted and charged
  cfg.replan_threshold = -1.0;
  const auto off = sim::simulate_trace("ultraep", toy_input(), alternating(), 3, 1, cfg, 2);
  for (int s = 0; s < 3; ++s) {
    EXPECT_FALSE(off[s].kept_previous);
    EXPECT_EQ(off[s].moved_replicas, 1);
  }
}

TEST(SimMoves, LayersWalkTheirOwnSteps) {
  // two layers: layer 0 alternates, layer 1 stays hot on expert 0; at threshold 0.3
  // layer 0 moves every step, layer 1 never after its first
  sim::SimConfig cfg = toy_config();
  cfg.resident_replicas = true;
  cfg.replan_threshold = 0.3;
  const std::vector<int64_t> a = alternating();
  std::vector<int64_t> loads;
  for (int s = 0; s < 3; ++s) {
    loads.insert(loads.end(), a.begin() + 4 * s, a.begin() + 4 * s + 4);
    loads.insert(loads.end(), {90, 0, 90, 0});
  }
  const auto r = sim::simulate_trace("ultraep", toy_input(), loads, 3, 2, cfg, 2);
  for (int s = 1; s < 3; ++s) {
    EXPECT_EQ(r[2 * s].moved_replicas, 1);
    EXPECT_EQ(r[2 * s + 1].moved_replicas, 0);
    EXPECT_TRUE(r[2 * s + 1].kept_previous);
  }
}

TEST(SimMoves, RefusesSymiAndThresholdsOutOfRange) {
  sim::SimConfig cfg = toy_config();
  cfg.replan_threshold = 0.1;
  const std::vector<int64_t> one = {90, 0, 90, 0};
  EXPECT_THROW(sim::simulate_trace("symi", toy_input(), one, 1, 1, cfg, 1), std::invalid_argument);
  cfg.replan_threshold = 1.0;
  EXPECT_THROW(sim::simulate_trace("ultraep", toy_input(), one, 1, 1, cfg, 1),
               std::invalid_argument);
  EXPECT_THROW(sim::simulate_pressure_trace("ultraep", toy_input(), one, 1, 1, 1.0, 2, cfg, 1),
               std::invalid_argument);
}

// t_w = 9e6 B / 100 GB/s + 15 us = 0.09 + 0.015 ms; t_row at k = 1, r = 100 on the
// curve (100 rows: 1 / 2 ms, 200 rows: 2 / 4 ms) = (1 + 2) / (2 x 100) = 0.015 ms;
// kappa = 0.105 / 0.015 = 7. At k = 2 the grid scales the 1-expert curve by 2: the same.
TEST(SimMoves, DerivedReplicaCostRows) {
  sim::SimConfig cfg;
  cfg.cost.gemm = {sim::GemmPoint{1, 100, 1.0, 2.0}, sim::GemmPoint{1, 200, 2.0, 4.0}};
  cfg.link.intra_GBps = 100.0;
  cfg.link.intra_latency_us = 15.0;
  EXPECT_EQ(sim::derived_replica_cost_rows(cfg, 9000000, 1.0, 100.0), 7);
  EXPECT_EQ(sim::derived_replica_cost_rows(cfg, 9000000, 2.0, 100.0), 7);
  EXPECT_EQ(sim::derived_replica_cost_rows(cfg, 0, 1.0, 100.0), 0);
  EXPECT_THROW(sim::derived_replica_cost_rows(cfg, -1, 1.0, 100.0), std::invalid_argument);
  EXPECT_THROW(sim::derived_replica_cost_rows(cfg, 100, 0.0, 100.0), std::invalid_argument);
}

}  // namespace
