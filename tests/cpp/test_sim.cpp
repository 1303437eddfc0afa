// GoogleTests for csrc/sim: hand-computed toy clusters with given costs.
//
// Every expected number is worked out in the comments from the model of
// docs/simulation.md ("Cost model", "Layer time"), not from the code under test.
//
// Legend: W ranks, E experts, L_WE loads, G GPUs per node. Times ms, bytes plain.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "planner/plan.h"
#include "sim/a2a.h"
#include "sim/cluster.h"
#include "sim/sim.h"

namespace {

using namespace lrmoe;
using sim::GemmPoint;

// 2 GPUs in one node, 2 experts (fixed ownership: e0 on rank 0, e1 on rank 1).
// GEMM: one point (1 expert, 10 rows): 1 ms forward, 2 ms backward, so k instances
// with r rows each take k * max(1, r / 10) ms (x 2 backward).
// Per pair: router 0.01, combine 0.02, router_grad 0.01, score 0.001, select 0.001 ms;
// per retained row: compact 0.005 (expert rank), scatter 0.002 (source rank).
// Link: 1 GB/s, 10 us; rows of H = 500 bf16 = 1000 bytes.
sim::SimConfig toy_config() {
  sim::SimConfig cfg;
  cfg.cost.gemm = {GemmPoint{1, 10, 1.0, 2.0}};
  cfg.cost.per_row.router = 0.01;
  cfg.cost.per_row.combine = 0.02;
  cfg.cost.per_row.router_grad = 0.01;
  cfg.cost.per_row.score = 0.001;
  cfg.cost.per_row.select = 0.001;
  cfg.cost.per_row.compact = 0.005;
  cfg.cost.per_row.scatter = 0.002;
  cfg.cost.h2d_GBps = 1.0;
  cfg.link.gpus_per_node = 8;
  cfg.link.intra_GBps = 1.0;
  cfg.link.intra_latency_us = 10.0;
  cfg.hidden = 500;
  cfg.elem_bytes = 2;
  cfg.per_rank_bytes = true;
  return cfg;
}

// L = [[30, 10], [20, 40]]: source 0 sends 30 rows to e0, 10 to e1; source 1 20 and 40.
// Memory: weight 100, grad 200, optimizer 400 per expert; rows 3 B forward, 5 B backward.
planner::PlanInput toy_input(int64_t limit = int64_t(1) << 40) {
  planner::PlanInput in;
  in.num_ranks = 2;
  in.num_experts = 2;
  in.load_WE = {30, 10, 20, 40};
  in.memory.expert_weight_bytes = 100;
  in.memory.expert_grad_bytes = 200;
  in.memory.expert_optimizer_bytes = 400;
  in.memory.forward_row_bytes = 3;
  in.memory.backward_row_bytes = 5;
  in.memory.budget_bytes = limit;
  in.memory.resident_bytes = 0;
  in.replica_slots = 0;
  return in;
}

TEST(Sim, ToyClusterTimesAndBytesExact) {
  const sim::LayerResult r = sim::simulate_layer("fixed", toy_input(), toy_config());
  ASSERT_TRUE(r.feasible);
  // dispatch: rank 0 sends 10 rows to rank 1 and receives 20: max(10, 20) x 1000 B at
  // 1 GB/s = 0.02 ms + 0.01 latency; rank 1 the mirror image
  EXPECT_DOUBLE_EQ(r.dispatch_ms, 0.03);
  // combine: the same rows back, 1004 B each (y row + fp32 phi_sq): 20 x 1004 B
  EXPECT_DOUBLE_EQ(r.combine_ms, 0.02008 + 0.01);
  // expert forward: 50 rows on each rank, one expert: 50 / 10 x 1 ms
  EXPECT_DOUBLE_EQ(r.expert_fwd_ms, 5.0);
  // sources: 40 and 60 pairs; router + permute 60 x 0.01, combine 60 x 0.02
  EXPECT_DOUBLE_EQ(r.src_fwd_ms, 0.6 + 1.2);
  EXPECT_DOUBLE_EQ(r.fwd_ms, 1.8 + 0.03 + 5.0 + 0.03008);
  // backward, c = 0: score/select/router_grad 60 x 0.012 + scatter 60 x 0.002;
  // gradient rows 1004 B (int32 position), dx rows 1000 B; expert 2 x 5 + 50 x 0.005
  EXPECT_DOUBLE_EQ(r.src_bwd_ms, 0.72 + 0.12);
  EXPECT_DOUBLE_EQ(r.grad_a2a_ms, 0.03008);
  EXPECT_DOUBLE_EQ(r.dx_a2a_ms, 0.03);
  EXPECT_DOUBLE_EQ(r.expert_bwd_ms, 10.25);
  EXPECT_DOUBLE_EQ(r.bwd_ms, 0.84 + 0.03008 + 10.25 + 0.03);
  // link bytes: forward 10 + 20 rows out x 1000 B, back 10 + 20 rows x 1004 B
  EXPECT_DOUBLE_EQ(r.fwd_link_bytes, 30 * 1000.0 + 30 * 1004.0);
  EXPECT_DOUBLE_EQ(r.bwd_link_bytes, 30 * 1004.0 + 30 * 1000.0);
  // bytes sent into each collective, self rows included (the EP layer's counts)
  const std::vector<int64_t> sent = {40000, 60000,   // forward_dispatch: P x 1000
                                     50200, 50200,   // forward_combine: 50 received x 1004
                                     40000, 60000,   // backward_grad: R x 1000
                                     160, 240,       // backward_index: R x 4
                                     50000, 50000};  // backward_dx: 50 received x 1000
  EXPECT_EQ(r.sent_bytes_5W, sent);
  EXPECT_EQ(r.replica_bytes, 0.0);
  EXPECT_EQ(r.pairs, 100);
  EXPECT_EQ(r.retained, 100);
  // memory per rank: 100 + 200 + 400 for the owned expert, 50 rows x 3 and x 5
  EXPECT_EQ(r.memory_peak, 700 + 150 + 250);
  EXPECT_EQ(r.memory_max.forward_tokens, 150);
  EXPECT_DOUBLE_EQ(r.fwd_imbalance, 1.0);
}

TEST(Sim, ExpertParallelWorkPerRowOnTheExpertRank) {
  // the toy cluster with the EP layer's own work: 0.01 ms per forward row and 0.02 per
  // retained row on the expert rank (50 rows on each): by hand 5 + 50 x 0.01 forward,
  // 10 + 50 x (0.005 + 0.02) backward; the sources and the all-to-alls unchanged
  sim::SimConfig cfg = toy_config();
  cfg.cost.per_row.ep_fwd = 0.01;
  cfg.cost.per_row.ep_bwd = 0.02;
  const sim::LayerResult r = sim::simulate_layer("fixed", toy_input(), cfg);
  ASSERT_TRUE(r.feasible);
  EXPECT_DOUBLE_EQ(r.expert_fwd_ms, 5.5);
  EXPECT_DOUBLE_EQ(r.expert_bwd_ms, 11.25);
  EXPECT_DOUBLE_EQ(r.fwd_ms, 1.8 + 0.03 + 5.5 + 0.03008);
  EXPECT_DOUBLE_EQ(r.src_bwd_ms, 0.84);
  // one rank is the one-device layer: no EP work charged (1 expert of 10 rows per 1 ms:
  // 40 + 60 rows of 2 experts -> the k = 2 curve at 50 rows each, as without the costs)
  planner::PlanInput one = toy_input();
  one.num_ranks = 1;
  one.load_WE = {40, 60};
  const sim::LayerResult a = sim::simulate_layer("fixed", one, cfg);
  const sim::LayerResult b = sim::simulate_layer("fixed", one, toy_config());
  ASSERT_TRUE(a.feasible);
  EXPECT_DOUBLE_EQ(a.expert_fwd_ms, b.expert_fwd_ms);
  EXPECT_DOUBLE_EQ(a.expert_bwd_ms, b.expert_bwd_ms);
  EXPECT_GT(a.expert_fwd_ms, 0.0);
}

TEST(Sim, AllToAllsPipelinedWithTheExpertGemms) {
  // the toy cluster over 2 chunks: each chunk carries half the rows (500 B dispatch
  // rows, 502 B combine / gradient rows) and pays the 10 us latency whole; each rank's
  // GEMM runs 25 rows a chunk (2.5 ms forward; backward 2 x 2.5 + 25 x 0.005 compact).
  // dispatch chunk: max(10, 20) rows x 500 B at 1 GB/s = 0.01 + 0.01 = 0.02 ms; combine
  // chunk 20 x 502 B = 0.01004 + 0.01; pipeline: out + compute + back + (n - 1) x
  // max(out + back, compute) = 0.02 + 2.5 + 0.02004 + 2.5
  sim::SimConfig cfg = toy_config();
  cfg.link.overlap_chunks = 2;
  const sim::LayerResult r = sim::simulate_layer("fixed", toy_input(), cfg);
  ASSERT_TRUE(r.feasible);
  EXPECT_NEAR(r.fwd_ms, 1.8 + 5.04004, 1e-12);
  EXPECT_NEAR(r.overlap_fwd_ms, (0.03 + 5.0 + 0.03008) - 5.04004, 1e-12);
  // backward: gradient chunk 0.02004, expert chunk 5.125, dx chunk 0.02
  EXPECT_NEAR(r.bwd_ms, 0.84 + 0.02004 + 5.125 + 0.02 + 5.125, 1e-12);
  EXPECT_NEAR(r.overlap_bwd_ms, (0.03008 + 10.25 + 0.03) - 10.29004, 1e-12);
  // the phase breakdown stays the unchunked one (what each phase would take alone)
  EXPECT_DOUBLE_EQ(r.dispatch_ms, 0.03);
  EXPECT_DOUBLE_EQ(r.expert_fwd_ms, 5.0);
  // one chunk: nothing pipelined, nothing saved
  cfg.link.overlap_chunks = 1;
  const sim::LayerResult one = sim::simulate_layer("fixed", toy_input(), cfg);
  EXPECT_DOUBLE_EQ(one.fwd_ms, 1.8 + 0.03 + 5.0 + 0.03008);
  EXPECT_EQ(one.overlap_fwd_ms, 0.0);
  // latency-bound links (10 ms a collective): two chunks pay it twice each way and the
  // overlap costs: chunks 10.01 out, 10.01004 back, 2.5 compute ->
  // 10.01 + 2.5 + 10.01004 + max(20.02004, 2.5) against 10.02 + 5 + 10.02008 in sequence
  cfg.link.intra_latency_us = 10000.0;
  cfg.link.overlap_chunks = 2;
  const sim::LayerResult slow = sim::simulate_layer("fixed", toy_input(), cfg);
  EXPECT_NEAR(slow.fwd_ms, 1.8 + 42.54008, 1e-9);
  EXPECT_NEAR(slow.overlap_fwd_ms, 25.04008 - 42.54008, 1e-9);
  cfg.link.overlap_chunks = 0;
  EXPECT_THROW(sim::simulate_layer("fixed", toy_input(), cfg), std::invalid_argument);
}

TEST(Sim, AllToAllsOverlappedTileByTile) {
  // the toy cluster (each rank: one instance of 50 rows, 5 ms forward GEMM, 10.25 ms
  // backward with the compact; the all-to-alls 0.03 + 0.03008 ms each way, latencies in)
  // at 16-row tiles: ceil(50 / 16) = 4 tiles a rank. All SMs to the GEMMs: forward
  // max(0.06008, 5) + 0.06008 / 4, backward max(0.06008, 10.25) + 0.06008 / 4
  sim::SimConfig cfg = toy_config();
  cfg.link.overlap_tile_rows = 16;
  const sim::LayerResult r = sim::simulate_layer("fixed", toy_input(), cfg);
  ASSERT_TRUE(r.feasible);
  EXPECT_NEAR(r.fwd_ms, 1.8 + 5.0 + 0.01502, 1e-12);
  EXPECT_NEAR(r.overlap_fwd_ms, 0.06008 - 0.01502, 1e-12);
  EXPECT_NEAR(r.bwd_ms, 0.84 + 10.25 + 0.01502, 1e-12);
  EXPECT_NEAR(r.overlap_bwd_ms, 0.06008 - 0.01502, 1e-12);
  EXPECT_DOUBLE_EQ(r.expert_fwd_ms, 5.0);  // the breakdown stays the phases alone
  // a fifth of the SMs to communication: the GEMMs 1.25x longer, more than the
  // all-to-alls hide: 6.25 + 0.06008 / 4 against 5.06008 in sequence
  cfg.link.overlap_comm_share = 0.2;
  const sim::LayerResult s = sim::simulate_layer("fixed", toy_input(), cfg);
  EXPECT_NEAR(s.fwd_ms, 1.8 + 6.25 + 0.01502, 1e-12);
  EXPECT_NEAR(s.overlap_fwd_ms, 5.06008 - 6.26502, 1e-12);
  // latency-bound links (10 ms a collective): the latencies are paid once, the GEMMs'
  // 5 ms hide behind them but their first and last tiles: 20.04008 + 5 / 4 (share 0)
  cfg.link.overlap_comm_share = 0.0;
  cfg.link.intra_latency_us = 10000.0;
  const sim::LayerResult slow = sim::simulate_layer("fixed", toy_input(), cfg);
  EXPECT_NEAR(slow.fwd_ms, 1.8 + 20.04008 + 1.25, 1e-9);
  EXPECT_NEAR(slow.overlap_fwd_ms, 25.04008 - 21.29008, 1e-9);
  // one tile a rank (tiles as large as the rows): nothing hidden, the phases in sequence
  cfg.link.intra_latency_us = toy_config().link.intra_latency_us;
  cfg.link.overlap_tile_rows = 50;
  EXPECT_NEAR(sim::simulate_layer("fixed", toy_input(), cfg).fwd_ms, 1.8 + 5.06008, 1e-12);
  // bad values, and the two overlap models at once, are refused
  cfg.link.overlap_tile_rows = -1;
  EXPECT_THROW(sim::simulate_layer("fixed", toy_input(), cfg), std::invalid_argument);
  cfg.link.overlap_tile_rows = 16;
  cfg.link.overlap_comm_share = 1.0;
  EXPECT_THROW(sim::simulate_layer("fixed", toy_input(), cfg), std::invalid_argument);
  cfg.link.overlap_comm_share = 0.0;
  cfg.link.overlap_chunks = 2;
  EXPECT_THROW(sim::simulate_layer("fixed", toy_input(), cfg), std::invalid_argument);
}

TEST(Sim, SelfRowsAreADeviceCopy) {
  // at 0.5 GB/s of self copy, rank 1's 40 own rows (40000 B) take 0.08 ms, longer than
  // its links (0.03 ms); at EP size 1 the copy is all there is: 100 rows, 0.2 ms
  sim::SimConfig cfg = toy_config();
  cfg.link.self_GBps = 0.5;
  EXPECT_DOUBLE_EQ(sim::simulate_layer("fixed", toy_input(), cfg).dispatch_ms, 0.08);
  planner::PlanInput one = toy_input();
  one.num_ranks = 1;
  one.load_WE = {50, 50};
  const sim::LayerResult r = sim::simulate_layer("fixed", one, cfg);
  EXPECT_DOUBLE_EQ(r.dispatch_ms, 0.2);
  EXPECT_DOUBLE_EQ(r.combine_ms, 100 * 1004.0 / 0.5e6);
  EXPECT_DOUBLE_EQ(r.fwd_link_bytes, 0.0);
}

TEST(Sim, RecalibrationShrinksBackwardOnly) {
  // lrmoe with no replica slots is fixed ownership plus quotas: c = 0.5 keeps
  // floor(0.5 x 50) = 25 rows of each expert, split over sources 30:20 -> 15, 10 and
  // 10:40 -> 5, 20 (largest remainder)
  planner::PlanInput in = toy_input();
  in.recalibration_rate = 0.5;
  const sim::LayerResult r = sim::simulate_layer("lrmoe", in, toy_config());
  ASSERT_TRUE(r.feasible);
  EXPECT_EQ(r.retained, 50);
  EXPECT_DOUBLE_EQ(r.expert_fwd_ms, 5.0);
  // 25 rows per rank: 2 x 2.5 ms + 25 x 0.005
  EXPECT_DOUBLE_EQ(r.expert_bwd_ms, 5.0 + 0.125);
  // rank 0 keeps 15 + 5 = 20 source rows, rank 1 10 + 20 = 30: scatter 30 x 0.002
  EXPECT_DOUBLE_EQ(r.src_bwd_ms, 0.72 + 0.06);
  // gradient rows: rank 0 sends 5 to rank 1, receives 10: 10 x 1004 B
  EXPECT_DOUBLE_EQ(r.grad_a2a_ms, 0.01004 + 0.01);
  const std::vector<int64_t> grad = {20000, 30000};
  EXPECT_EQ(std::vector<int64_t>(r.sent_bytes_5W.begin() + 4, r.sent_bytes_5W.begin() + 6), grad);
}

TEST(Sim, InfeasiblePlanIsReportedNotTimed) {
  // limit 1000 bytes < 1100 the fixed plan needs on each rank
  const sim::LayerResult r = sim::simulate_layer("fixed", toy_input(1000), toy_config());
  EXPECT_FALSE(r.feasible);
  EXPECT_EQ(r.binding, planner::Binding::kMemory);
  EXPECT_FALSE(r.reason.empty());
  EXPECT_TRUE(std::isnan(r.fwd_ms));
  EXPECT_TRUE(std::isnan(r.bwd_ms));
  EXPECT_TRUE(std::isnan(r.expert_bwd_ms));
  EXPECT_EQ(r.memory_peak, 1100);  // the memory it would need is still reported
}

TEST(Sim, BatchPressureTakesMoreMicroBatches) {
  // limit 1500: 700 of expert bytes + rows x 8 B, so at most 100 rows per rank;
  // the toy has 50 rows per rank at 1x
  const planner::PlanInput in = toy_input(1500);
  const sim::SimConfig cfg = toy_config();
  sim::PressureResult p1 = sim::simulate_pressure("fixed", in, 2.0, 8, cfg);
  EXPECT_EQ(p1.micro_batches, 1);  // 100 rows: fits
  // 4x: 200 rows per rank; two micro-batches of 2x fit
  sim::PressureResult p4 = sim::simulate_pressure("fixed", in, 4.0, 8, cfg);
  EXPECT_EQ(p4.micro_batches, 2);
  EXPECT_DOUBLE_EQ(p4.time_ms, 2 * (p1.layer.fwd_ms + p1.layer.bwd_ms));
  // 5x: two micro-batches of ceil(2.5 L) = [75, 25, 50, 100] put 125 rows on a rank;
  // three of ceil(5 L / 3) = [50, 17, 34, 67] put 84 and 84
  EXPECT_EQ(sim::simulate_pressure("fixed", in, 5.0, 8, cfg).micro_batches, 3);
  sim::PressureResult none = sim::simulate_pressure("fixed", in, 5.0, 2, cfg);
  EXPECT_EQ(none.micro_batches, 0);
  EXPECT_TRUE(std::isnan(none.time_ms));
}

TEST(Sim, GemmInterpolation) {
  // curves: 1 expert (10 rows 1 ms, 20 rows 3 ms), 4 experts (10 rows 2 ms, 20 rows 6 ms)
  const std::vector<GemmPoint> g = {{1, 10, 1, 0}, {1, 20, 3, 0}, {4, 10, 2, 0}, {4, 20, 6, 0}};
  // 2 experts, 15 rows each: 2 on the 1-expert curve, 4 on the 4-expert one, 1/3 of the way
  EXPECT_NEAR(sim::gemm_ms(g, 2, 30, false), 2.0 + 2.0 / 3.0, 1e-12);
  // 8 experts, 25 rows each: 4-expert curve extrapolated 6 + 0.4 x 5 = 8, times 8 / 4
  EXPECT_DOUBLE_EQ(sim::gemm_ms(g, 8, 200, false), 16.0);
  // below the first row count: the launch-bound first point
  EXPECT_DOUBLE_EQ(sim::gemm_ms(g, 1, 5, false), 1.0);
  EXPECT_DOUBLE_EQ(sim::gemm_ms(g, 0, 0, false), 0.0);
  EXPECT_THROW(sim::gemm_ms({}, 1, 1, false), std::invalid_argument);
}

TEST(Sim, GemmOfUnevenInstances) {
  // the curves of GemmInterpolation. Two instances with 5 and 25 rows on the 1-expert
  // and 4-expert curves: 1-expert curve at 5 rows = 1 (flat below the first point), at
  // 25 rows = 3 + 0.2 x 5 = 4, mean 2.5; 4-expert curve: 2 and 6 + 0.4 x 5 = 8, mean 5;
  // k = 2 is a third of the way from 1 to 4: 2.5 + (5 - 2.5) / 3
  const std::vector<GemmPoint> g = {{1, 10, 1, 0}, {1, 20, 3, 0}, {4, 10, 2, 0}, {4, 20, 6, 0}};
  const sim::GemmTable t(g);
  EXPECT_NEAR(t.ms_instances({5, 25}, false), 2.5 + 2.5 / 3.0, 1e-12);
  // even rows: the same as the rows' total (GemmInterpolation's 2 + 2/3)
  EXPECT_NEAR(t.ms_instances({15, 15}, false), t.ms(2, 30, false), 1e-12);
  // an instance with no rows runs nothing: {0, 15} is one expert with 15 rows = 2 ms
  EXPECT_DOUBLE_EQ(t.ms_instances({0, 15}, false), 2.0);
  EXPECT_DOUBLE_EQ(t.ms_instances({}, false), 0.0);
  // a layer of one rank with those two experts: its expert forward is that time
  planner::PlanInput in = toy_input();
  in.num_ranks = 1;
  in.load_WE = {5, 25};
  sim::SimConfig cfg = toy_config();
  cfg.cost.gemm = g;
  const sim::LayerResult r = sim::simulate_layer("fixed", in, cfg);
  EXPECT_NEAR(r.expert_fwd_ms, 2.5 + 2.5 / 3.0, 1e-12);
}

TEST(Sim, AllToAllAcrossNodes) {
  // W 4 in nodes of 2; rank 0 sends 100 rows to rank 1 (NVLink 2 GB/s, 1 us) and 50
  // to rank 2 (network 1 GB/s, 5 us), 1000 B rows. Hierarchical (a2a.h): the network
  // phase 50 x 1000 B / 1e6 B/ms + 0.005 = 0.055 (rank 0 sends, rank 2, the proxy of
  // local index 0, receives), then the NVLink phase 100 x 1000 / 2e6 + 0.001 = 0.051:
  // in sequence 0.106; over 2 chunks 0.055 + 0.051 / 2.
  sim::LinkModel link;
  link.gpus_per_node = 2;
  link.intra_GBps = 2.0;
  link.intra_latency_us = 1.0;
  link.inter_GBps = 1.0;
  link.inter_latency_us = 5.0;
  std::vector<int64_t> M(16, 0);
  M[0 * 4 + 1] = 100;
  M[0 * 4 + 2] = 50;
  M[3 * 4 + 3] = 1000;  // to itself: no link
  double bytes = 0;
  EXPECT_NEAR(sim::all_to_all_ms(M, 4, 1000.0, link, &bytes), 0.106, 1e-15);
  EXPECT_DOUBLE_EQ(bytes, 150000.0);
  link.chunks = 2;
  EXPECT_NEAR(sim::all_to_all_ms(M, 4, 1000.0, link), 0.055 + 0.0255, 1e-15);
  // 3 us per peer: rank 0 has one peer per phase, 0.106 + 2 x 0.003
  link.chunks = 1;
  link.per_peer_us = 3.0;
  EXPECT_NEAR(sim::all_to_all_ms(M, 4, 1000.0, link), 0.112, 1e-15);
}

TEST(Sim, PlanAcrossNodesTimesItsRowMatrix) {
  // W 4 in nodes of 2, E 4 (expert e on rank e): the dispatch is the all-to-all of the
  // row matrix M[s][e] = L[s][e], the combine its transpose with 4 more bytes a row
  planner::PlanInput in = toy_input();
  in.num_ranks = 4;
  in.num_experts = 4;
  in.load_WE = {5, 10, 20, 40, 1, 2, 3, 4, 7, 0, 9, 30, 11, 13, 0, 2};
  sim::SimConfig cfg = toy_config();
  cfg.link.gpus_per_node = 2;
  cfg.link.inter_GBps = 0.25;
  cfg.link.inter_latency_us = 40.0;
  std::vector<int64_t> T(16);
  for (int s = 0; s < 4; ++s)
    for (int d = 0; d < 4; ++d) T[d * 4 + s] = in.load_WE[s * 4 + d];
  const sim::LayerResult r = sim::simulate_layer("fixed", in, cfg);
  ASSERT_TRUE(r.feasible);
  double bytes = 0;
  EXPECT_DOUBLE_EQ(r.dispatch_ms, sim::all_to_all_ms(in.load_WE, 4, 1000.0, cfg.link, &bytes));
  EXPECT_DOUBLE_EQ(r.grad_a2a_ms, sim::all_to_all_ms(in.load_WE, 4, 1004.0, cfg.link));
  // combine and dx are the dispatch's rows reversed (the proxy reduces a node's rows into
  // one network row), not an all-to-all of the transpose T, which would route through
  // the expert ranks' proxies: by hand below, with the same max(sent, received) per rank,
  // the dispatch's times at their row sizes
  EXPECT_GT(std::fabs(r.combine_ms - sim::all_to_all_ms(T, 4, 1004.0, cfg.link)), 1e-6);
  // combine: network 60 x 1004 B / 0.25e6 + 0.04, NVLink 70 x 1004 / 1e6 + 0.01
  EXPECT_NEAR(r.combine_ms, 0.24096 + 0.04 + 0.07028 + 0.01, 1e-12);
  EXPECT_NEAR(r.grad_a2a_ms, r.combine_ms, 1e-12);
  EXPECT_NEAR(r.dx_a2a_ms, 0.36, 1e-12);
  // by hand, hierarchical (a2a.h; nodes {0, 1}, {2, 3}; the proxy on a remote node has
  // the source's local index). Network rows: s0 -> 2 (for ranks 2, 3): 20 + 40 = 60;
  // s1 -> 3: 3 + 4 = 7; s2 -> 0: 7 + 0 = 7; s3 -> 1: 11 + 13 = 24. Per rank max(out, in):
  // rank 0 max(60, 7), rank 2 max(7, 60): 60 x 1000 B at 0.25 GB/s = 0.24 + 0.04 = 0.28.
  // NVLink rows: own same-node 0 -> 1: 10, 1 -> 0: 1, 2 -> 3: 30, 3 -> 2: 0; forwarded by
  // the proxies 2 -> 3: 40, 3 -> 2: 3, 1 -> 0: 11. Rank 2 sends 30 + 40 = 70, rank 3
  // receives 70: 70 x 1000 B at 1 GB/s + 0.01 = 0.08. In sequence: 0.36
  EXPECT_NEAR(r.dispatch_ms, 0.36, 1e-12);
  // link rows: 60 + 7 + 7 + 24 = 98 network, 10 + 1 + 30 + 40 + 3 + 11 = 95 NVLink:
  // 193 x 1000 B out, the same 193 rows x 1004 back
  EXPECT_DOUBLE_EQ(bytes, 193000.0);
  EXPECT_DOUBLE_EQ(r.fwd_link_bytes, 193000.0 + 193 * 1004.0);
  // pipelined over 4 chunks: 0.28 + 0.08 / 4
  cfg.link.chunks = 4;
  EXPECT_NEAR(sim::simulate_layer("fixed", in, cfg).dispatch_ms, 0.30, 1e-12);
}

TEST(Sim, ReplicaTrafficPerLayerButNotForSymi) {
  // a hot expert on 2 ranks: every replica streams its weights twice and its gradient
  // back (2 x 100 + 200 bytes) under ultraep; symi places copies with the weight update
  planner::PlanInput in = toy_input();
  in.load_WE = {90, 0, 90, 0};
  in.replica_slots = 1;
  const sim::SimConfig cfg = toy_config();
  const planner::Plan up = planner::make_plan("ultraep", in);
  const sim::LayerResult u = sim::simulate_plan(up, in, cfg);
  ASSERT_GT(up.replicas, 0);
  EXPECT_DOUBLE_EQ(u.replica_bytes, up.replicas * 400.0);
  const sim::LayerResult s = sim::simulate_layer("symi", in, cfg);
  EXPECT_EQ(s.replica_bytes, 0.0);
  EXPECT_EQ(u.broadcast_ms, 0.0);  // ultraep's copies stream in the layer instead
}

TEST(Sim, SymiBroadcastsItsCopiesOncePerStep) {
  // symi with ceil(E / W) + 1 = 2 slots per rank on 2 ranks and 2 experts: both experts
  // on both ranks, each first placed on rank 0 (asserted below), so rank 0 sends each
  // copy's 100 weight bytes to rank 1 after the optimizer step: 200 B to one NVLink peer
  // at 1 GB/s (1e6 B/ms) plus the 10 us latency = 0.0002 + 0.01 ms. The optimizer state
  // is sharded (symi.cpp): each rank steps ceil(2 / 2) = 1 expert, though rank 0 holds
  // both first copies.
  planner::PlanInput in = toy_input();
  in.load_WE = {90, 0, 90, 0};
  in.replica_slots = 1;
  in.previous_load_E = {180, 0};
  const sim::SimConfig cfg = toy_config();
  const planner::Plan p = planner::make_plan("symi", in);
  ASSERT_EQ(p.replicas, 2);
  ASSERT_EQ(p.instance_offsets, (std::vector<int32_t>{0, 2, 4}));
  ASSERT_EQ(p.instance_rank, (std::vector<int32_t>{0, 1, 0, 1}));
  const sim::LayerResult s = sim::simulate_plan(p, in, cfg);
  EXPECT_NEAR(s.broadcast_ms, 0.0102, 1e-12);
  EXPECT_EQ(s.owned_experts_max, 1);
  EXPECT_EQ(s.replica_ms, 0.0);  // not in the layer: once per step (step.h)
  // fixed ownership: no copies, one expert per rank
  const sim::LayerResult f = sim::simulate_layer("fixed", in, cfg);
  EXPECT_EQ(f.broadcast_ms, 0.0);
  EXPECT_EQ(f.owned_experts_max, 1);
}

TEST(Sim, TraceEqualsLayerByLayer) {
  // 2 steps x 2 layers, two threads; symi's layers at step 1 plan from step 0's loads
  const planner::PlanInput base = toy_input();
  const std::vector<int64_t> loads = {30, 10, 20, 40, 5, 5, 5, 5,
                                      1, 2, 3, 4, 50, 0, 0, 50};
  const sim::SimConfig cfg = toy_config();
  for (const char* pol : {"fixed", "symi"}) {
    const auto out = sim::simulate_trace(pol, base, loads, 2, 2, cfg, 2);
    ASSERT_EQ(out.size(), 4u);
    for (int j = 0; j < 4; ++j) {
      planner::PlanInput in = base;
      in.load_WE.assign(loads.begin() + 4 * j, loads.begin() + 4 * j + 4);
      if (std::string(pol) == "symi" && j >= 2)
        in.previous_load_E = {loads[4 * (j - 2)] + loads[4 * (j - 2) + 2],
                              loads[4 * (j - 2) + 1] + loads[4 * (j - 2) + 3]};
      const sim::LayerResult ref = sim::simulate_layer(pol, in, cfg);
      EXPECT_DOUBLE_EQ(out[j].fwd_ms, ref.fwd_ms) << pol << " " << j;
      EXPECT_DOUBLE_EQ(out[j].bwd_ms, ref.bwd_ms) << pol << " " << j;
      EXPECT_EQ(out[j].memory_peak, ref.memory_peak);
    }
  }
  EXPECT_THROW(sim::simulate_trace("fixed", base, loads, 3, 2, cfg, 1), std::invalid_argument);
}

TEST(Sim, OffloadChargesOnlyWhatComputeCannotHide) {
  // 50 saved rows of 100000 B per rank at 1 GB/s: 5 ms out during a 5 ms expert
  // forward (hidden), the same back during an 11.15008 ms backward (hidden)
  sim::SimConfig cfg = toy_config();
  cfg.offload = true;
  cfg.offload_row_bytes = 100000;
  const sim::LayerResult r = sim::simulate_layer("fixed", toy_input(), cfg);
  EXPECT_DOUBLE_EQ(r.offload_ms, 0.0);
  EXPECT_DOUBLE_EQ(r.offload_bytes, 2 * (50 + 50) * 100000.0);
  // at 0.5 GB/s: 10 ms each way, 5 ms of the forward's exposed
  cfg.cost.h2d_GBps = 0.5;
  EXPECT_DOUBLE_EQ(sim::simulate_layer("fixed", toy_input(), cfg).offload_ms, 5.0);
}

}  // namespace

