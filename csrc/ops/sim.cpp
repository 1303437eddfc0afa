// sim, CPU: the cluster simulator (csrc/sim) as a torch op, reached by lrmoe/sim.py
// through the same extension as the planner's op (csrc/ops/plan.cpp).
//
// Legend: S steps, Lyr layers, W ranks, E experts, N = S x Lyr layer results,
// load_SLWE (int64) routed pairs, gemm_G4 (float64) calibrated grouped-GEMM points
// (experts per rank, rows per expert, forward ms, backward ms), fields_NF (float64)
// one row of kFields per layer result, sent_N5W (int64) bytes each rank sends into each
// collective (forward_dispatch, forward_combine, backward_grad, backward_index,
// backward_dx). Host only: the simulator reads counts, not tensors on a device.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <stdexcept>
#include <string>
#include <tuple>

#include "ops/common.h"
#include "ops/plan_input.h"
#include "sim/sim.h"

namespace lrmoe {
namespace {

// The columns of fields_NF; lrmoe/sim.py FIELDS names them in the same order.
constexpr int64_t kFields = 31;

void fill_row(const sim::LayerResult& r, int32_t micro, double time_ms, double* f) {
  const double v[kFields] = {
      r.feasible ? 1.0 : 0.0, static_cast<double>(r.binding), r.fwd_ms, r.bwd_ms,
      r.src_fwd_ms, r.dispatch_ms, r.expert_fwd_ms, r.combine_ms, r.src_bwd_ms,
      r.grad_a2a_ms, r.expert_bwd_ms, r.dx_a2a_ms, r.replica_ms, r.offload_ms,
      r.fwd_link_bytes, r.bwd_link_bytes, r.replica_bytes, r.offload_bytes,
      static_cast<double>(r.memory_max.base_experts), static_cast<double>(r.memory_max.replicas),
      static_cast<double>(r.memory_max.forward_tokens),
      static_cast<double>(r.memory_max.backward_tokens), static_cast<double>(r.memory_peak),
      static_cast<double>(r.limit_bytes), static_cast<double>(r.replicas),
      static_cast<double>(r.pairs), static_cast<double>(r.retained), r.fwd_imbalance,
      r.bwd_imbalance, static_cast<double>(micro), time_ms};
  std::copy(v, v + kFields, f);
}

std::tuple<at::Tensor, at::Tensor, std::string> sim_cpu(
    const at::Tensor& load, c10::string_view policy, c10::IntArrayRef memory_bytes,
    bool optimizer_on_device, double recalibration_rate, c10::string_view quota_rule,
    int64_t replica_slots, int64_t symi_slots, double max_expert_cut,
    int64_t backward_row_capacity, int64_t min_replica_rows, double balance_slack,
    const at::Tensor& gemm, c10::ArrayRef<double> per_row, c10::ArrayRef<double> link,
    c10::IntArrayRef sizes, bool offload, double h2d_GBps, int64_t threads,
    const c10::optional<at::Tensor>& previous_load, double multiplier, int64_t max_micro) {
  check_dim(load, 4, "load");
  LRMOE_CHECK(!load.is_floating_point() && load.device().is_cpu(),
              "load must be an integer CPU tensor (steps, layers, W, E) of routed pairs");
  check_dim(gemm, 2, "gemm");
  LRMOE_CHECK(gemm.size(1) == 4 && gemm.size(0) >= 1, "gemm must be (points, 4): experts, rows, "
              "forward ms, backward ms; run `lrmoe calibrate` for a cost file");
  LRMOE_CHECK(per_row.size() == 12, "per_row must hold 12 costs (lrmoe/sim.py PER_ROW), got ",
              per_row.size());
  LRMOE_CHECK(link.size() == 6, "link must hold [gpus_per_node, intra_GBps, intra_latency_us, "
              "inter_GBps, inter_latency_us, self_GBps], got ", link.size(), " values");
  LRMOE_CHECK(sizes.size() == 4, "sizes must hold [hidden, elem_bytes, offload_row_bytes, "
              "per_rank_bytes], got ", sizes.size());
  const int64_t S = load.size(0), L = load.size(1), W = load.size(2), E = load.size(3);
  planner::PlanInput in = plan_input(W, E, memory_bytes, optimizer_on_device,
                                     recalibration_rate, quota_rule, replica_slots, symi_slots,
                                     max_expert_cut, backward_row_capacity, min_replica_rows,
                                     balance_slack);
  sim::SimConfig cfg;
  const at::Tensor g = gemm.to(at::kDouble).contiguous();
  for (int64_t j = 0; j < g.size(0); ++j) {
    const double* p = g.data_ptr<double>() + 4 * j;
    cfg.cost.gemm.push_back({p[0], p[1], p[2], p[3]});
  }
  cfg.cost.per_row = {per_row[0], per_row[1], per_row[2], per_row[3], per_row[4],
                      per_row[5], per_row[6], per_row[7], per_row[8], per_row[9],
                      per_row[10], per_row[11]};
  cfg.cost.h2d_GBps = h2d_GBps;
  cfg.link = {static_cast<int32_t>(link[0]), link[1], link[2], link[3], link[4], link[5]};
  cfg.hidden = sizes[0];
  cfg.elem_bytes = sizes[1];
  cfg.offload = offload;
  cfg.offload_row_bytes = sizes[2];
  cfg.per_rank_bytes = sizes[3] != 0;
  const at::Tensor lc = load.to(at::kLong).contiguous();
  const std::vector<int64_t> loads(lc.data_ptr<int64_t>(), lc.data_ptr<int64_t>() + lc.numel());
  std::vector<int64_t> prev;
  if (previous_load.has_value()) {
    const at::Tensor pc = previous_load->to(at::kLong).contiguous();
    prev.assign(pc.data_ptr<int64_t>(), pc.data_ptr<int64_t>() + pc.numel());
  }
  const int64_t N = S * L;
  at::Tensor fields = at::empty({N, kFields}, at::kDouble);
  at::Tensor sent = at::zeros({cfg.per_rank_bytes ? N : 0, 5, W}, at::kLong);
  std::string reason;
  try {
    std::vector<sim::LayerResult> out;
    std::vector<int32_t> micro(static_cast<size_t>(N), 1);
    std::vector<double> time(static_cast<size_t>(N), 0.0);
    if (multiplier > 0) {  // batch pressure: every (step, layer) at m x its loads
      const size_t cell = static_cast<size_t>(W * E);
      for (int64_t j = 0; j < N; ++j) {
        in.load_WE.assign(loads.begin() + j * cell, loads.begin() + (j + 1) * cell);
        sim::PressureResult p = sim::simulate_pressure(std::string(policy), in, multiplier,
                                                       static_cast<int32_t>(max_micro), cfg);
        micro[j] = p.micro_batches;
        time[j] = p.time_ms;
        out.push_back(std::move(p.layer));
      }
    } else {
      out = sim::simulate_trace(std::string(policy), in, loads, S, L, cfg,
                                static_cast<int32_t>(threads), prev.empty() ? nullptr : &prev);
      for (int64_t j = 0; j < N; ++j) time[j] = out[j].fwd_ms + out[j].bwd_ms;
    }
    for (int64_t j = 0; j < N; ++j) {
      fill_row(out[j], micro[j], time[j], fields.data_ptr<double>() + j * kFields);
      if (cfg.per_rank_bytes)
        std::copy(out[j].sent_bytes_5W.begin(), out[j].sent_bytes_5W.end(),
                  sent.data_ptr<int64_t>() + j * 5 * W);
      if (reason.empty() && !out[j].feasible) reason = out[j].reason;
    }
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, std::string(e.what()));  // ValueError in Python
  }
  return {fields, sent, reason};
}

}  // namespace

TORCH_LIBRARY_IMPL(lrmoe, CPU, m) { m.impl("sim", &sim_cpu); }

}  // namespace lrmoe
