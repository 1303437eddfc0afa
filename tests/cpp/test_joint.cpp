// GoogleTests of lrmoe's joint objective (csrc/planner/joint.h): the local search over
// cuts and replicas against an exhaustive reference on tiny instances, and its
// invariants on random loads.
//
// References are independent of the code under test: the rank time is recomputed here
// from the plan's instances (t_r = forward rows + retained rows + kappa x replicas), the
// memory from the model, and the optimum by dynamic programming over every placement
// (fixed owners plus <= R replicas per rank), every integer forward split and every
// retained split with floor_e <= Q_e <= n_e and sum Q >= sum of the quota rule's Q(c).
//
// Legend: W ranks, E experts, n_E demand, Q_E quotas, R replica slots, kappa
// replica_cost_rows.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <cstdint>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "core/quota.h"
#include "planner/plan.h"

namespace {

using namespace lrmoe::planner;

int64_t sum(const std::vector<int64_t>& v) { return std::accumulate(v.begin(), v.end(), int64_t(0)); }

std::vector<int64_t> demand(const PlanInput& in) {
  std::vector<int64_t> n(in.num_experts, 0);
  for (int s = 0; s < in.num_ranks; ++s)
    for (int e = 0; e < in.num_experts; ++e) n[e] += in.load_WE[s * in.num_experts + e];
  return n;
}

std::vector<int64_t> rule_quotas(const PlanInput& in) {
  const std::vector<int64_t> n = demand(in);
  std::vector<int64_t> q(n.size());
  lrmoe::core::compute_quotas(in.quota_rule, n.data(), in.num_experts, in.recalibration_rate, q.data());
  return q;
}

std::vector<int64_t> floors(const PlanInput& in) {
  const std::vector<int64_t> n = demand(in), q = rule_quotas(in);
  std::vector<int64_t> f(q);
  if (in.recalibration_rate > 0)
    for (size_t e = 0; e < n.size(); ++e)
      f[e] = std::min(q[e], lrmoe::core::retained_total(n[e], in.max_expert_cut));
  return f;
}

// max_r t_r, from the instances and the (instance, source) cells
int64_t objective(const Plan& p, int64_t kappa) {
  const int W = p.num_ranks;
  std::vector<int64_t> t(W, 0);
  for (int e = 0; e < p.num_experts; ++e)
    for (int i = p.instance_offsets[e]; i < p.instance_offsets[e + 1]; ++i) {
      const int r = p.instance_rank[i];
      if (i > p.instance_offsets[e]) t[r] += kappa;
      for (int s = 0; s < W; ++s)
        t[r] += p.forward_IW[size_t(i) * W + s] + p.retained_IW[size_t(i) * W + s];
    }
  return *std::max_element(t.begin(), t.end());
}

// The optimum of max_r t_r (no memory limit) by dynamic programming over experts; the
// state is (t per rank, replicas per rank, retained so far).
int64_t brute_force(const PlanInput& in, int64_t kappa) {
  const int W = in.num_ranks, E = in.num_experts, per = E / W, R = in.replica_slots;
  const std::vector<int64_t> n = demand(in), fl = floors(in);
  const int64_t need = sum(rule_quotas(in));
  using State = std::vector<int64_t>;  // W times, W replica counts, retained
  std::set<State> states{State(2 * W + 1, 0)};
  for (int e = 0; e < E; ++e) {
    const int owner = e / per;
    // every option of expert e: (delta t per rank, replica mask, Q_e)
    std::set<State> options;
    for (int mask = 0; mask < (1 << W); ++mask) {
      if (mask >> owner & 1) continue;
      std::vector<int> ranks{owner};
      for (int r = 0; r < W; ++r)
        if (mask >> r & 1) ranks.push_back(r);
      const int k = static_cast<int>(ranks.size());
      std::vector<int64_t> f(k, 0), b(k, 0);
      // every composition of n_e into k forward parts, then every b_i in [0, f_i]
      std::function<void(int, int64_t)> forward = [&](int i, int64_t left) {
        if (i == k - 1) {
          f[i] = left;
          std::function<void(int, int64_t)> back = [&](int j, int64_t kept) {
            if (j == k) {
              if (kept < fl[e] || kept > n[e]) return;
              State o(2 * W + 1, 0);
              for (int x = 0; x < k; ++x) {
                o[ranks[x]] += f[x] + b[x] + (x > 0 ? kappa : 0);
                if (x > 0) o[W + ranks[x]] = 1;
              }
              o[2 * W] = kept;
              options.insert(o);
              return;
            }
            for (b[j] = 0; b[j] <= f[j]; ++b[j]) back(j + 1, kept + b[j]);
          };
          back(0, 0);
          return;
        }
        for (f[i] = 0; f[i] <= left; ++f[i]) forward(i + 1, left - f[i]);
      };
      forward(0, n[e]);
    }
    std::set<State> next;
    for (const State& s : states)
      for (const State& o : options) {
        State x(s);
        bool ok = true;
        for (int r = 0; r < 2 * W + 1; ++r) x[r] += o[r];
        for (int r = 0; r < W; ++r) ok = ok && x[W + r] <= R;
        if (ok) next.insert(x);
      }
    states.swap(next);
  }
  int64_t best = std::numeric_limits<int64_t>::max();
  for (const State& s : states)
    if (s[2 * W] >= need) best = std::min(best, *std::max_element(s.begin(), s.begin() + W));
  return best;
}

PlanInput tiny(std::mt19937_64& rng, int W, int E, int64_t max_cell) {
  PlanInput in;
  in.num_ranks = W;
  in.num_experts = E;
  in.load_WE.resize(size_t(W) * E);
  const int hot = static_cast<int>(rng() % E);  // one hot expert: replicas and cuts matter
  for (int s = 0; s < W; ++s)
    for (int e = 0; e < E; ++e)
      in.load_WE[s * E + e] = static_cast<int64_t>(rng() % (max_cell + 1)) + (e == hot ? max_cell : 0);
  in.recalibration_rate = std::vector<double>{0.0, 0.25, 0.5}[rng() % 3];
  in.max_expert_cut = 0.5;
  in.replica_slots = 1;
  in.replica_cost_rows = static_cast<int64_t>(rng() % 3);
  in.memory.budget_bytes = int64_t(1) << 40;  // no memory limit
  in.memory.forward_row_bytes = 1;
  in.memory.backward_row_bytes = 2;
  in.memory.expert_weight_bytes = 10;
  in.memory.expert_grad_bytes = 20;
  return in;
}

TEST(PlannerJoint, AgainstTheExhaustiveOptimumOnTinyCases) {
  std::mt19937_64 rng(30);
  int cases = 0, optimal = 0, improved = 0;
  int64_t worst = 0;
  struct Size { int W, E; int64_t cell; int trials; };
  for (const Size& z : {Size{2, 2, 3, 150}, Size{2, 4, 1, 60}, Size{3, 3, 1, 40}}) {
    for (int trial = 0; trial < z.trials; ++trial) {
      PlanInput in = tiny(rng, z.W, z.E, z.cell);
      in.balance_slack = (trial % 2) ? 0.0 : -1.0;
      const int64_t kappa = in.replica_cost_rows;
      const int64_t opt = brute_force(in, kappa);
      in.joint = false;
      const int64_t seq = objective(make_plan("lrmoe", in), kappa);
      in.joint = true;
      const Plan p = make_plan("lrmoe", in);
      ASSERT_TRUE(p.feasible) << p.reason;
      const int64_t joint = objective(p, kappa);
      ASSERT_GE(joint, opt) << "below the exhaustive optimum: the plan breaks a constraint";
      ASSERT_LE(joint, seq) << "the joint plan is worse than the sequential one";
      ASSERT_GE(sum(p.quota_E), sum(rule_quotas(in))) << "dropped more than c allows";
      ++cases;
      optimal += joint == opt;
      improved += joint < seq;
      worst = std::max(worst, joint - opt);
      if (getenv("JOINT_DEBUG") && joint - opt > 1) {
        std::printf("W=%d E=%d c=%g kappa=%lld slack=%g opt=%lld joint=%lld seq=%lld load:", z.W, z.E,
                    in.recalibration_rate, (long long)kappa, in.balance_slack, (long long)opt,
                    (long long)joint, (long long)seq);
        for (int64_t v : in.load_WE) std::printf(" %lld", (long long)v);
        std::printf(" | Q:");
        for (int64_t v : p.quota_E) std::printf(" %lld", (long long)v);
        std::printf(" | ranks:");
        for (int32_t v : p.instance_rank) std::printf(" %d", v);
        std::printf(" | fwd:");
        for (int64_t v : p.forward_rows_W) std::printf(" %lld", (long long)v);
        std::printf(" bwd:");
        for (int64_t v : p.backward_rows_W) std::printf(" %lld", (long long)v);
        std::printf("\n");
      }
    }
  }
  std::printf("joint objective: optimal in %d of %d tiny cases, better than sequential in %d, "
              "worst +%lld rows\n", optimal, cases, improved, (long long)worst);
  // measured 2026-12-04 (joint.cpp as committed): see the printed line; the bounds leave
  // no room for a regression to the sequential plan's quality
  EXPECT_GE(optimal * 100, cases * 95);  // 242 of 250
  EXPECT_GT(improved, cases / 2);        // 140 of 250
  EXPECT_LE(worst, 1);
}

TEST(PlannerJoint, InvariantsOnRandomLoadsWithMemory) {
  // every constraint of the sequential plan, recomputed here, on loads from uniform to one
  // hot expert and budgets from hopeless to generous; plus: never worse on the objective,
  // feasible whenever the sequential plan is, the same rows dropped in total
  std::mt19937_64 rng(31);
  int feasible = 0, infeasible = 0, better = 0;
  for (int trial = 0; trial < 600; ++trial) {
    const int W = std::vector<int>{2, 4, 8}[rng() % 3];
    const int E = W * std::vector<int>{1, 2, 4}[rng() % 3];
    PlanInput in;
    in.num_ranks = W;
    in.num_experts = E;
    in.load_WE.resize(size_t(W) * E);
    const double a = std::uniform_real_distribution<double>(0.0, 2.0)(rng);
    for (int s = 0; s < W; ++s)
      for (int e = 0; e < E; ++e)
        in.load_WE[s * E + e] = static_cast<int64_t>(200.0 / std::pow(1.0 + (e * 7 + 3) % E, a) *
                                                     std::uniform_real_distribution<double>(0.0, 2.0)(rng));
    in.recalibration_rate = std::vector<double>{0.0, 0.1, 0.3}[rng() % 3];
    in.quota_rule = rng() % 2 ? lrmoe::core::QuotaRule::kProportional : lrmoe::core::QuotaRule::kWaterLevel;
    in.replica_slots = static_cast<int>(rng() % 3);
    in.max_expert_cut = std::vector<double>{0.0, 0.5}[rng() % 2];
    in.replica_cost_rows = std::vector<int64_t>{0, 5, 50}[rng() % 3];
    in.balance_slack = std::vector<double>{-1.0, 0.0}[rng() % 2];
    MemoryModel& m = in.memory;
    m.expert_weight_bytes = 100;
    m.expert_grad_bytes = 200;
    m.expert_optimizer_bytes = 600;
    m.forward_row_bytes = 3;
    m.backward_row_bytes = 5;
    m.resident_bytes = 1000;
    const double slack = std::uniform_real_distribution<double>(0.5, 3.0)(rng);
    m.budget_bytes = m.resident_bytes + (E / W) * 900 + 400 +
                     static_cast<int64_t>(slack * sum(in.load_WE) / W * 8);
    if (rng() % 4 == 0) in.backward_row_capacity = 1 + static_cast<int64_t>(slack * sum(in.load_WE) / W);
    SCOPED_TRACE("trial " + std::to_string(trial));
    const int64_t kappa = in.replica_cost_rows;
    in.joint = false;
    const Plan seq = make_plan("lrmoe", in);
    in.joint = true;
    const Plan p = make_plan("lrmoe", in);
    const std::vector<int64_t> n = demand(in), fl = floors(in), q = rule_quotas(in);
    std::vector<int64_t> fwd(W, 0), bwd(W, 0), reps(W, 0);
    for (int e = 0; e < E; ++e) {
      const int a0 = p.instance_offsets[e], a1 = p.instance_offsets[e + 1];
      ASSERT_GE(a1 - a0, 1);
      ASSERT_EQ(p.instance_rank[a0], e / (E / W)) << "the owner comes first";
      std::set<int> ranks;
      int64_t kept = 0;
      for (int i = a0; i < a1; ++i) {
        ASSERT_TRUE(ranks.insert(p.instance_rank[i]).second);
        if (i > a0) reps[p.instance_rank[i]] += 1;
      }
      for (int s = 0; s < W; ++s) {
        int64_t rows = 0;
        for (int i = a0; i < a1; ++i) {
          const int64_t f = p.forward_IW[size_t(i) * W + s], r = p.retained_IW[size_t(i) * W + s];
          ASSERT_GE(r, 0);
          ASSERT_LE(r, f);
          rows += f;
          kept += r;
          fwd[p.instance_rank[i]] += f;
          bwd[p.instance_rank[i]] += r;
        }
        ASSERT_EQ(rows, in.load_WE[s * E + e]);
      }
      ASSERT_EQ(kept, p.quota_E[e]);
      ASSERT_LE(p.quota_E[e], n[e]);
      ASSERT_GE(p.quota_E[e], fl[e]) << "expert " << e << " cut below its floor";
    }
    ASSERT_EQ(fwd, p.forward_rows_W);
    ASSERT_EQ(bwd, p.backward_rows_W);
    ASSERT_EQ(sum(p.quota_E), sum(seq.quota_E)) << "the cut is moved, never enlarged";
    ASSERT_LE(sum(p.quota_E), sum(q));
    bool fits = true;
    for (int r = 0; r < W; ++r) {
      ASSERT_LE(reps[r], in.replica_slots);
      const int64_t bytes = (E / W) * 900 + reps[r] * 300 + fwd[r] * 3 + bwd[r] * 5;
      ASSERT_EQ(p.memory_W[r].total(), bytes);
      if (bytes > m.budget_bytes - m.resident_bytes) fits = false;
      if (in.backward_row_capacity > 0 && bwd[r] > in.backward_row_capacity) fits = false;
    }
    ASSERT_EQ(p.feasible, fits) << p.reason;
    if (seq.feasible) ASSERT_TRUE(p.feasible) << p.reason;
    const int64_t tj = objective(p, kappa), ts = objective(seq, kappa);
    ASSERT_LE(tj, ts);
    better += tj < ts;
    (p.feasible ? feasible : infeasible) += 1;
    const Plan again = make_plan("lrmoe", in);
    ASSERT_EQ(again.retained_IW, p.retained_IW) << "same input, another plan";
    ASSERT_EQ(again.forward_IW, p.forward_IW);
  }
  EXPECT_GT(feasible, 100);
  EXPECT_GT(infeasible, 20);
  EXPECT_GT(better, 100);
}

TEST(PlannerJoint, HandComputedCutMove) {
  // one rank pair, no replica slot: experts [8 | 4] on ranks 0 | 1 (one source each),
  // c = 0.25, max_expert_cut 0.5. Proportional quotas [6, 3]: t = [8 + 6, 4 + 3] = [14, 7].
  // The joint plan may only move the cut (no slots): the most it can drop on expert 0 is
  // 6 - floor(0.5 x 8) = 2 and the most expert 1 can take back is 4 - 3 = 1, so one row
  // moves: Q = [5, 4], t = [13, 8]; the same 3 rows dropped in total.
  PlanInput in;
  in.num_ranks = 2;
  in.num_experts = 2;
  in.load_WE = {8, 0, 0, 4};
  in.recalibration_rate = 0.25;
  in.max_expert_cut = 0.5;
  in.replica_slots = 0;
  in.memory.budget_bytes = 1 << 20;
  in.joint = true;
  const Plan p = make_plan("lrmoe", in);
  EXPECT_EQ(p.quota_E, (std::vector<int64_t>{5, 4}));
  EXPECT_EQ(p.backward_rows_W, (std::vector<int64_t>{5, 4}));
  EXPECT_EQ(objective(p, 0), 13);
}

TEST(PlannerJoint, HandComputedReplicaAgainstItsCost) {
  // experts [12 | 0] on ranks 0 | 1, c = 0, one slot: t = [24, 0]. A replica on rank 1
  // taking x rows in (forward, retained) pairs gives t = [24 - 2x, 2x + kappa]. kappa = 0:
  // x = 6, t = [12, 12]; kappa = 4: 24 - 2x vs 2x + 4, x = 5, t = [14, 14]; kappa = 30:
  // no replica helps (24 <= 30), the plan stays at t = [24, 0] with no replica.
  PlanInput in;
  in.num_ranks = 2;
  in.num_experts = 2;
  in.load_WE = {12, 0, 0, 0};
  in.replica_slots = 1;
  in.memory.budget_bytes = 1 << 20;
  in.balance_slack = -1.0;
  in.joint = true;
  for (const auto& kv : std::vector<std::pair<int64_t, int64_t>>{{0, 12}, {4, 14}, {30, 24}}) {
    in.replica_cost_rows = kv.first;
    const Plan p = make_plan("lrmoe", in);
    EXPECT_EQ(objective(p, kv.first), kv.second) << "kappa " << kv.first;
    EXPECT_EQ(p.replicas, kv.first == 30 ? 0 : 1) << "kappa " << kv.first;
  }
}

}  // namespace