// The roofline of one Qwen3-30B-A3B expert (H 2048, I 768) on the H200 constants of
// docs/simulation.md ("Cost model"): 989 TFLOP/s, 4,800 GB/s, 10 us per pass.
sim::Roofline qwen3_h200() {
  sim::Roofline r;
  r.peak_TFLOPs = 989;
  r.hbm_GBps = 4800;
  r.launch_us = 10;
  r.hidden = 2048;
  r.inter = 768;
  r.elem_bytes = 2;
  return r;
}

// By hand: 6 H I = 9,437,184 FLOP per row forward, 12 H I backward; 1 TFLOP/s is 1e9
// FLOP per ms, 1 GB/s 1e6 bytes per ms.
double hand_floor_ms(double rows, bool backward) {
  if (rows <= 0) return 0.0;
  const double HI = 2048.0 * 768.0, H = 2048.0;
  const double fl = (backward ? 12.0 : 6.0) * HI * rows / 989e9;
  const double by = (backward ? 2 * 3 * HI * 2 + 3 * H * 2 * rows : 3 * HI * 2 + 2 * H * 2 * rows)
                    / 4800e6;
  return std::max(fl, by);
}

TEST(Roofline, HandComputedFloor) {
  const sim::Roofline r = qwen3_h200();
  // 262,144 rows forward: 2.474e12 FLOP / 989e9 = 2.5014 ms; bytes 9.4 MB of weights +
  // 262,144 x 8,192 B = 2.157e9 B / 4.8e9 = 0.449 ms: FLOP-bound
  EXPECT_NEAR(r.expert_ms(262144, false), 9437184.0 * 262144 / 989e9, 1e-12);
  EXPECT_NEAR(r.expert_ms(262144, false), 2.5014, 1e-4);
  // 16 rows: 1.5e8 FLOP = 0.000153 ms against 9.70e6 B = 0.00202 ms: bandwidth-bound
  EXPECT_NEAR(r.expert_ms(16, false), (3 * 2048.0 * 768 * 2 + 16 * 8192.0) / 4800e6, 1e-15);
  EXPECT_NEAR(r.expert_ms(16, true), (2 * 3 * 2048.0 * 768 * 2 + 16 * 12288.0) / 4800e6, 1e-15);
  // a rank: the instances' floors plus one launch; nothing when no instance has rows
  EXPECT_NEAR(r.rank_ms({100, 0, 5000}, true),
              hand_floor_ms(100, true) + hand_floor_ms(5000, true) + 0.01, 1e-15);
  EXPECT_DOUBLE_EQ(r.rank_ms({0, 0}, false), 0.0);
  EXPECT_FALSE(sim::Roofline().enabled());
  sim::Roofline bad = r;
  bad.hbm_GBps = 0;
  EXPECT_THROW(bad.enabled(), std::invalid_argument);
  bad = r;
  bad.inter = 0;
  EXPECT_THROW(sim::GemmTable({GemmPoint{1, 10, 1, 1}}, bad), std::invalid_argument);
}

