// GoogleTests of the hysteresis rule (csrc/planner/hysteresis.h): keep the previous
// placement unless the new plan's max rank time T (forward + retained rows per rank) is
// lower by more than replan_threshold x the kept plan's. Hand-computed cases on W = 2,
// E = 2 (expert e owned by rank e, all its rows from source e), and a self-consistency
// check: a plan given itself as the previous placement is kept unchanged.
#include <gtest/gtest.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "planner/plan.h"

namespace {

using namespace lrmoe::planner;

PlanInput two_ranks(int64_t n0, int64_t n1) {
  PlanInput in;
  in.num_ranks = 2;
  in.num_experts = 2;
  in.load_WE = {n0, 0, 0, n1};
  in.replica_slots = 1;
  in.balance_slack = 0.0;
  in.memory.expert_weight_bytes = 7;
  in.memory.forward_row_bytes = 1;
  in.memory.backward_row_bytes = 1;
  in.memory.budget_bytes = int64_t(1) << 30;
  return in;
}

void set_previous(PlanInput* in, std::vector<int32_t> off, std::vector<int32_t> rank,
                  std::vector<int64_t> rows) {
  in->previous_instance_offsets = std::move(off);
  in->previous_instance_rank = std::move(rank);
  in->previous_instance_rows = std::move(rows);
}

int64_t T(const Plan& p) {
  int64_t t = 0;
  for (int32_t r = 0; r < p.num_ranks; ++r) t = std::max(t, p.forward_rows_W[r] + p.backward_rows_W[r]);
  return t;
}

// n = [6, 2], target 4 rows per rank: the fresh lrmoe plan moves 2 rows of expert 0 to
// a replica on rank 1, T = 4 + 4 = 8. The previous placement had no replica: kept,
// T = 6 + 6 = 12. The new plan saves 1/3: kept at threshold 0.5, replanned at 0.3 (one
// replica placed: 7 weight bytes copied).
TEST(PlannerHysteresis, KeepsUnlessTheNewPlanSavesMoreThanTheThreshold) {
  PlanInput in = two_ranks(6, 2);
  EXPECT_EQ(T(make_plan("lrmoe", in)), 8);
  set_previous(&in, {0, 1, 2}, {0, 1}, {5, 3});
  in.replan_threshold = 0.5;
  const Plan kept = make_plan("lrmoe", in);
  EXPECT_TRUE(kept.kept_previous);
  EXPECT_EQ(kept.num_instances(), 2);
  EXPECT_EQ(T(kept), 12);
  EXPECT_EQ(kept.moved_replicas, 0);
  EXPECT_EQ(kept.moved_bytes, 0);
  in.replan_threshold = 0.3;
  const Plan fresh = make_plan("lrmoe", in);
  EXPECT_FALSE(fresh.kept_previous);
  EXPECT_EQ(T(fresh), 8);
  EXPECT_EQ(fresh.moved_replicas, 1);
  EXPECT_EQ(fresh.moved_bytes, 7);
}

// The previous placement had a replica of expert 0 on rank 1 with rows [5, 3]: the
// new n_0 = 6 re-split in proportion, 3.75 / 2.25 -> [4, 2] (largest remainder), so
// rank 1 computes 2 + 2: T = 8, as good as the fresh plan: kept at threshold 0.
TEST(PlannerHysteresis, ReusesTheSlotWhenItIsAsGood) {
  PlanInput in = two_ranks(6, 2);
  set_previous(&in, {0, 2, 3}, {0, 1, 1}, {5, 3, 2});
  const Plan p = make_plan("lrmoe", in);
  EXPECT_TRUE(p.kept_previous);
  EXPECT_EQ(p.forward_rows_W, (std::vector<int64_t>{4, 4}));
  EXPECT_EQ(T(p), 8);
  EXPECT_EQ(p.moved_replicas, 0);
}

// Previous rows [7, 1] for expert 0: n_0 = 10 re-split 8.75 / 1.25 -> [9, 1], T_kept =
// 18; the fresh plan (target 6) moves 4 rows to rank 1, T = 12: replanned, but onto the
// same (expert, rank) slot, so nothing is copied.
TEST(PlannerHysteresis, ReplanOntoTheSameSlotMovesNothing) {
  PlanInput in = two_ranks(10, 2);
  set_previous(&in, {0, 2, 3}, {0, 1, 1}, {7, 1, 2});
  in.replan_threshold = 0.2;  // 12 < 0.8 x 18 = 14.4
  const Plan p = make_plan("lrmoe", in);
  EXPECT_FALSE(p.kept_previous);
  EXPECT_EQ(T(p), 12);
  EXPECT_EQ(p.moved_replicas, 0);
  EXPECT_EQ(p.moved_bytes, 0);
}

// A kept placement that does not fit is never kept: row capacity 5, n = [6, 2], no
// replica before: kept rank 0 retains 6 > 5 (infeasible); the fresh plan moves 1 row.
TEST(PlannerHysteresis, NeverKeepsAnInfeasiblePlacement) {
  PlanInput in = two_ranks(6, 2);
  in.balance_slack = -1.0;
  in.backward_row_capacity = 5;
  set_previous(&in, {0, 1, 2}, {0, 1}, {6, 2});
  in.replan_threshold = 0.9;
  const Plan p = make_plan("lrmoe", in);
  EXPECT_TRUE(p.feasible) << p.reason;
  EXPECT_FALSE(p.kept_previous);
  EXPECT_EQ(p.forward_rows_W, (std::vector<int64_t>{5, 3}));
  EXPECT_EQ(p.moved_replicas, 1);
}

// A plan given itself as the previous placement is kept, field for field (its rows
// re-split in proportion to themselves are themselves).
TEST(PlannerHysteresis, APlanIsItsOwnKeptPlan) {
  uint32_t seed = 1;
  auto next = [&] { seed = seed * 1103515245u + 12345u; return (seed >> 8) % 1000u; };
  for (int k = 0; k < 200; ++k) {
    PlanInput in;
    in.num_ranks = 4;
    in.num_experts = 8;
    in.replica_slots = 2;
    in.recalibration_rate = k % 2 ? 0.3 : 0.0;
    in.balance_slack = 0.0;
    in.gpus_per_node = k % 3 == 0 ? 2 : 0;
    in.memory.forward_row_bytes = 1;
    in.memory.budget_bytes = int64_t(1) << 30;
    for (int i = 0; i < 32; ++i) in.load_WE.push_back(next() % (1 + 10 * (i % 8)));
    for (const char* policy : {"fixed", "ultraep", "lrmoe"}) {
      const Plan p = make_plan(policy, in);
      PlanInput again = in;
      std::vector<int64_t> rows(static_cast<size_t>(p.num_instances()), 0);
      for (int32_t i = 0; i < p.num_instances(); ++i)
        for (int32_t s = 0; s < 4; ++s) rows[i] += p.forward_IW[static_cast<size_t>(i) * 4 + s];
      set_previous(&again, p.instance_offsets, p.instance_rank, rows);
      const Plan q = make_plan(policy, again);
      EXPECT_TRUE(q.kept_previous) << policy << " k=" << k;
      EXPECT_EQ(q.instance_rank, p.instance_rank) << policy << " k=" << k;
      EXPECT_EQ(q.forward_IW, p.forward_IW) << policy << " k=" << k;
      EXPECT_EQ(q.retained_IW, p.retained_IW) << policy << " k=" << k;
      EXPECT_EQ(q.moved_replicas, 0);
    }
  }
}

TEST(PlannerHysteresis, BadPreviousPlacementNamesTheField) {
  struct Case { std::vector<int32_t> off, rank; std::vector<int64_t> rows; double th; const char* policy; const char* msg; };
  const Case cases[] = {
      {{0, 1}, {0}, {1}, 0.0, "lrmoe", "previous_instance_offsets"},
      {{0, 1, 2}, {0, 2}, {1, 1}, 0.0, "lrmoe", "previous_instance_rank must be in"},
      {{0, 2, 3}, {0, 0, 1}, {1, 1, 1}, 0.0, "lrmoe", "two instances"},
      {{0, 1, 2}, {1, 0}, {1, 1}, 0.0, "lrmoe", "owner"},
      {{0, 1, 2}, {0, 1}, {1}, 0.0, "lrmoe", "previous_instance_rows"},
      {{0, 1, 2}, {0, 1}, {1, 1}, 1.0, "lrmoe", "replan_threshold"},
      {{0, 1, 2}, {0, 1}, {1, 1}, 0.0, "symi", "symi"},
  };
  for (const Case& c : cases) {
    PlanInput in = two_ranks(6, 2);
    set_previous(&in, c.off, c.rank, c.rows);
    in.replan_threshold = c.th;
    try {
      make_plan(c.policy, in);
      ADD_FAILURE() << "accepted: " << c.msg;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(c.msg), std::string::npos) << e.what();
    }
  }
}

}  // namespace
