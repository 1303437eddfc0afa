// GoogleTests for the lower bound reported with every plan (csrc/planner/bound.h) and the
// exact optimum (csrc/planner/exact.h).
//
// References independent of the code under test: a brute force written here that
// enumerates every integer split of every expert's rows over the ranks (which fixes the
// placement: a rank with rows of an expert holds an instance of it) and checks slots and
// memory at the leaves; and hand-computed cases in comments.
//
// Legend: W ranks, E experts, d_E rows per expert, R replica slots per rank (owners
// model), S instance slots per rank (free model), T max rows per rank.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "planner/bound.h"
#include "planner/exact.h"
#include "planner/plan.h"

namespace {

using namespace lrmoe::planner;
constexpr int64_t kNone = std::numeric_limits<int64_t>::max();

// The smallest max rows per rank over every split, or kNone when no split fits memory.
// Owners: expert e always on rank e / (E / W); a non-owner rank with rows of e holds a
// replica (at most R). Free: a rank with rows of e holds an instance (at most S per
// rank), and the experts without rows still need a slot each somewhere.
int64_t brute_force(const ExactInput& x) {
  const int W = x.num_ranks, E = x.num_experts;
  const bool owners = x.model == PlacementModel::kOwners;
  std::vector<int64_t> rows(W, 0);
  std::vector<int> count(W, 0);  // replicas (owners) or instances (free) per rank
  int64_t best = kNone;
  std::function<void(int)> expert;
  std::vector<std::vector<int64_t>> part(E, std::vector<int64_t>(W, 0));
  std::function<void(int, int, int64_t)> deal = [&](int e, int r, int64_t left) {
    if (r == W - 1) {
      part[e][r] = left;
      expert(e + 1);
      return;
    }
    for (int64_t k = 0; k <= left; ++k) {
      part[e][r] = k;
      deal(e, r + 1, left - k);
    }
  };
  expert = [&](int e) {
    if (e == E) {
      std::fill(rows.begin(), rows.end(), 0);
      std::fill(count.begin(), count.end(), 0);
      int idle = 0;  // free model: experts that need a slot but carry no rows
      for (int f = 0; f < E; ++f) {
        const int owner = owners ? f / (E / W) : -1;
        bool any = false;
        for (int r = 0; r < W; ++r) {
          rows[r] += part[f][r];
          if (part[f][r] > 0 && r != owner) count[r] += 1;
          any = any || part[f][r] > 0;
        }
        if (!owners && !any) idle += 1;
      }
      int free_slots = 0;
      for (int r = 0; r < W; ++r) {
        if (count[r] > x.slots) return;
        free_slots += x.slots - count[r];
        if (x.row_bytes > 0) {
          const int64_t k = owners ? count[r] : 0;
          if (x.base_bytes + k * x.replica_bytes + rows[r] * x.row_bytes > x.limit_bytes) return;
        }
      }
      if (idle > free_slots) return;
      best = std::min(best, *std::max_element(rows.begin(), rows.end()));
      return;
    }
    deal(e, 0, x.demand_E[e]);
  };
  expert(0);
  return best;
}

ExactInput tiny(std::mt19937_64& rng, PlacementModel model, bool memory) {
  ExactInput x;
  x.num_ranks = 2 + static_cast<int>(rng() % 2);
  const int per = 1 + static_cast<int>(rng() % 2);
  x.num_experts = model == PlacementModel::kOwners ? x.num_ranks * per : 2 + static_cast<int>(rng() % 3);
  x.model = model;
  x.demand_E.resize(x.num_experts);
  for (auto& d : x.demand_E) d = static_cast<int64_t>(rng() % 6);
  const int ceil_per = (x.num_experts + x.num_ranks - 1) / x.num_ranks;
  x.slots = model == PlacementModel::kOwners ? static_cast<int>(rng() % 3)
                                             : std::min(x.num_experts, ceil_per + static_cast<int>(rng() % 3));
  if (memory) {
    x.row_bytes = 1;
    x.base_bytes = 2;
    x.replica_bytes = model == PlacementModel::kOwners ? 1 + static_cast<int64_t>(rng() % 3) : 0;
    x.limit_bytes = 2 + static_cast<int64_t>(rng() % 10);
  }
  return x;
}

TEST(ExactOptimum, EqualsBruteForceOnTinyInstances) {
  std::mt19937_64 rng(30);
  int checked = 0, infeasible = 0, above_bound = 0;
  for (PlacementModel model : {PlacementModel::kOwners, PlacementModel::kFree})
    for (bool memory : {false, true})
      for (int t = 0; t < 150; ++t) {
        const ExactInput x = tiny(rng, model, memory);
        const ExactResult r = exact_optimum(x);
        const int64_t want = brute_force(x);
        SCOPED_TRACE("model " + std::to_string(int(model)) + " memory " + std::to_string(memory) +
                     " trial " + std::to_string(t));
        ASSERT_TRUE(r.proven);
        ASSERT_EQ(r.feasible, want != kNone);
        ++checked;
        if (want == kNone) { ++infeasible; continue; }
        ASSERT_EQ(r.optimum, want);
        ASSERT_LE(r.lower_bound, r.optimum);
        above_bound += r.optimum > r.lower_bound;
        // the split returned reaches the optimum on the placement returned
        const int W = x.num_ranks, E = x.num_experts;
        std::vector<int64_t> rows(W, 0);
        for (int e = 0; e < E; ++e) {
          int64_t got = 0;
          for (int w = 0; w < W; ++w) {
            const int64_t v = r.rows_EW[e * W + w];
            if (v > 0) { ASSERT_TRUE(r.holds_EW[e * W + w]); }
            got += v;
            rows[w] += v;
          }
          ASSERT_EQ(got, x.demand_E[e]);
        }
        ASSERT_EQ(*std::max_element(rows.begin(), rows.end()), r.optimum);
      }
  EXPECT_GT(infeasible, 10);   // the random budgets reach both outcomes
  EXPECT_GT(above_bound, 10);  // and instances where the bound is not tight
  std::printf("exact = brute force on %d tiny instances (%d infeasible, %d above the bound)\n",
              checked, infeasible, above_bound);
}

TEST(ExactOptimum, HandComputedOneHotExpert) {
  // W = 4, E = 4, expert 0 has 100 rows (all others 0), one free slot per rank (R = 1).
  // Bound: ceil(100 / 4) = 25 by (a) and (b); (c) at 25 needs ceil(100 / 25) - 1 = 3
  // spare instances <= X = R W = 4: bound 25. Optimum: replicas of expert 0 on ranks 1,
  // 2, 3 and 25 rows on each of the four ranks: 25 = the bound.
  ExactInput x;
  x.num_ranks = 4;
  x.num_experts = 4;
  x.demand_E = {100, 0, 0, 0};
  x.slots = 1;
  ExactResult r = exact_optimum(x);
  EXPECT_EQ(r.lower_bound, 25);
  EXPECT_EQ(r.optimum, 25);
  EXPECT_EQ(r.rows_EW, (std::vector<int64_t>{25, 25, 25, 25, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}));
  // R = 0: no replica, X = 0: (c) needs ceil(100 / T) = 1, T = 100; the owner computes all
  x.slots = 0;
  r = exact_optimum(x);
  EXPECT_EQ(r.lower_bound, 100);
  EXPECT_EQ(r.optimum, 100);
  // R = 1 with memory: 1 byte per row, a replica costs 20 bytes, 40 bytes per rank. A
  // replica's rank computes at most 40 - 20 = 20 rows, so ranks 1-3 take 60 and the owner
  // keeps 40 (it may: 40 rows = 40 bytes). Optimum 40; the bound ignores memory: 25.
  x.slots = 1;
  x.row_bytes = 1;
  x.replica_bytes = 20;
  x.limit_bytes = 40;
  r = exact_optimum(x);
  EXPECT_TRUE(r.feasible);
  EXPECT_EQ(r.lower_bound, 25);
  EXPECT_EQ(r.optimum, 40);
  // 39 bytes: 39 + 3 x 19 = 96 < 100 rows fit in all: no placement
  x.limit_bytes = 39;
  r = exact_optimum(x);
  EXPECT_FALSE(r.feasible);
  EXPECT_TRUE(r.proven);
}

TEST(ExactOptimum, HandComputedBoundNotTight) {
  // W = 2, E = 2 (expert e on rank e), d = [3, 1], R = 0: rank 0 computes 3, the optimum.
  // Bound: ceil(4 / 2) = 2 from (a), but (c) at T = 2 needs ceil(3 / 2) - 1 = 1 spare
  // instance > X = 0, and at T = 3 none: bound 3. With R = 1 expert 0 splits 2 + 1 with
  // a replica on rank 1 (2 + 2 rows): optimum 2, bound 2.
  ExactInput x;
  x.num_ranks = 2;
  x.num_experts = 2;
  x.demand_E = {3, 1};
  x.slots = 0;
  EXPECT_EQ(exact_optimum(x).optimum, 3);
  EXPECT_EQ(rows_lower_bound(x.demand_E, 2, 0), 3);
  x.slots = 1;
  EXPECT_EQ(exact_optimum(x).optimum, 2);
  EXPECT_EQ(rows_lower_bound(x.demand_E, 2, 2), 2);
  // free model, W = 2, S = 1, E = 2, d = [3, 1]: one expert per GPU, optimum 3; bound: X
  // = S W - E = 0, 3
  x.model = PlacementModel::kFree;
  x.slots = 1;
  const ExactResult r = exact_optimum(x);
  EXPECT_EQ(r.optimum, 3);
  EXPECT_EQ(r.lower_bound, 3);
}

TEST(ExactOptimum, RefusesLargeInstancesNamingTheField) {
  ExactInput x;
  x.num_ranks = 16;
  x.num_experts = 16;
  x.demand_E.assign(16, 1);
  auto expect = [](const ExactInput& in, const std::string& what) {
    try {
      exact_optimum(in);
      ADD_FAILURE() << "no error, expected one naming " << what;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  expect(x, "num_ranks");
  x.num_ranks = 8;
  x.num_experts = 32;
  x.demand_E.assign(32, 1);
  expect(x, "num_experts");
  x.num_experts = 16;
  x.demand_E.assign(16, 1);
  x.slots = 3;
  expect(x, "slots");
  x.slots = 2;
  x.num_experts = 12;
  x.demand_E.assign(12, 1);
  expect(x, "multiple of num_ranks");
  x.demand_E.assign(11, 1);
  expect(x, "demand_E");
  EXPECT_THROW(rows_lower_bound({1, -1}, 2, 0), std::invalid_argument);
}

// ---- the bound and the optimum against every policy's plans ---------------------

// Zipf-like loads as the planner's tests draw them: popularity 1 / (rank + 1)^a, shuffled
std::vector<int64_t> zipf_loads(std::mt19937_64& rng, int W, int E, int64_t rows_per_rank) {
  std::vector<double> p(E);
  const double a = std::uniform_real_distribution<double>(0.0, 2.0)(rng);
  for (int e = 0; e < E; ++e) p[e] = 1.0 / std::pow(e + 1.0, a);
  std::shuffle(p.begin(), p.end(), rng);
  std::discrete_distribution<int> pick(p.begin(), p.end());
  std::vector<int64_t> L(static_cast<size_t>(W) * E, 0);
  for (int s = 0; s < W; ++s)
    for (int64_t k = 0, n = static_cast<int64_t>(rng() % (rows_per_rank + 1)); k < n; ++k)
      L[s * E + pick(rng)] += 1;
  return L;
}

PlanInput random_plan_input(std::mt19937_64& rng, int W, int E, bool generous) {
  PlanInput in;
  in.num_ranks = W;
  in.num_experts = E;
  in.load_WE = zipf_loads(rng, W, E, rng() % 3 == 0 ? 6 : 60);
  in.recalibration_rate = std::vector<double>{0.0, 0.3}[rng() % 2];
  in.replica_slots = static_cast<int>(rng() % 3);
  in.balance_slack = std::vector<double>{-1.0, 0.0}[rng() % 2];
  in.memory = {10, 20, 60, rng() % 2 == 0, 1, 2, 0, 1000};
  int64_t D = 0;
  for (int64_t v : in.load_WE) D += v;
  const int64_t rows = generous ? (1 << 20) : 3 * (D / W + 1) * (1 + static_cast<int64_t>(rng() % 3)) / 2;
  in.memory.budget_bytes = in.memory.resident_bytes + (E / W + 2) * 90 + rows * 3;
  return in;
}

TEST(LowerBound, EqualsItsDefinition) {
  // the smallest T passing (a)-(c) of bound.h, found by counting up from 0
  std::mt19937_64 rng(12);
  for (int t = 0; t < 3000; ++t) {
    const int W = 1 + static_cast<int>(rng() % 8);
    std::vector<int64_t> d(1 + rng() % 12);
    for (auto& v : d) v = static_cast<int64_t>(rng() % (rng() % 2 ? 8 : 60));
    const int64_t X = static_cast<int64_t>(rng() % 10);
    int64_t D = 0;
    for (int64_t v : d) D += v;
    int64_t T = 0;
    auto passes = [&](int64_t T) {
      if (W * T < D) return false;
      int64_t spare = 0;
      for (int64_t v : d) {
        if (v > W * T) return false;
        if (v > 0) spare += (v + T - 1) / T - 1;
      }
      return spare <= X;
    };
    while (D > 0 && !passes(T)) ++T;
    ASSERT_EQ(rows_lower_bound(d, W, X), T) << "trial " << t;
  }
}

TEST(LowerBound, AtMostEveryPolicysObjective) {
  // thousands of random instances, every policy, feasible or not (the bound ignores memory)
  std::mt19937_64 rng(4);
  int plans = 0, tight = 0;
  for (int t = 0; t < 1500; ++t) {
    const int W = std::vector<int>{1, 2, 3, 4, 8}[rng() % 5];
    const int E = W * (1 + static_cast<int>(rng() % 3));
    PlanInput in = random_plan_input(rng, W, E, rng() % 2 == 0);
    if (in.replica_slots == 0) in.replica_slots = 1;  // ultraep needs a slot
    for (const char* policy : {"fixed", "ultraep", "symi", "lrmoe"}) {
      const Plan p = make_plan(policy, in);
      ASSERT_LE(p.forward_bound, p.max_forward_rows()) << policy << " trial " << t;
      ASSERT_LE(p.backward_bound, p.max_backward_rows()) << policy << " trial " << t;
      if (p.policy != PolicyKind::kLRMoE) { ASSERT_EQ(p.backward_bound, p.forward_bound); }
      tight += p.forward_bound == p.max_forward_rows();
      ++plans;
    }
  }
  EXPECT_GT(tight, 500);  // the bound is often reached
  std::printf("bound <= objective on %d plans (%d reach it)\n", plans, tight);
}

TEST(ExactOptimum, BetweenTheBoundAndEveryPolicy) {
  // W <= 4, E <= 8, few rows: exact (owners) <= fixed, ultraep, lrmoe; exact (free) <=
  // symi; with memory only against the plans that fit it (at c = 0 for lrmoe: the exact
  // optimum charges every row forward and backward)
  std::mt19937_64 rng(8);
  int compared = 0, free_proven = 0;
  for (int t = 0; t < 400; ++t) {
    const int W = std::vector<int>{2, 3, 4}[rng() % 3];
    const int E = W * (1 + static_cast<int>(rng() % 2));
    const bool memory = rng() % 2 == 0;
    PlanInput in = random_plan_input(rng, W, E, !memory);
    if (in.replica_slots == 0) in.replica_slots = 1;
    if (memory) in.recalibration_rate = 0.0;
    const ExactResult owners = exact_optimum(exact_input(in, PlacementModel::kOwners, {}, memory));
    ASSERT_TRUE(owners.proven) << "trial " << t;
    // the free model's search is far larger (every instance placed from nothing): within a
    // budget of nodes, and compared only where it finished
    ExactInput fx = exact_input(in, PlacementModel::kFree, {}, memory);
    fx.max_nodes = 20000;
    const ExactResult free = exact_optimum(fx);
    free_proven += free.proven;
    for (const char* policy : {"fixed", "ultraep", "symi", "lrmoe"}) {
      const Plan p = make_plan(policy, in);
      const ExactResult& x = p.policy == PolicyKind::kSymi ? free : owners;
      if (!x.proven) continue;
      if (x.feasible) { ASSERT_GE(x.optimum, p.forward_bound) << policy << " trial " << t; }
      if (memory && !p.feasible) continue;
      ASSERT_TRUE(x.feasible) << policy << " fits where the exact search found nothing, trial " << t;
      ASSERT_LE(x.optimum, p.max_forward_rows()) << policy << " trial " << t;
      if (p.policy == PolicyKind::kLRMoE && !memory) {  // its retained rows against its quotas
        const ExactResult b = exact_optimum(exact_input(in, PlacementModel::kOwners, p.quota_E, false));
        ASSERT_GE(b.optimum, p.backward_bound);
        ASSERT_LE(b.optimum, p.max_backward_rows()) << "trial " << t;
      }
      ++compared;
    }
  }
  EXPECT_GT(free_proven, 200);
  std::printf("exact optimum between the bound and %d plans (free model finished on %d of 400)\n",
              compared, free_proven);
}

}  // namespace