// The Qwen3 1- and 4-expert curves of configs/costs/h200.json (GEMMs plus each point's
// time outside the named phases, as lrmoe/sim/costs.py reads them): the 1-expert curve
// falls from 4,096 to 8,192 rows (launch-bound noise), the slope a clamp made 0.
const std::vector<GemmPoint> kQwen3Grid = {
    {1, 16, 1.3252, 1.4156},   {1, 64, 1.5183, 1.5318},   {1, 256, 1.3966, 1.6372},
    {1, 1024, 1.3541, 1.7748}, {1, 2048, 1.2265, 1.3748}, {1, 4096, 1.3180, 1.5279},
    {1, 8192, 1.3043, 2.0748}, {4, 16, 1.3340, 2.4152},   {4, 64, 1.3721, 2.2469},
    {4, 256, 1.6767, 2.0838},  {4, 1024, 1.9583, 1.7656}, {4, 2048, 2.0276, 2.2492},
    {4, 4096, 1.8690, 2.3627}, {4, 8192, 2.1302, 1.8558}};

TEST(Roofline, BeyondTheGridAtTheMarginalEfficiency) {
  const sim::GemmTable t(kQwen3Grid, qwen3_h200());
  // forward: the 1-expert curve's last segment falls, so the grid's efficiency is the
  // 4-expert one's: 4 x (floor(8192) - floor(4096)) over 2.1302 - 1.8690 ms
  const double eta = 4 * (hand_floor_ms(8192, false) - hand_floor_ms(4096, false)) / (2.1302 - 1.8690);
  EXPECT_NEAR(eta, 0.5985, 1e-3);
  const double want = 1.3043 + (hand_floor_ms(262144, false) - hand_floor_ms(8192, false)) / eta;
  EXPECT_NEAR(t.ms(1, 262144, false), want, 1e-9);
  EXPECT_NEAR(want, 5.353, 1e-3);  // the clamped slope said 1.3043
  EXPECT_GE(t.ms(1, 262144, false), hand_floor_ms(262144, false) + 0.01);
  // backward: the 4-expert curve falls too, the 1-expert one rises by 0.5469 ms
  const double eta_b = std::min(1.0, (hand_floor_ms(8192, true) - hand_floor_ms(4096, true)) / (2.0748 - 1.5279));
  EXPECT_NEAR(t.ms(1, 65536, true),
              2.0748 + (hand_floor_ms(65536, true) - hand_floor_ms(8192, true)) / eta_b, 1e-9);
  // inside the grid: the measured points, interpolated (all above the floor)
  EXPECT_NEAR(t.ms(1, 3072, false), 1.2265 + (1.3180 - 1.2265) * 0.5, 1e-12);
}

