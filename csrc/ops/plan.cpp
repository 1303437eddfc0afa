// plan, CPU: the placement planner (csrc/planner) as a torch op, so lrmoe/planner.py
// reaches it through the same extension and dispatcher as every other op.
//
// Legend: W ranks, E experts, I instances, load_WE (int64) routed pairs L[s][e],
// forward_IW / retained_IW (int64) rows per (instance, source), memory_W4 (int64)
// bytes per rank: base experts, replicas, forward tokens, backward tokens.
// The planner runs on the host (it reads W x E counts, a few KiB), so CPU only.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <stdexcept>
#include <string>
#include <tuple>

#include "ops/common.h"
#include "ops/plan_input.h"
#include "planner/plan.h"

namespace lrmoe {
namespace {

at::Tensor to_tensor(const std::vector<int64_t>& v, int64_t rows, int64_t cols) {
  at::Tensor t = at::empty({rows, cols}, at::kLong);
  std::copy(v.begin(), v.end(), t.data_ptr<int64_t>());
  return t;
}

std::vector<int64_t> to_vector(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kLong).contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
           at::Tensor, std::string>
plan_cpu(const at::Tensor& load, c10::string_view policy, c10::IntArrayRef memory_bytes,
         bool optimizer_on_device, double recalibration_rate, c10::string_view quota_rule,
         int64_t replica_slots, int64_t symi_slots, const c10::optional<at::Tensor>& previous_load,
         double max_expert_cut, int64_t backward_row_capacity, int64_t min_replica_rows,
         double balance_slack) {
  check_dim(load, 2, "load");
  LRMOE_CHECK(!load.is_floating_point() && !load.is_complex() && load.device().is_cpu(),
              "load must be an integer CPU tensor (W, E) of routed pairs per (source, expert)");
  planner::PlanInput in = plan_input(load.size(0), load.size(1), memory_bytes,
                                     optimizer_on_device, recalibration_rate, quota_rule,
                                     replica_slots, symi_slots, max_expert_cut,
                                     backward_row_capacity, min_replica_rows, balance_slack);
  in.load_WE = to_vector(load);
  if (previous_load.has_value()) in.previous_load_E = to_vector(*previous_load);
  planner::Plan p;
  try {
    p = planner::make_plan(std::string(policy), in);
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, std::string(e.what()));  // ValueError in Python
  }
  const int64_t W = p.num_ranks, E = p.num_experts, I = p.num_instances();
  std::vector<int64_t> offsets(p.instance_offsets.begin(), p.instance_offsets.end());
  std::vector<int64_t> ranks(p.instance_rank.begin(), p.instance_rank.end());
  std::vector<int64_t> rows(static_cast<size_t>(3 * W), -1);  // fixed, forward, backward
  if (!p.fixed_rows_W.empty()) std::copy(p.fixed_rows_W.begin(), p.fixed_rows_W.end(), rows.begin());
  std::copy(p.forward_rows_W.begin(), p.forward_rows_W.end(), rows.begin() + W);
  std::copy(p.backward_rows_W.begin(), p.backward_rows_W.end(), rows.begin() + 2 * W);
  std::vector<int64_t> memory;
  for (const auto& m : p.memory_W)
    memory.insert(memory.end(), {m.base_experts, m.replicas, m.forward_tokens, m.backward_tokens});
  const std::vector<int64_t> status = {p.feasible ? 1 : 0, static_cast<int64_t>(p.binding),
                                       p.binding_rank, p.shortfall, p.limit_bytes, p.replicas};
  return {to_tensor(offsets, 1, E + 1).view({E + 1}), to_tensor(ranks, 1, I).view({I}),
          to_tensor(p.forward_IW, I, W), to_tensor(p.retained_IW, I, W),
          to_tensor(p.quota_E, 1, E).view({E}), to_tensor(rows, 3, W), to_tensor(memory, W, 4),
          to_tensor(status, 1, 6).view({6}), p.reason};
}

}  // namespace

TORCH_LIBRARY_IMPL(lrmoe, CPU, m) { m.impl("plan", &plan_cpu); }

}  // namespace lrmoe
