// GoogleTests of UltraEP's refinement passes (PlanInput::ultraep_refine,
// csrc/planner/ultraep_refine.h) and the spare-capacity forward split
// (PlanInput::spare_capacity_split, route.h split_forward).
//
// References: the exact optimum of the max rows per rank (exact.h, over every placement
// of fixed owners + <= R replicas per rank and every integer split; itself tested
// against brute force in test_bound.cpp), and hand-computed splits.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "planner/exact.h"
#include "planner/plan.h"
#include "planner/route.h"

namespace {

using namespace lrmoe::planner;

PlanInput random_input(std::mt19937_64& g, int32_t W, int32_t E) {
  PlanInput in;
  in.num_ranks = W;
  in.num_experts = E;
  in.replica_slots = 1 + static_cast<int32_t>(g() % 2);
  std::vector<int64_t> pop(static_cast<size_t>(E));
  for (auto& p : pop) p = 1 + static_cast<int64_t>(g() % 4) * static_cast<int64_t>(g() % 5);
  for (int32_t s = 0; s < W; ++s)
    for (int32_t e = 0; e < E; ++e) in.load_WE.push_back(static_cast<int64_t>(g() % (1 + 6 * pop[e])));
  in.memory.budget_bytes = 1;  // no memory charged: the gap is balance only
  return in;
}

// On 1,200 random instances (W = 2, 3, 4, 8; E = W, 2 W; R = 1, 2): the refined plan's
// max rows per rank is never above the plain one's nor below the exact optimum, every
// row is computed exactly once and no rank holds more than R replicas; the refinement
// lowers the max on some instances (counted and printed).
TEST(PlannerUltraEP, RefinementNeverWorseAndAgainstTheExactOptimum) {
  std::mt19937_64 g(42);
  int improved = 0, optimal_plain = 0, optimal_refined = 0, total = 0;
  for (int32_t W : {2, 3, 4, 8})
    for (int32_t mult : {1, 2})
      for (int k = 0; k < 150; ++k) {
        PlanInput in = random_input(g, W, W * mult);
        const Plan plain = make_plan("ultraep", in);
        in.ultraep_refine = true;
        const Plan refined = make_plan("ultraep", in);
        ExactInput x = exact_input(in, PlacementModel::kOwners, {}, false);
        const ExactResult opt = exact_optimum(x);
        ASSERT_TRUE(opt.proven);
        ++total;
        EXPECT_LE(refined.max_forward_rows(), plain.max_forward_rows());
        EXPECT_GE(refined.max_forward_rows(), opt.optimum);
        improved += refined.max_forward_rows() < plain.max_forward_rows();
        optimal_plain += plain.max_forward_rows() == opt.optimum;
        optimal_refined += refined.max_forward_rows() == opt.optimum;
        // rows conserved, slots
        const int32_t E = in.num_experts;
        std::vector<int64_t> col(static_cast<size_t>(W) * E, 0);
        std::vector<int32_t> reps(static_cast<size_t>(W), 0);
        for (int32_t e = 0; e < E; ++e)
          for (int32_t i = refined.instance_offsets[e]; i < refined.instance_offsets[e + 1]; ++i) {
            if (i > refined.instance_offsets[e]) reps[refined.instance_rank[i]] += 1;
            for (int32_t s = 0; s < W; ++s) col[static_cast<size_t>(s) * E + e] += refined.forward_IW[static_cast<size_t>(i) * W + s];
          }
        EXPECT_EQ(col, in.load_WE);
        for (int32_t r = 0; r < W; ++r) EXPECT_LE(reps[r], in.replica_slots);
      }
  std::printf("ultraep on %d instances: refinement lowered the max on %d; optimal plain %d, "
              "refined %d\n", total, improved, optimal_plain, optimal_refined);
  EXPECT_GT(improved, 0);
  EXPECT_GE(optimal_refined, optimal_plain);
}

// One expert, instances on ranks 0 and 1 (4 rows each), all rows from sources 2 and 3
// (4 each). North-west: source 2 fills instance 0, source 3 instance 1. Spare capacity:
// source 2 splits 4 over the capacities [4, 4] -> [2, 2], source 3 over [2, 2] -> [2, 2].
TEST(PlannerUltraEP, SpareCapacitySplitByHand) {
  const int64_t L[4] = {0, 0, 4, 4};
  const int32_t rank[2] = {0, 1};
  const int64_t quota[2] = {4, 4};
  int64_t F[8];
  split_forward(L, 4, rank, quota, 2, F, 0, false);
  EXPECT_EQ(std::vector<int64_t>(F, F + 8), (std::vector<int64_t>{0, 0, 4, 0, 0, 0, 0, 4}));
  split_forward(L, 4, rank, quota, 2, F, 0, true);
  EXPECT_EQ(std::vector<int64_t>(F, F + 8), (std::vector<int64_t>{0, 0, 2, 2, 0, 0, 2, 2}));
  // uneven: capacities [3, 1] after source 0's own row; source 2's 3 rows -> [2, 1]
  // (3 x 3/4 = 2.25, 3 x 1/4 = 0.75: floors [2, 0], the larger remainder 0.75 gets the
  // row); source 3's 1 row fills the rest [1, 0]
  const int64_t L2[4] = {1, 0, 3, 1};
  const int64_t quota2[2] = {4, 1};
  split_forward(L2, 4, rank, quota2, 2, F, 0, true);
  EXPECT_EQ(std::vector<int64_t>(F, F + 8), (std::vector<int64_t>{1, 0, 2, 1, 0, 0, 1, 0}));
}

// With the spare split every policy's plan keeps its rows per instance and per rank, and
// every (source, expert) row is still computed exactly once.
TEST(PlannerUltraEP, SpareCapacitySplitKeepsTheTotals) {
  std::mt19937_64 g(5);
  for (int k = 0; k < 200; ++k) {
    PlanInput in = random_input(g, 4, 8);
    in.gpus_per_node = k % 2 ? 2 : 0;
    for (const char* policy : {"ultraep", "symi", "lrmoe"}) {
      const Plan a = make_plan(policy, in);
      PlanInput x = in;
      x.spare_capacity_split = true;
      const Plan b = make_plan(policy, x);
      ASSERT_EQ(a.instance_rank, b.instance_rank) << policy;
      EXPECT_EQ(a.forward_rows_W, b.forward_rows_W) << policy;
      std::vector<int64_t> col(32, 0);
      for (int32_t e = 0; e < 8; ++e)
        for (int32_t i = b.instance_offsets[e]; i < b.instance_offsets[e + 1]; ++i) {
          int64_t fa = 0, fb = 0;
          for (int32_t s = 0; s < 4; ++s) {
            fa += a.forward_IW[static_cast<size_t>(i) * 4 + s];
            fb += b.forward_IW[static_cast<size_t>(i) * 4 + s];
            col[static_cast<size_t>(s) * 8 + e] += b.forward_IW[static_cast<size_t>(i) * 4 + s];
          }
          EXPECT_EQ(fa, fb) << policy;
        }
      EXPECT_EQ(col, in.load_WE) << policy;
    }
  }
}

}  // namespace