// A k-expert curve is the time of k experts, so beyond the grid it grows by k experts'
// roofline time (the marginal efficiency is measured on k x one expert's roofline too).
// Until 2026-12-07 it grew by one expert's: the 4-expert curve below came out at about a
// quarter of its extra time, and `lrmoe sim --validate` (one GPU, 128 instances, hot
// experts past 8,192 rows) 16-25 % short.
TEST(Roofline, BeyondTheGridAKExpertCurveAddsKExperts) {
  const sim::GemmTable t(kQwen3Grid, qwen3_h200());
  const double eta = 4 * (hand_floor_ms(8192, false) - hand_floor_ms(4096, false)) / (2.1302 - 1.8690);
  // 4 experts of 65,536 rows each: the 4-expert curve's last point plus 4 experts' extra
  const double want = 2.1302 + 4 * (hand_floor_ms(65536, false) - hand_floor_ms(8192, false)) / eta;
  EXPECT_NEAR(t.ms(4, 4 * 65536.0, false), want, 1e-9);
  EXPECT_GT(want, 4 * hand_floor_ms(65536, false) + 0.01);  // above the floor: not the floor's
  // per instance: one of the 4 instances at 65,536 rows, three at 8,192 (the last point)
  const double inst = (want + 3 * 2.1302) / 4;
  EXPECT_NEAR(t.ms_instances({65536.0, 8192.0, 8192.0, 8192.0}, false), inst, 1e-9);
}

