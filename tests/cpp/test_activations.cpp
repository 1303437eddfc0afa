// GoogleTests for csrc/sim/activations.h and the all-layer activations of batch pressure
// (sim.h simulate_pressure): every expected byte count is worked out by hand in the
// comments from the formulas of activations.h, not taken from the code under test.
//
// Legend: N layers held, T tokens per GPU, K rows per token; bytes plain.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "planner/plan.h"
#include "sim/activations.h"
#include "sim/sim.h"

namespace {

using namespace lrmoe;
using sim::ActivationMode;

// N = 4 layers, K = 2; per token per layer 10 dense bytes and a 3-byte input; per row
// 100 saved expert bytes, 40 of them offloadable.
sim::ActivationModel toy_model(ActivationMode mode) {
  sim::ActivationModel m;
  m.mode = mode;
  m.layers = 4;
  m.top_k = 2;
  m.dense_token_bytes = 10;
  m.moe_row_bytes = 100;
  m.offload_row_bytes = 40;
  m.input_token_bytes = 3;
  return m;
}

TEST(Activations, KeepCountsEveryLayerDenseAndTheOtherLayersExpertRows) {
  // T = 5: dense 4 x 5 x 10 = 200; MoE (4 - 1) x 5 x 2 x 100 = 3000
  const sim::ActivationBytes b = sim::activation_bytes(toy_model(ActivationMode::kKeep), 5);
  EXPECT_EQ(b.dense, 200);
  EXPECT_EQ(b.moe, 3000);
  EXPECT_EQ(b.inputs, 0);
  EXPECT_EQ(b.total(), 3200);
}

TEST(Activations, OffloadKeepsTheDensePartAndTheRowsNotOffloaded) {
  // dense as keep, 200; MoE 3 x 5 x 2 x (100 - 40) = 1800
  const sim::ActivationBytes b = sim::activation_bytes(toy_model(ActivationMode::kOffload), 5);
  EXPECT_EQ(b.dense, 200);
  EXPECT_EQ(b.moe, 1800);
  EXPECT_EQ(b.total(), 2000);
}

TEST(Activations, RecomputeKeepsInputsAndOneLayersDensePart) {
  // inputs (4 - 1) x 5 x 3 = 45; the recomputed layer's dense part 5 x 10 = 50
  const sim::ActivationBytes b = sim::activation_bytes(toy_model(ActivationMode::kRecompute), 5);
  EXPECT_EQ(b.inputs, 45);
  EXPECT_EQ(b.dense, 50);
  EXPECT_EQ(b.moe, 0);
  EXPECT_EQ(b.total(), 95);
}

TEST(Activations, LayerModeIsTheOldModelAndChargesNothing) {
  EXPECT_EQ(sim::activation_bytes(toy_model(ActivationMode::kLayer), 5).total(), 0);
  sim::ActivationModel off;  // the default: kLayer, no sizes needed
  EXPECT_EQ(sim::activation_bytes(off, 1000).total(), 0);
}

TEST(Activations, GrowLinearlyWithTokensAndLayers) {
  sim::ActivationModel m = toy_model(ActivationMode::kKeep);
  // T = 10: 2 x 3200 = 6400
  EXPECT_EQ(sim::activation_bytes(m, 10).total(), 6400);
  // N = 8, T = 5: dense 8 x 5 x 10 = 400, MoE 7 x 5 x 2 x 100 = 7000
  m.layers = 8;
  EXPECT_EQ(sim::activation_bytes(m, 5).total(), 7400);
}

TEST(Activations, Qwen3At4096TokensByHand) {
  // Qwen3-30B-A3B (H 2048, I 768, E 128, K 8, 48 layers), bf16: dense 15 H + 4 E =
  // 30720 + 512 = 31232 bytes per token per layer (lrmoe/sim/simulate.py
  // activation_model), expert row 4 H + 4 I = 11264 (planner forward_row_bytes), of it
  // gate/up 4 I = 3072 offloadable, input 2 H = 4096. T = 4096:
  sim::ActivationModel m;
  m.mode = ActivationMode::kKeep;
  m.layers = 48;
  m.top_k = 8;
  m.dense_token_bytes = 31232;
  m.moe_row_bytes = 11264;
  m.offload_row_bytes = 3072;
  m.input_token_bytes = 4096;
  // keep: 48 x 4096 x 31232 = 6,140,461,056; 47 x 4096 x 8 x 11264 = 17,347,641,344
  sim::ActivationBytes b = sim::activation_bytes(m, 4096);
  EXPECT_EQ(b.dense, 6140461056LL);
  EXPECT_EQ(b.moe, 17347641344LL);
  // recompute: 4096 x 31232 = 127,926,272; 47 x 4096 x 4096 = 788,529,152
  m.mode = ActivationMode::kRecompute;
  b = sim::activation_bytes(m, 4096);
  EXPECT_EQ(b.total(), 127926272LL + 788529152LL);
  // offload: 47 x 4096 x 8 x (11264 - 3072) = 12,616,466,432
  m.mode = ActivationMode::kOffload;
  EXPECT_EQ(sim::activation_bytes(m, 4096).moe, 12616466432LL);
}

TEST(Activations, BadInputIsRefusedNamingTheField) {
  sim::ActivationModel m = toy_model(ActivationMode::kKeep);
  m.layers = 0;
  try {
    sim::activation_bytes(m, 1);
    FAIL() << "layers = 0 accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("--layers-resident"), std::string::npos) << e.what();
  }
  m = toy_model(ActivationMode::kKeep);
  m.offload_row_bytes = 101;
  EXPECT_THROW(sim::activation_bytes(m, 1), std::invalid_argument);
  m = toy_model(ActivationMode::kKeep);
  m.dense_token_bytes = -1;
  EXPECT_THROW(sim::activation_bytes(m, 1), std::invalid_argument);
  EXPECT_THROW(sim::activation_bytes(toy_model(ActivationMode::kKeep), -1), std::invalid_argument);
  m = toy_model(ActivationMode::kKeep);
  m.layers = 1 << 30;
  EXPECT_THROW(sim::activation_bytes(m, int64_t(1) << 40), std::overflow_error);
  EXPECT_THROW(sim::activation_mode("all"), std::invalid_argument);
  EXPECT_EQ(sim::activation_mode("recompute"), ActivationMode::kRecompute);
}

TEST(Activations, TokensPerGpuIsTheLargestSourceOverK) {
  // sources: 30 + 10 = 40 and 20 + 40 = 60 pairs; K = 3: ceil(40 / 3) = 14, ceil(60 / 3) = 20
  EXPECT_EQ(sim::tokens_per_gpu({30, 10, 20, 40}, 2, 2, 3), 20);
  EXPECT_EQ(sim::tokens_per_gpu({30, 10, 20, 40}, 2, 2, 1), 60);
  EXPECT_THROW(sim::tokens_per_gpu({30, 10, 20}, 2, 2, 1), std::invalid_argument);
  EXPECT_THROW(sim::tokens_per_gpu({30, 10, 20, 40}, 2, 2, 0), std::invalid_argument);
}

// The toy of tests/cpp/test_sim.cpp: 2 ranks, 2 experts, loads {30, 10, 20, 40} (fixed:
// 50 rows per rank), expert bytes 100 + 200 + 400 = 700 per rank, rows 3 + 5 = 8 bytes;
// one GEMM point (1 expert, 10 rows) 1 ms forward, 2 ms backward; budget 1500, resident 0.
planner::PlanInput toy_input() {
  planner::PlanInput in;
  in.num_ranks = 2;
  in.num_experts = 2;
  in.load_WE = {30, 10, 20, 40};
  in.memory.expert_weight_bytes = 100;
  in.memory.expert_grad_bytes = 200;
  in.memory.expert_optimizer_bytes = 400;
  in.memory.forward_row_bytes = 3;
  in.memory.backward_row_bytes = 5;
  in.memory.budget_bytes = 1500;
  in.replica_slots = 0;
  return in;
}

sim::SimConfig toy_config(ActivationMode mode, int64_t dense_token_bytes) {
  sim::SimConfig cfg;
  cfg.cost.gemm = {sim::GemmPoint{1, 10, 1.0, 2.0}};
  cfg.link.intra_GBps = cfg.link.inter_GBps = 1.0;
  cfg.hidden = 500;
  // N = 3, K = 1, expert rows 3 bytes (the planner's forward row), input 1 byte
  cfg.activations.mode = mode;
  cfg.activations.layers = 3;
  cfg.activations.top_k = 1;
  cfg.activations.dense_token_bytes = dense_token_bytes;
  cfg.activations.moe_row_bytes = 3;
  cfg.activations.input_token_bytes = 1;
  return cfg;
}

TEST(ActivationPressure, KeepNeedsTwoMicroBatchesWhereTheOldModelNeedsOne) {
  const planner::PlanInput in = toy_input();
  // old model: 700 + 50 x 8 = 1100 <= 1500, one pass
  EXPECT_EQ(sim::simulate_pressure("fixed", in, 1.0, 8, toy_config(ActivationMode::kLayer, 2))
                .micro_batches, 1);
  // keep, dense 2: act(T) = 3 T 2 + 2 T 1 x 3 = 12 T. 1x: T = 60, 720 + 1100 > 1500;
  // two micro-batches {15, 5, 10, 20}: T = 30, act 360, rank bytes 700 + 25 x 8 = 900,
  // 1260 <= 1500
  const sim::PressureResult p =
      sim::simulate_pressure("fixed", in, 1.0, 8, toy_config(ActivationMode::kKeep, 2));
  EXPECT_EQ(p.micro_batches, 2);
  EXPECT_EQ(p.activation_bytes, 360);
  EXPECT_EQ(p.layer.limit_bytes, 1500 - 360);
  EXPECT_EQ(p.layer.memory_peak, 900);
  // time: two micro-batches of 25 rows per rank, no recompute
  EXPECT_EQ(p.recompute_ms, 0.0);
  EXPECT_DOUBLE_EQ(p.time_ms, 2 * (p.layer.fwd_ms + p.layer.bwd_ms));
  // the expert GEMMs of one micro-batch: 25 / 10 x 1 ms forward, x 2 backward
  EXPECT_DOUBLE_EQ(p.layer.expert_fwd_ms, 2.5);
}

TEST(ActivationPressure, RecomputeFitsInOnePassAndPaysTheForwardAgain) {
  // recompute, dense 2: act = T 2 + (3 - 1) T 1 = 4 T = 240 at T = 60; 1100 + 240 <= 1500
  const sim::PressureResult p =
      sim::simulate_pressure("fixed", toy_input(), 1.0, 8, toy_config(ActivationMode::kRecompute, 2));
  EXPECT_EQ(p.micro_batches, 1);
  EXPECT_EQ(p.activation_bytes, 240);
  EXPECT_DOUBLE_EQ(p.recompute_ms, p.layer.fwd_ms);
  EXPECT_DOUBLE_EQ(p.time_ms, 2 * p.layer.fwd_ms + p.layer.bwd_ms);
  EXPECT_DOUBLE_EQ(p.layer.expert_fwd_ms, 5.0);  // 50 rows / 10 x 1 ms
}

TEST(ActivationPressure, ActivationsAloneOverTheBudgetFailWithoutAPlan) {
  // keep, dense 100: act = 300 T + 6 T; T = 60 (1x) and 30 (2 micro-batches) are both
  // over 1500 by themselves
  const sim::PressureResult p =
      sim::simulate_pressure("fixed", toy_input(), 1.0, 2, toy_config(ActivationMode::kKeep, 100));
  EXPECT_EQ(p.micro_batches, 0);
  EXPECT_TRUE(std::isnan(p.time_ms));
  EXPECT_FALSE(p.layer.feasible);
  EXPECT_EQ(p.layer.binding, planner::Binding::kMemory);
  EXPECT_EQ(p.activation_bytes, 306 * 60);  // the 1x micro-batch's
  EXPECT_NE(p.layer.reason.find("activations of all layers"), std::string::npos) << p.layer.reason;
  // eight micro-batches: ceil(L / 8) = {4, 2, 3, 5}: T = 8, act 2448 > 1500: still none
  EXPECT_EQ(sim::simulate_pressure("fixed", toy_input(), 1.0, 8,
                                   toy_config(ActivationMode::kKeep, 100)).micro_batches, 0);
}

}  // namespace
