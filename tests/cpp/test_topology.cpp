// GoogleTests of the topology-aware planner (PlanInput::gpus_per_node,
// docs/planner.md, "Topology"): one node reproduces the plans of the flat planner
// exactly (a fingerprint recorded from the planner before gpus_per_node existed),
// hand-built cases where the node-aware choice is forced, and invariants on random
// inputs checked by an independent brute-force checker written here.
//
// Legend: W ranks, E experts, G gpus_per_node, node(r) = r / G, n_E demand, Q_E quotas,
// R replica slots.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <stdexcept>
#include <utility>
#include <string>
#include <vector>

#include "planner/plan.h"
#include "planner/route.h"

namespace {

using namespace lrmoe::planner;

// A deterministic generator independent of the standard library's distributions, so
// the fingerprint below cannot move with the toolchain.
struct Lcg {
  uint64_t s;
  explicit Lcg(uint64_t seed) : s(seed * 6364136223846793005ULL + 1442695040888963407ULL) {}
  uint32_t next() {
    s = s * 6364136223846793005ULL + 1442695040888963407ULL;
    return static_cast<uint32_t>(s >> 33);
  }
  int64_t below(int64_t n) { return static_cast<int64_t>(next() % static_cast<uint64_t>(n)); }
};

// Random skewed loads: W in {2, 4, 8}, E = W x {1, 2, 4}, each expert's popularity a
// power of a random base, rows per source up to 60.
PlanInput random_input(Lcg& g) {
  static const int32_t kW[] = {2, 4, 8};
  PlanInput in;
  in.num_ranks = kW[g.below(3)];
  in.num_experts = in.num_ranks * static_cast<int32_t>(1 << g.below(3));
  const int32_t W = in.num_ranks, E = in.num_experts;
  std::vector<int64_t> pop(static_cast<size_t>(E));
  for (auto& p : pop) p = 1 + g.below(4) * g.below(4) * g.below(4);
  in.load_WE.resize(static_cast<size_t>(W) * E);
  for (int32_t s = 0; s < W; ++s)
    for (int32_t e = 0; e < E; ++e) in.load_WE[static_cast<size_t>(s) * E + e] = g.below(1 + 4 * pop[e]);
  in.replica_slots = 1 + static_cast<int32_t>(g.below(2));
  in.recalibration_rate = g.below(2) ? 0.0 : 0.3;
  in.balance_slack = g.below(3) == 0 ? -1.0 : 0.0;
  MemoryModel& m = in.memory;
  m.expert_weight_bytes = 100;
  m.expert_grad_bytes = 200;
  m.expert_optimizer_bytes = 300;
  m.forward_row_bytes = 3;
  m.backward_row_bytes = 5;
  int64_t total = 0;
  for (int64_t v : in.load_WE) total += v;
  // from roomy to tight: mean rank rows x (1.0 ... 1.75) of row bytes plus the copies
  const int64_t mean = (total + W - 1) / W;
  m.resident_bytes = 1000;
  m.budget_bytes = m.resident_bytes + 600 * (E / W) + 300 * in.replica_slots +
                   (mean * 8 * (4 + g.below(4))) / 4;
  return in;
}

struct Fnv {
  uint64_t h = 1469598103934665603ULL;
  void add(int64_t v) {
    for (int k = 0; k < 8; ++k) {
      h ^= static_cast<uint64_t>(v >> (8 * k)) & 0xff;
      h *= 1099511628211ULL;
    }
  }
  template <class T> void add(const std::vector<T>& v) {
    add(static_cast<int64_t>(v.size()));
    for (const T& x : v) add(static_cast<int64_t>(x));
  }
};

void fingerprint(const Plan& p, Fnv* f) {
  f->add(p.instance_offsets);
  f->add(p.instance_rank);
  f->add(p.forward_IW);
  f->add(p.retained_IW);
  f->add(p.quota_E);
  f->add(p.forward_rows_W);
  f->add(p.backward_rows_W);
  f->add(static_cast<int64_t>(p.feasible));
  f->add(static_cast<int64_t>(p.binding));
  for (const MemoryBreakdown& b : p.memory_W) f->add(b.total());
}

// Every policy (and lrmoe's joint refinement) on 400 random inputs; gpus_per_node < 0
// leaves the field at its default (0).
uint64_t plans_fingerprint(int32_t gpus_per_node) {
  Lcg g(20261205);
  Fnv f;
  for (int k = 0; k < 400; ++k) {
    PlanInput in = random_input(g);
    in.gpus_per_node = gpus_per_node < 0 ? 0 : std::min(gpus_per_node, in.num_ranks);
    for (const char* policy : {"fixed", "ultraep", "symi", "lrmoe"}) fingerprint(make_plan(policy, in), &f);
    in.joint = true;
    in.replica_cost_rows = 2;
    fingerprint(make_plan("lrmoe", in), &f);
  }
  return f.h;
}

// plans_fingerprint(-1) printed by this file at 466b1c4, before gpus_per_node existed.
constexpr uint64_t kFlatFingerprint = 10369261057336162764ULL;

TEST(PlannerTopology, OneNodeReproducesTheFlatPlans) {
  EXPECT_EQ(plans_fingerprint(-1), kFlatFingerprint);  // default: one node
  EXPECT_EQ(plans_fingerprint(8), kFlatFingerprint);   // G = W (min(8, W) on every input)
  // and the fingerprint sees topology: two ranks per node changes some plan
  EXPECT_NE(plans_fingerprint(2), kFlatFingerprint);
}

TEST(PlannerTopology, RejectsBadGpusPerNode) {
  PlanInput in;
  in.num_ranks = 4;
  in.num_experts = 4;
  in.load_WE.assign(16, 1);
  for (int32_t bad : {-1, 5}) {
    in.gpus_per_node = bad;
    try {
      make_plan("lrmoe", in);
      FAIL() << "gpus_per_node=" << bad << " accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("gpus_per_node"), std::string::npos) << e.what();
    }
  }
}

// W = 4 ranks, one expert each, all rows from the owner's own source; bytes of 1 per
// row and copy against 1 GiB: memory never binds.
PlanInput four_ranks(const std::vector<int64_t>& n_E, int32_t gpus_per_node) {
  PlanInput in;
  in.num_ranks = 4;
  in.num_experts = 4;
  in.load_WE.assign(16, 0);
  for (int32_t e = 0; e < 4; ++e) in.load_WE[static_cast<size_t>(e) * 4 + e] = n_E[e];
  in.gpus_per_node = gpus_per_node;
  in.replica_slots = 1;
  in.memory.expert_weight_bytes = 1;
  in.memory.forward_row_bytes = 1;
  in.memory.backward_row_bytes = 1;
  in.memory.budget_bytes = int64_t(1) << 30;
  return in;
}

std::vector<std::pair<int32_t, int64_t>> instances(const Plan& p, int32_t e) {
  std::vector<std::pair<int32_t, int64_t>> out;
  for (int32_t i = p.instance_offsets[e]; i < p.instance_offsets[e + 1]; ++i) {
    int64_t f = 0;
    for (int32_t s = 0; s < p.num_ranks; ++s) f += p.forward_IW[static_cast<size_t>(i) * p.num_ranks + s];
    out.push_back({p.instance_rank[i], f});
  }
  return out;
}

using Inst = std::vector<std::pair<int32_t, int64_t>>;

// lrmoe, c = 0, row capacity 6, n = [10, 2, 6, 0]: rank 0 is 4 rows over. Flat, the
// replica goes to the rank with the most room, rank 3 (room 6 > rank 1's 4); with nodes
// {0, 1} and {2, 3} it goes to rank 1, the owner's node, which has room for all 4.
TEST(PlannerTopology, LRMoEReplicatesInsideTheNodeFirst) {
  PlanInput in = four_ranks({10, 2, 6, 0}, 0);
  in.backward_row_capacity = 6;
  const Plan flat = make_plan("lrmoe", in);
  ASSERT_TRUE(flat.feasible) << flat.reason;
  EXPECT_EQ(instances(flat, 0), (Inst{{0, 6}, {3, 4}}));
  in.gpus_per_node = 2;
  const Plan node = make_plan("lrmoe", in);
  ASSERT_TRUE(node.feasible) << node.reason;
  EXPECT_EQ(instances(node, 0), (Inst{{0, 6}, {1, 4}}));
  EXPECT_EQ(node.backward_rows_W, (std::vector<int64_t>{6, 6, 6, 0}));
  // joint refinement from here (ranks 0-2 at 12 row-times): the local search moves rows
  // of expert 0 to a new replica on rank 3, the only rank below 12 -- off the node,
  // whose other rank is at 12 too: the node is a preference, not a restriction
  in.joint = true;
  const Plan joint = make_plan("lrmoe", in);
  EXPECT_EQ(instances(joint, 0), (Inst{{0, 3}, {1, 3}, {3, 4}}));
}

// When the owner's node has no room the replica leaves it: capacity 6, n = [10, 6, 6, 0]
// with nodes {0, 1}, {2, 3}: rank 1 is full, so rank 3 takes the 4 rows.
TEST(PlannerTopology, LRMoELeavesTheNodeOnlyWhenItIsFull) {
  PlanInput in = four_ranks({10, 6, 6, 0}, 2);
  in.backward_row_capacity = 6;
  const Plan p = make_plan("lrmoe", in);
  ASSERT_TRUE(p.feasible) << p.reason;
  EXPECT_EQ(instances(p, 0), (Inst{{0, 6}, {3, 4}}));
}

// ultraep, R = 2, n = [10, 2, 6, 2] (mean 5): at tau = 5 rank 0 exports 5 rows and rank 2
// one. Flat: rank 0's expert goes to the most slack, rank 3 (slack 3 > rank 1's 3? equal:
// ties to the lower rank, rank 1) -- so use n = [10, 3, 6, 1]: slack rank 1 = 2, rank 3 =
// 4. Flat: e0 -> rank 3 (4 rows), then rank 1 (1 row); rank 2 -> rank 1 (1 row). With
// nodes {0, 1}, {2, 3}: e0 -> rank 1 (2 rows), then rank 3 (3 rows); rank 2 -> rank 3 (1).
TEST(PlannerTopology, UltraEPReplicatesInsideTheNodeFirst) {
  PlanInput in = four_ranks({10, 3, 6, 1}, 0);
  in.replica_slots = 2;
  const Plan flat = make_plan("ultraep", in);
  EXPECT_EQ(instances(flat, 0), (Inst{{0, 5}, {3, 4}, {1, 1}}));
  EXPECT_EQ(instances(flat, 2), (Inst{{2, 5}, {1, 1}}));
  in.gpus_per_node = 2;
  const Plan node = make_plan("ultraep", in);
  EXPECT_EQ(instances(node, 0), (Inst{{0, 5}, {1, 2}, {3, 3}}));
  EXPECT_EQ(instances(node, 2), (Inst{{2, 5}, {3, 1}}));
  EXPECT_EQ(node.max_forward_rows(), 5);
}

// The forward split: one expert, instances on rank 2 (first) and rank 0, 4 rows each,
// L = [1, 3, 1, 3]. Locality: rank 0's instance takes source 0's row, rank 2's source
// 2's. Flat (north-west corner), source 1's 3 rows go to the first instance (rank 2,
// the other node) and source 3's to rank 0: 6 rows cross nodes. With nodes {0, 1},
// {2, 3}: source 1 -> rank 0, source 3 -> rank 2, nothing crosses.
TEST(PlannerTopology, ForwardSplitPrefersTheSourcesNode) {
  const int64_t L[4] = {1, 3, 1, 3};
  const int32_t rank[2] = {2, 0};
  const int64_t quota[2] = {4, 4};
  int64_t F[8];
  split_forward(L, 4, rank, quota, 2, F, 0);
  EXPECT_EQ(std::vector<int64_t>(F, F + 8), (std::vector<int64_t>{0, 3, 1, 0, 1, 0, 0, 3}));
  split_forward(L, 4, rank, quota, 2, F, 2);
  EXPECT_EQ(std::vector<int64_t>(F, F + 8), (std::vector<int64_t>{0, 0, 1, 3, 1, 3, 0, 0}));
}

// ---- invariants on random inputs, checked independently of the planner ----

// Violations of the plan's invariants, recomputed from the input alone: instance
// ranks distinct per expert and in range (owners at e / (E / W) except symi), replicas
// per rank <= R (ultraep, lrmoe), every (source, expert) row computed exactly once,
// 0 <= retained <= forward per cell, retained of e = quota_E[e] <= n_e (= n_e for the
// baselines), the rows per rank, and, for a plan marked feasible, every rank's bytes
// recomputed from the memory model within budget - resident (and the row capacity).
// Topology: a source sends rows of e off its node only when every instance of e on its
// node computes rows from that node's sources alone (it was full before any remote row).
std::string violations(const PlanInput& in, const Plan& p, const std::string& policy) {
  const int32_t W = in.num_ranks, E = in.num_experts;
  const int32_t G = in.gpus_per_node > 0 ? in.gpus_per_node : W;
  const MemoryModel& m = in.memory;
  std::string v;
  auto bad = [&](const std::string& what) { if (v.size() < 400) v += what + "; "; };
  std::vector<int64_t> fwd(W, 0), bwd(W, 0), reps(W, 0);
  for (int32_t e = 0; e < E; ++e) {
    std::vector<int> seen(W, 0);
    int64_t n = 0, kept = 0;
    for (int32_t s = 0; s < W; ++s) n += in.load_WE[static_cast<size_t>(s) * E + e];
    std::vector<int64_t> col(W, 0);
    for (int32_t i = p.instance_offsets[e]; i < p.instance_offsets[e + 1]; ++i) {
      const int32_t r = p.instance_rank[i];
      if (r < 0 || r >= W) { bad("rank out of range"); continue; }
      if (seen[r]++) bad("two instances of expert " + std::to_string(e) + " on rank " + std::to_string(r));
      if (i == p.instance_offsets[e] && policy != "symi" && r != e / (E / W)) bad("owner not first");
      if (i > p.instance_offsets[e]) reps[r] += 1;
      for (int32_t s = 0; s < W; ++s) {
        const int64_t f = p.forward_IW[static_cast<size_t>(i) * W + s];
        const int64_t b = p.retained_IW[static_cast<size_t>(i) * W + s];
        if (f < 0 || b < 0 || b > f) bad("cell retained > forward or negative");
        col[s] += f;
        fwd[r] += f;
        bwd[r] += b;
        kept += b;
      }
    }
    for (int32_t s = 0; s < W; ++s)
      if (col[s] != in.load_WE[static_cast<size_t>(s) * E + e]) bad("rows of (source, expert) not conserved");
    if (kept != p.quota_E[e]) bad("retained != quota");
    if (p.quota_E[e] > n || (policy != "lrmoe" && p.quota_E[e] != n)) bad("quota out of range");
    // topology
    for (int32_t s = 0; s < W; ++s) {
      bool remote = false;
      for (int32_t i = p.instance_offsets[e]; i < p.instance_offsets[e + 1]; ++i)
        if (p.instance_rank[i] / G != s / G && p.forward_IW[static_cast<size_t>(i) * W + s] > 0) remote = true;
      if (!remote) continue;
      for (int32_t i = p.instance_offsets[e]; i < p.instance_offsets[e + 1]; ++i) {
        if (p.instance_rank[i] / G != s / G) continue;
        for (int32_t s2 = 0; s2 < W; ++s2)
          if (s2 / G != s / G && p.forward_IW[static_cast<size_t>(i) * W + s2] > 0)
            bad("source " + std::to_string(s) + " sent expert " + std::to_string(e) +
                " rows off its node while a same-node instance took remote rows");
      }
    }
  }
  if (fwd != p.forward_rows_W) bad("forward_rows_W");
  if (bwd != p.backward_rows_W) bad("backward_rows_W");
  if (policy == "ultraep" || policy == "lrmoe")
    for (int32_t r = 0; r < W; ++r)
      if (reps[r] > in.replica_slots) bad("replicas over the slots");
  if (p.feasible && policy != "symi") {
    const int64_t copy = m.expert_weight_bytes + m.expert_grad_bytes;
    const int64_t base = (copy + m.expert_optimizer_bytes) * (E / W);
    for (int32_t r = 0; r < W; ++r) {
      const int64_t slots = policy == "ultraep" ? in.replica_slots : reps[r];
      const int64_t bytes = base + slots * copy + fwd[r] * m.forward_row_bytes + bwd[r] * m.backward_row_bytes;
      if (bytes > m.budget_bytes - m.resident_bytes) bad("feasible plan over budget on rank " + std::to_string(r));
      if (in.backward_row_capacity > 0 && bwd[r] > in.backward_row_capacity) bad("row capacity");
    }
  }
  return v;
}

TEST(PlannerTopology, InvariantsOnRandomInputsWithNodes) {
  Lcg g(7);
  int checked = 0, feasible = 0, crossing_flat = 0, crossing_node = 0;
  for (int k = 0; k < 600; ++k) {
    PlanInput in = random_input(g);
    const int32_t W = in.num_ranks;
    in.gpus_per_node = W == 2 ? 1 : static_cast<int32_t>(1 << g.below(3)) % W;  // 1, 2, 4 < W
    if (in.gpus_per_node == 0) in.gpus_per_node = 1;
    if (k % 5 == 0) in.backward_row_capacity = 1 + g.below(60);
    for (const char* policy : {"fixed", "ultraep", "symi", "lrmoe", "joint"}) {
      PlanInput x = in;
      std::string name = policy;
      if (name == "joint") { x.joint = true; x.replica_cost_rows = g.below(3); name = "lrmoe"; }
      const Plan p = make_plan(name, x);
      const std::string v = violations(x, p, name);
      EXPECT_TRUE(v.empty()) << policy << " W=" << W << " G=" << x.gpus_per_node << " k=" << k << ": " << v;
      ++checked;
      feasible += p.feasible;
      // rows crossing nodes, against the same layout split flat
      if (name == "ultraep") {
        x.gpus_per_node = 0;
        const Plan f = make_plan(name, x);
        const int32_t G = in.gpus_per_node;
        for (const Plan* q : {&p, &f})
          for (int32_t i = 0; i < q->num_instances(); ++i)
            for (int32_t s = 0; s < W; ++s)
              if (q->instance_rank[i] / G != s / G)
                (q == &p ? crossing_node : crossing_flat) += q->forward_IW[static_cast<size_t>(i) * W + s];
      }
    }
  }
  EXPECT_EQ(checked, 3000);
  EXPECT_GT(feasible, 300);  // the generator reaches both sides of the budget
  EXPECT_LT(feasible, 3000);
  EXPECT_LE(crossing_node, crossing_flat);  // in total over the inputs (ultraep)
  std::printf("feasible %d of %d; ultraep rows across nodes: flat %d, node-aware %d\n", feasible,
              checked, crossing_flat, crossing_node);
}

}  // namespace