// Zipf-1 loads of `pairs` routed pairs per source over E experts (hot experts at ids
// drawn by a fixed LCG), +-20 % per source.
std::vector<int64_t> zipf_loads(int32_t W, int32_t E, int64_t pairs, uint64_t seed) {
  std::vector<int32_t> perm(static_cast<size_t>(E));
  for (int32_t e = 0; e < E; ++e) perm[static_cast<size_t>(e)] = e;
  uint64_t x = seed;
  auto next = [&]() { x = x * 6364136223846793005ULL + 1442695040888963407ULL; return x >> 33; };
  for (int32_t e = E - 1; e > 0; --e) std::swap(perm[static_cast<size_t>(e)], perm[next() % (e + 1)]);
  double h = 0;
  for (int32_t e = 0; e < E; ++e) h += 1.0 / (e + 1);
  std::vector<int64_t> L(static_cast<size_t>(W) * E);
  for (int32_t s = 0; s < W; ++s)
    for (int32_t e = 0; e < E; ++e) {
      const double noise = 0.8 + 0.4 * static_cast<double>(next() % 1000) / 1000.0;
      L[static_cast<size_t>(s) * E + perm[static_cast<size_t>(e)]] =
          static_cast<int64_t>(pairs * noise / ((e + 1) * h));
    }
  return L;
}

TEST(Roofline, NoLayerAtEp64To128BelowTheFloor) {
  // Qwen3 at EP64 and EP128, 262,144 pairs per source (4 x 8,192 tokens x top-8), the
  // calibrated grid: each rank's expert GEMMs (from the plan's own rows per instance,
  // summed here) at least their roofline, computed by hand_floor_ms above
  sim::SimConfig cfg;
  cfg.cost.gemm = kQwen3Grid;
  cfg.cost.roofline = qwen3_h200();
  cfg.link = {8, 370, 10, 50, 20, 2100};
  cfg.link.per_peer_us = 1;  // the all-to-all of a2a.h, deduplicated over top-8
  cfg.link.chunks = 4;
  cfg.top_k = 8;
  cfg.hidden = 2048;
  const int64_t H = 2048, I = 768, GiB = int64_t(1) << 30;
  int timed = 0;
  for (int32_t W : {64, 128}) {
    planner::PlanInput in;
    in.num_ranks = W;
    in.num_experts = 128;
    in.memory = {3 * H * I * 2, 3 * H * I * 4, 3 * H * I * 12, false,
                 2 * H + 4 * I + 2 * H, 6 * H + 12 * I, 80 * GiB, 64 * GiB};
    in.load_WE = zipf_loads(W, 128, 262144, 7 + W);
    for (const char* policy : {"fixed", "ultraep", "symi", "lrmoe"}) {
      in.recalibration_rate = std::string(policy) == "lrmoe" ? 0.3 : 0.0;
      const planner::Plan plan = planner::make_plan(policy, in);
      const sim::LayerResult r = sim::simulate_plan(plan, in, cfg);
      if (!r.feasible) continue;
      ++timed;
      double floor_f = 0, floor_b = 0;
      std::vector<std::vector<double>> f_W(static_cast<size_t>(W)), b_W(static_cast<size_t>(W));
      for (int32_t i = 0; i < static_cast<int32_t>(plan.instance_rank.size()); ++i) {
        double f = 0, b = 0;
        for (int32_t s = 0; s < W; ++s) {
          f += static_cast<double>(plan.forward_IW[static_cast<size_t>(i) * W + s]);
          b += static_cast<double>(plan.retained_IW[static_cast<size_t>(i) * W + s]);
        }
        f_W[static_cast<size_t>(plan.instance_rank[static_cast<size_t>(i)])].push_back(f);
        b_W[static_cast<size_t>(plan.instance_rank[static_cast<size_t>(i)])].push_back(b);
      }
      for (int32_t w = 0; w < W; ++w) {
        double ff = 0, bb = 0;
        for (double v : f_W[static_cast<size_t>(w)]) ff += hand_floor_ms(v, false);
        for (double v : b_W[static_cast<size_t>(w)]) bb += hand_floor_ms(v, true);
        floor_f = std::max(floor_f, ff + (ff > 0 ? 0.01 : 0.0));
        floor_b = std::max(floor_b, bb + (bb > 0 ? 0.01 : 0.0));
      }
      SCOPED_TRACE(std::string(policy) + " W=" + std::to_string(W));
      EXPECT_GT(floor_f, 1.0);  // the shape is large enough for the floor to matter
      EXPECT_GE(r.expert_fwd_ms, floor_f * (1 - 1e-12));
      EXPECT_GE(r.expert_bwd_ms, floor_b * (1 - 1e-12));
      EXPECT_GE(r.fwd_ms + r.bwd_ms, floor_f + floor_b);
    }
  }
  EXPECT_GE(timed, 4);
}

TEST(Cluster, EveryGroupOnItsOwnLoadsTheSlowestDecides) {
  // 2 steps x 3 groups x 2 layers of the toy cluster, each (step, group, layer) with its
  // own loads; each group's layer simulated alone here (simulate_layer, symi given the
  // same group's same layer one step earlier by hand), the max taken by hand
  const planner::PlanInput base = toy_input();
  const sim::SimConfig cfg = toy_config();
  const int64_t S = 2, Gr = 3, Lyr = 2;
  std::vector<int64_t> loads;
  for (int64_t j = 0; j < S * Gr * Lyr; ++j)
    for (int64_t v : {30 + 7 * j, 10 + 3 * (j % 4), 20 + 5 * (j % 3), 40 - 2 * j}) loads.push_back(v);
  for (const char* policy : {"fixed", "symi"}) {
    const auto out = sim::simulate_cluster(policy, base, loads, S, Gr, Lyr, cfg, 2);
    ASSERT_EQ(out.size(), static_cast<size_t>(S * Lyr));
    for (int64_t s = 0; s < S; ++s)
      for (int64_t l = 0; l < Lyr; ++l) {
        double worst = -1, sum = 0, bcast = 0;
        int32_t at = -1;
        for (int64_t g = 0; g < Gr; ++g) {
          planner::PlanInput in = base;
          const size_t cell = static_cast<size_t>(((s * Gr + g) * Lyr + l) * 4);
          in.load_WE.assign(loads.begin() + cell, loads.begin() + cell + 4);
          if (std::string(policy) == "symi" && s > 0) {
            const size_t p = static_cast<size_t>((((s - 1) * Gr + g) * Lyr + l) * 4);
            in.previous_load_E = {loads[p] + loads[p + 2], loads[p + 1] + loads[p + 3]};
          }
          const sim::LayerResult r = sim::simulate_layer(policy, in, cfg);
          ASSERT_TRUE(r.feasible);
          sum += r.fwd_ms + r.bwd_ms;
          if (r.fwd_ms + r.bwd_ms > worst) { worst = r.fwd_ms + r.bwd_ms; at = static_cast<int32_t>(g); }
          bcast = std::max(bcast, r.broadcast_ms);
        }
        const sim::ClusterLayer& c = out[static_cast<size_t>(s * Lyr + l)];
        EXPECT_TRUE(c.feasible);
        EXPECT_DOUBLE_EQ(c.time_ms, worst);
        EXPECT_EQ(c.slowest_group, at);
        EXPECT_NEAR(c.mean_group_ms, sum / Gr, 1e-12);
        EXPECT_EQ(c.broadcast_ms, bcast);
        EXPECT_EQ(c.owned_experts_max, 1);  // fixed ownership of E 2 over W 2
      }
  }
  EXPECT_THROW(sim::simulate_cluster("fixed", base, loads, S, 0, Lyr, cfg, 1), std::invalid_argument);
  EXPECT_THROW(sim::simulate_cluster("fixed", base, loads, S, 2, Lyr, cfg, 1), std::invalid_argument);
}

TEST(A2A, TokenLevelDispatchDedupsPerRankAndNode) {
  // W 4 in nodes of 2 (node 0: ranks 0, 1; node 1: ranks 2, 3), K 2, three tokens of
  // source 0: t0 -> ranks {2, 3} (one remote node), t1 -> {1, 1} (one rank twice),
  // t2 -> {0, 3}. By hand: t0 crosses the network once, 0 -> 2 (the proxy with local
  // index 0 on node 1), and 2 forwards it to 3; t1 one NVLink row 0 -> 1; t2 a self row
  // and a network row 0 -> 2, forwarded 2 -> 3. Without dedup: 3 network rows (t0 twice).
  // One token of source 3: {3, -1}: a self row.
  const sim::TokenDispatch d = sim::token_dispatch({0, 0, 0, 3}, {2, 3, 1, 1, 0, 3, 3, -1}, 2, 4, 2);
  EXPECT_EQ(d.self_W, (std::vector<double>{1, 0, 0, 1}));
  EXPECT_EQ(d.inter_out_W, (std::vector<double>{2, 0, 0, 0}));
  EXPECT_EQ(d.inter_in_W, (std::vector<double>{0, 0, 2, 0}));
  EXPECT_EQ(d.intra_out_W, (std::vector<double>{1, 0, 2, 0}));
  EXPECT_EQ(d.intra_in_W, (std::vector<double>{0, 1, 0, 2}));
  EXPECT_EQ(d.inter_peers_W, (std::vector<int64_t>{1, 0, 0, 0}));
  EXPECT_EQ(d.intra_peers_W, (std::vector<int64_t>{1, 0, 1, 0}));
  EXPECT_EQ(d.inter_in_peers_W, (std::vector<int64_t>{0, 0, 1, 0}));
  EXPECT_EQ(d.intra_in_peers_W, (std::vector<int64_t>{0, 1, 0, 1}));
  EXPECT_EQ(d.pair_inter_rows, 3);
  // time, 1000 B rows, network 1 GB/s 5 us, NVLink 2 GB/s 1 us, no self cost:
  // network phase: rank 0 sends 2 rows (and rank 2 receives 2): 2000 B / 1e6 B/ms +
  // 0.005 = 0.007; NVLink phase: rank 2 forwards 2 rows, rank 3 receives 2: 2000 / 2e6 +
  // 0.001 = 0.002; in sequence 0.009, over 4 chunks 0.007 + 0.002 / 4
  sim::LinkModel link;
  link.gpus_per_node = 2;
  link.intra_GBps = 2.0;
  link.intra_latency_us = 1.0;
  link.inter_GBps = 1.0;
  link.inter_latency_us = 5.0;
  EXPECT_NEAR(sim::hierarchical_a2a_ms(d, 1000.0, link, 0.0, 1), 0.009, 1e-15);
  EXPECT_NEAR(sim::hierarchical_a2a_ms(d, 1000.0, link, 0.0, 4), 0.0075, 1e-15);
  // 2 us per peer: ranks 0 and 2 each have one peer per phase: 0.009 + 0.004
  EXPECT_NEAR(sim::hierarchical_a2a_ms(d, 1000.0, link, 2.0, 1), 0.013, 1e-15);
  EXPECT_THROW(sim::token_dispatch({0}, {1}, 2, 4, 2), std::invalid_argument);
  EXPECT_THROW(sim::token_dispatch({0, 0}, {4, 0, 1, 1}, 2, 4, 2), std::invalid_argument);
  EXPECT_THROW(sim::hierarchical_a2a_ms(d, 1000.0, link, 0.0, 0), std::invalid_argument);
}

TEST(A2A, EightNodeFanOutCrossesOncePerNode) {
  // EP16 in nodes of 8: one token of rank 0 to experts on ranks 8..15 (K 8, all on node
  // 1) crosses once (to rank 8, which forwards to 9..15: 7 NVLink rows); per pair it
  // would be 8 network rows -- the 4x-8x excess of issue 30
  std::vector<int32_t> dest;
  for (int32_t r = 8; r < 16; ++r) dest.push_back(r);
  const sim::TokenDispatch d = sim::token_dispatch({0}, dest, 8, 16, 8);
  EXPECT_EQ(d.inter_out_W[0], 1);
  EXPECT_EQ(d.inter_in_W[8], 1);
  EXPECT_EQ(d.intra_out_W[8], 7);
  EXPECT_EQ(d.pair_inter_rows, 8);
}

TEST(A2A, ExpectedDispatchByHand) {
  // W 4 in nodes of 2, K 2: source 0 has 20 pairs, 10 on rank 2 and 10 on rank 3 (node
  // 1), so T = 10 tokens. A token reaches rank 2 with 1 - (1 - 1/2)^2 = 3/4: 7.5 rows;
  // rank 3 the same; node 1 with 1 - (1 - 1)^2 = 1: 10 network rows to the proxy 2 (local
  // index 0), which forwards rank 3's 7.5 over NVLink and keeps its own. Per pair: 20.
  std::vector<int64_t> M(16, 0);
  M[0 * 4 + 2] = 10;
  M[0 * 4 + 3] = 10;
  const sim::TokenDispatch d = sim::expected_dispatch(M, 4, 2, 2);
  EXPECT_EQ(d.inter_out_W, (std::vector<double>{10, 0, 0, 0}));
  EXPECT_EQ(d.inter_in_W, (std::vector<double>{0, 0, 10, 0}));
  EXPECT_EQ(d.intra_out_W, (std::vector<double>{0, 0, 7.5, 0}));
  EXPECT_EQ(d.intra_in_W, (std::vector<double>{0, 0, 0, 7.5}));
  EXPECT_EQ(d.inter_peers_W, (std::vector<int64_t>{1, 0, 0, 0}));
  EXPECT_EQ(d.intra_in_peers_W, (std::vector<int64_t>{0, 0, 0, 1}));
  EXPECT_DOUBLE_EQ(d.pair_inter_rows, 20.0);
  // K 1: no dedup, every pair a row
  const sim::TokenDispatch p = sim::expected_dispatch(M, 4, 1, 2);
  EXPECT_EQ(p.inter_out_W[0], 20.0);
  EXPECT_EQ(p.intra_out_W[2], 10.0);
  // reversed: sent <-> received
  const sim::TokenDispatch r = sim::reversed(d);
  EXPECT_EQ(r.inter_in_W[0], 10.0);
  EXPECT_EQ(r.intra_out_W[3], 7.5);
  EXPECT_EQ(r.intra_peers_W, (std::vector<int64_t>{0, 0, 0, 1}));
  EXPECT_THROW(sim::expected_dispatch(M, 4, 0, 2), std::invalid_argument);
  EXPECT_THROW(sim::expected_dispatch(std::vector<int64_t>(15, 0), 4, 2, 2), std::invalid_argument);
  M[1] = -1;
  EXPECT_THROW(sim::expected_dispatch(M, 4, 2, 2), std::invalid_argument);
}

// expected_dispatch's definition (a2a.h) as its first version computed it, source by
// source over a row-major matrix: the reference the faster paths must equal bit for bit
sim::TokenDispatch reference_dispatch(const std::vector<int64_t>& M, int32_t W, int32_t K, int32_t G) {
  sim::TokenDispatch d;
  for (auto* v : {&d.self_W, &d.inter_out_W, &d.inter_in_W, &d.intra_out_W, &d.intra_in_W})
    v->assign(static_cast<size_t>(W), 0.0);
  for (auto* v : {&d.inter_peers_W, &d.intra_peers_W, &d.inter_in_peers_W, &d.intra_in_peers_W})
    v->assign(static_cast<size_t>(W), 0);
  std::vector<char> flag(static_cast<size_t>(W) * W, 0);
  auto peer = [&](int32_t a, int32_t b) {
    if (flag[static_cast<size_t>(a) * W + b]) return;
    flag[static_cast<size_t>(a) * W + b] = 1;
    ++d.intra_peers_W[a];
    ++d.intra_in_peers_W[b];
  };
  for (int32_t s = 0; s < W; ++s) {
    int64_t P = 0;
    for (int32_t r = 0; r < W; ++r) P += M[static_cast<size_t>(s) * W + r];
    if (P == 0) continue;
    const double T = static_cast<double>(P) / K, inv_P = 1.0 / static_cast<double>(P);
    auto rows = [&](int64_t m) {
      if (K == 1) return static_cast<double>(m);
      double base = 1.0 - static_cast<double>(m) * inv_P, acc = 1.0;
      for (int32_t k = K; k > 0; k >>= 1) {
        if (k & 1) acc *= base;
        base *= base;
      }
      return T * (1.0 - acc);
    };
    for (int32_t n = 0; n < (W + G - 1) / G; ++n) {
      const int32_t r0 = n * G, r1 = std::min(W, r0 + G);
      const int32_t proxy = std::min(W - 1, r0 + s % G);
      int64_t node_m = 0;
      for (int32_t r = r0; r < r1; ++r) {
        const int64_t m = M[static_cast<size_t>(s) * W + r];
        if (m == 0) continue;
        if (n == s / G) {
          if (r == s) { d.self_W[s] += rows(m); continue; }
          d.intra_out_W[s] += rows(m);
          d.intra_in_W[r] += rows(m);
          peer(s, r);
          continue;
        }
        node_m += m;
        if (r == proxy) continue;
        d.intra_out_W[proxy] += rows(m);
        d.intra_in_W[r] += rows(m);
        peer(proxy, r);
      }
      if (n == s / G || node_m == 0) continue;
      d.pair_inter_rows += static_cast<double>(node_m);
      d.inter_out_W[s] += rows(node_m);
      d.inter_in_W[proxy] += rows(node_m);
      ++d.inter_peers_W[s];
      ++d.inter_in_peers_W[proxy];
    }
  }
  return d;
}

void expect_same_dispatch(const sim::TokenDispatch& a, const sim::TokenDispatch& b, int trial) {
  EXPECT_EQ(a.self_W, b.self_W) << trial;  // doubles compared exactly
  EXPECT_EQ(a.inter_out_W, b.inter_out_W) << trial;
  EXPECT_EQ(a.inter_in_W, b.inter_in_W) << trial;
  EXPECT_EQ(a.intra_out_W, b.intra_out_W) << trial;
  EXPECT_EQ(a.intra_in_W, b.intra_in_W) << trial;
  EXPECT_EQ(a.inter_peers_W, b.inter_peers_W) << trial;
  EXPECT_EQ(a.intra_peers_W, b.intra_peers_W) << trial;
  EXPECT_EQ(a.inter_in_peers_W, b.inter_in_peers_W) << trial;
  EXPECT_EQ(a.intra_in_peers_W, b.intra_in_peers_W) << trial;
  EXPECT_EQ(a.pair_inter_rows, b.pair_inter_rows) << trial;
}

TEST(A2A, FastDispatchPathsEqualTheDefinitionBitForBit) {
  // row-major, transposed and sparse inputs against the reference loop: dense, sparse,
  // tiny and beyond-2^52 entries, empty sources, partial last nodes, every K of 1..9
  std::mt19937_64 rng(5);
  for (int trial = 0; trial < 400; ++trial) {
    const int32_t W = trial % 8 == 0 ? 128 : 1 + static_cast<int32_t>(rng() % 40);
    const int32_t G = trial % 3 == 0 ? 8 : 1 + static_cast<int32_t>(rng() % 12);
    const int32_t K = 1 + static_cast<int32_t>(rng() % 9);
    const int mode = trial % 5;
    std::vector<int64_t> M(static_cast<size_t>(W) * W);
    for (int64_t& v : M)
      v = mode == 0 ? static_cast<int64_t>(rng() % 5000)
          : mode == 1 ? (rng() % 4 == 0 ? static_cast<int64_t>(rng() % 100) : 0)
          : mode == 2 ? (rng() % 50 == 0 ? static_cast<int64_t>(rng() % 10000000000ull) : 0)
          : mode == 3 ? static_cast<int64_t>(rng() % 3)
                      : static_cast<int64_t>(rng() >> 9);  // up to 2^55
    const int32_t empty = static_cast<int32_t>(rng() % W);
    for (int32_t r = 0; r < W; ++r) M[static_cast<size_t>(empty) * W + r] = 0;
    const sim::TokenDispatch want = reference_dispatch(M, W, K, G);
    expect_same_dispatch(sim::expected_dispatch(M, W, K, G), want, trial);
    std::vector<int64_t> M_t(M.size());
    std::vector<sim::PairCell> cells;
    for (int32_t s = 0; s < W; ++s)
      for (int32_t r = 0; r < W; ++r) {
        M_t[static_cast<size_t>(r) * W + s] = M[static_cast<size_t>(s) * W + r];
        if (M[static_cast<size_t>(s) * W + r] != 0) cells.push_back({s, r, M[static_cast<size_t>(s) * W + r]});
      }
    sim::TokenDispatch got;
    sim::expected_dispatch_transposed(M_t.data(), W, K, G, &got);
    expect_same_dispatch(got, want, trial);
    sim::expected_dispatch_sparse(cells, W, K, G, &got);
    expect_same_dispatch(got, want, trial);
  }
  std::vector<sim::PairCell> unsorted = {{1, 0, 5}, {0, 1, 5}};
  sim::TokenDispatch d;
  EXPECT_THROW(sim::expected_dispatch_sparse(unsorted, 2, 1, 1, &d), std::invalid_argument);
}

TEST(A2A, ExpectedDispatchMatchesSampledTokens) {
  // an independent reference: tokens sampled as the model assumes (K = 8 independent
  // draws from each source's pair distribution, an LCG), counted by token_dispatch, and
  // their pair matrix given to expected_dispatch. EP16 in nodes of 8, 4,000 tokens per
  // source: the rows per rank agree to a few percent (sampling noise ~1 %).
  const int32_t W = 16, G = 8, K = 8, T = 4000;
  uint64_t x = 12345;
  auto u = [&]() { x = x * 6364136223846793005ULL + 1442695040888963407ULL; return (x >> 11) * 0x1.0p-53; };
  std::vector<int32_t> src, dest;
  std::vector<int64_t> M(static_cast<size_t>(W) * W, 0);
  for (int32_t s = 0; s < W; ++s) {
    std::vector<double> w(static_cast<size_t>(W));
    double tot = 0;
    for (int32_t r = 0; r < W; ++r) tot += (w[r] = 1.0 / (1 + (r + 3 * s) % W));  // skewed
    for (int32_t t = 0; t < T; ++t) {
      src.push_back(s);
      for (int32_t k = 0; k < K; ++k) {
        double v = u() * tot;
        int32_t r = 0;
        while (r < W - 1 && v >= w[r]) v -= w[r++];
        dest.push_back(r);
        ++M[static_cast<size_t>(s) * W + r];
      }
    }
  }
  const sim::TokenDispatch got = sim::token_dispatch(src, dest, K, W, G);
  const sim::TokenDispatch want = sim::expected_dispatch(M, W, K, G);
  EXPECT_DOUBLE_EQ(got.pair_inter_rows, want.pair_inter_rows);
  for (int32_t r = 0; r < W; ++r) {
    SCOPED_TRACE(r);
    EXPECT_NEAR(want.inter_out_W[r], got.inter_out_W[r], 0.03 * got.inter_out_W[r]);
    EXPECT_NEAR(want.inter_in_W[r], got.inter_in_W[r], 0.03 * got.inter_in_W[r]);
    EXPECT_NEAR(want.intra_out_W[r], got.intra_out_W[r], 0.03 * got.intra_out_W[r]);
    EXPECT_NEAR(want.self_W[r], got.self_W[r], 0.03 * got.self_W[r]);
    EXPECT_EQ(want.inter_peers_W[r], got.inter_peers_W[r]);
  }
  // dedup matters here: far fewer network rows than pairs
  double net = 0;
  for (double v : got.inter_out_W) net += v;
  EXPECT_LT(net, 0.5 * got.pair_inter_rows);
}
