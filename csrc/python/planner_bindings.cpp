// lrmoe._C.planner: the placement planner (csrc/planner/plan.h) bound as a program --
// its input and its plan as structs with named fields, and plan(policy, input).
// lrmoe/planner/plan.py is its Python face; docs/planner.md describes every field.
//
// Legend (planner/plan.h): W ranks, E experts, I instances; vectors are flat and
// row-major as in C++ (load_WE[s * E + e], forward_IW[i * W + s]), read back as 1-D
// numpy arrays (copies: assign the whole field to change it).
#include <pybind11/pybind11.h>

#include <string>
#include <vector>

#include "planner/exact.h"
#include "planner/plan.h"
#include "python/bindings.h"
#include "python/fields.h"

namespace lrmoe {
namespace python {

void check_slots(const planner::PlanInput& in) {
  // slot counts above E mean nothing (a rank holds at most one instance of each
  // expert); refused here as the old op refused them, before any policy reads them
  const std::string E = std::to_string(in.num_experts);
  if (in.replica_slots > in.num_experts)
    throw py::value_error("lrmoe: replica_slots must be <= the number of experts (E=" + E +
                          "; a rank holds at most one instance of each expert), got " +
                          std::to_string(in.replica_slots));
  if (in.symi_slots > in.num_experts)
    throw py::value_error("lrmoe: symi_slots must be <= the number of experts (E=" + E +
                          "; 0: ceil(E / W) + replica_slots), got " +
                          std::to_string(in.symi_slots));
}

void bind_planner(py::module_ m) {
  using planner::MemoryBreakdown;
  using planner::MemoryModel;
  using planner::Plan;
  using planner::PlanInput;

  py::enum_<core::QuotaRule>(m, "QuotaRule", "Retention quota rule (docs/algorithm.md).")
      .value("proportional", core::QuotaRule::kProportional)
      .value("water_level", core::QuotaRule::kWaterLevel);
  py::enum_<planner::PolicyKind>(m, "PolicyKind", "Placement policy (docs/planner.md).")
      .value("fixed", planner::PolicyKind::kFixed)
      .value("ultraep", planner::PolicyKind::kUltraEP)
      .value("symi", planner::PolicyKind::kSymi)
      .value("lrmoe", planner::PolicyKind::kLRMoE);
  py::enum_<planner::Binding>(m, "Binding", "The constraint that makes a plan infeasible.")
      .value("none", planner::Binding::kNone)
      .value("memory", planner::Binding::kMemory)
      .value("backward_row_capacity", planner::Binding::kRowCapacity)
      .value("replica_slots", planner::Binding::kReplicaSlots);

  Struct<MemoryModel>(m, "MemoryModel", "Bytes of one expert copy and one token row on a rank.")
      .field("expert_weight_bytes", &MemoryModel::expert_weight_bytes, "one copy's weights, bytes")
      .field("expert_grad_bytes", &MemoryModel::expert_grad_bytes,
             "one copy's gradient buffer, bytes")
      .field("expert_optimizer_bytes", &MemoryModel::expert_optimizer_bytes,
             "master weights + Adam moments of one expert, bytes")
      .field("optimizer_on_device", &MemoryModel::optimizer_on_device,
             "False: optimizer state on the host")
      .field("forward_row_bytes", &MemoryModel::forward_row_bytes, "per routed row computed, bytes")
      .field("backward_row_bytes", &MemoryModel::backward_row_bytes, "per retained row, bytes")
      .field("budget_bytes", &MemoryModel::budget_bytes, "B: device memory per GPU, bytes")
      .field("resident_bytes", &MemoryModel::resident_bytes,
             "bytes outside this layer's experts and token buffers")
      .done();

  Struct<PlanInput>(m, "PlanInput", "What a policy reads (planner/plan.h PlanInput).")
      .field("num_ranks", &PlanInput::num_ranks, "W, int32")
      .field("num_experts", &PlanInput::num_experts, "E, int32")
      .field("load_WE", &PlanInput::load_WE,
             "(W * E,) int64 routed pairs L[s][e], row-major; any int array-like is flattened")
      .field("memory", &PlanInput::memory, "MemoryModel")
      .field("recalibration_rate", &PlanInput::recalibration_rate, "c in [0, 1)")
      .field("quota_rule", &PlanInput::quota_rule, "QuotaRule (or its name)")
      .field("replica_slots", &PlanInput::replica_slots, "R spare expert slots per rank, int32")
      .field("symi_slots", &PlanInput::symi_slots, "S slots per GPU for symi (0: ceil(E / W) + R)")
      .field("previous_load_E", &PlanInput::previous_load_E,
             "(E,) int64 previous popularity for symi (empty: the current loads)")
      .field("max_expert_cut", &PlanInput::max_expert_cut,
             "lrmoe keeps at least (1 - this) n_e of every expert")
      .field("backward_row_capacity", &PlanInput::backward_row_capacity,
             "most retained rows per rank (0: memory only)")
      .field("balance_slack", &PlanInput::balance_slack,
             "lrmoe's balance target (1 + this) x the mean retained rows (< 0: off)")
      .field("min_replica_rows", &PlanInput::min_replica_rows, "ultraep u_min")
      .field("joint", &PlanInput::joint,
             "lrmoe: refine on one objective over cuts and replicas (planner/joint.h)")
      .field("replica_cost_rows", &PlanInput::replica_cost_rows,
             "kappa >= 0: one replica's traffic in row-times (joint objective)")
      .field("gpus_per_node", &PlanInput::gpus_per_node,
             "G ranks per node (NVLink domain), node(r) = r / G; 0: one node of all W")
      .field("previous_instance_offsets", &PlanInput::previous_instance_offsets,
             "(E + 1,) int32 the previous plan's instance_offsets (empty: no hysteresis)")
      .field("previous_instance_rank", &PlanInput::previous_instance_rank,
             "(I,) int32 the previous plan's instance_rank")
      .field("previous_instance_rows", &PlanInput::previous_instance_rows,
             "(I,) int64 forward rows of each previous instance")
      .field("replan_threshold", &PlanInput::replan_threshold,
             "in [0, 1): replan only when the max rank time drops by more than this fraction")
      .field("ultraep_refine", &PlanInput::ultraep_refine,
             "ultraep: refinement passes after the bisection (planner/ultraep_refine.h)")
      .field("spare_capacity_split", &PlanInput::spare_capacity_split,
             "forward rows beyond own rank/node dealt in proportion to spare capacity")
      .done();

  Struct<MemoryBreakdown>(m, "MemoryBreakdown", "Per-rank bytes of a layer (planner/plan.h).")
      .field("base_experts", &MemoryBreakdown::base_experts, "owned experts, bytes")
      .field("replicas", &MemoryBreakdown::replicas, "replica copies, bytes")
      .field("forward_tokens", &MemoryBreakdown::forward_tokens, "forward rows, bytes")
      .field("backward_tokens", &MemoryBreakdown::backward_tokens, "retained rows, bytes")
      .def("total", &MemoryBreakdown::total, "the sum of the four parts, bytes")
      .done();

  Struct<Plan>(m, "Plan", "What a policy decides (planner/plan.h Plan).")
      .field("policy", &Plan::policy, "PolicyKind")
      .field("num_ranks", &Plan::num_ranks, "W")
      .field("num_experts", &Plan::num_experts, "E")
      .field("instance_offsets", &Plan::instance_offsets,
             "(E + 1,) int32; expert e's instances are [offsets[e], offsets[e + 1]), owner first")
      .field("instance_rank", &Plan::instance_rank, "(I,) int32 rank of each instance")
      .field("forward_IW", &Plan::forward_IW, "(I * W,) int64 forward rows, row-major")
      .field("retained_IW", &Plan::retained_IW, "(I * W,) int64 retained rows, row-major")
      .field("quota_E", &Plan::quota_E, "(E,) int64 retention quotas")
      .field("fixed_rows_W", &Plan::fixed_rows_W,
             "(W,) int64 rows under fixed ownership (empty where E % W != 0)")
      .field("forward_rows_W", &Plan::forward_rows_W, "(W,) int64 forward rows per rank")
      .field("backward_rows_W", &Plan::backward_rows_W, "(W,) int64 retained rows per rank")
      .field("memory_W", &Plan::memory_W, "list of W MemoryBreakdown")
      .field("limit_bytes", &Plan::limit_bytes, "budget - resident, bytes")
      .field("replicas", &Plan::replicas, "instances beyond the owners")
      .field("feasible", &Plan::feasible, "every rank within its limits")
      .field("binding", &Plan::binding, "Binding")
      .field("binding_rank", &Plan::binding_rank, "the rank furthest over (-1: none)")
      .field("shortfall", &Plan::shortfall, "bytes (memory) or rows over the limit")
      .field("reason", &Plan::reason, "why it does not fit ('' when it fits)")
      .field("forward_bound", &Plan::forward_bound,
             "rows: lower bound on the max forward rows per rank of every plan of the "
             "instance (demand n_E; planner/bound.h)")
      .field("backward_bound", &Plan::backward_bound,
             "rows: lower bound on the max retained rows per rank of every plan with this "
             "plan's quotas (demand quota_E)")
      .field("kept_previous", &Plan::kept_previous, "hysteresis kept the previous placement")
      .field("moved_replicas", &Plan::moved_replicas, "replicas absent from the previous plan")
      .field("moved_bytes", &Plan::moved_bytes, "moved_replicas x expert_weight_bytes")
      .def("num_instances", &Plan::num_instances, "I")
      .def("max_forward_rows", &Plan::max_forward_rows, "max forward rows per rank")
      .def("max_backward_rows", &Plan::max_backward_rows, "max retained rows per rank")
      .done();

  py::enum_<planner::PlacementModel>(m, "PlacementModel",
                                     "Placements the exact optimum ranges over (planner/exact.h).")
      .value("owners", planner::PlacementModel::kOwners)
      .value("free", planner::PlacementModel::kFree);
  using planner::ExactInput;
  using planner::ExactResult;
  Struct<ExactInput>(m, "ExactInput", "An instance for exact_optimum (planner/exact.h).")
      .field("num_ranks", &ExactInput::num_ranks, "W <= 8")
      .field("num_experts", &ExactInput::num_experts, "E <= 16")
      .field("demand_E", &ExactInput::demand_E, "(E,) int64 rows per expert")
      .field("model", &ExactInput::model, "PlacementModel (or its name)")
      .field("slots", &ExactInput::slots,
             "owners: replica slots per rank R <= 2; free: instance slots per rank S")
      .field("limit_bytes", &ExactInput::limit_bytes, "bytes per rank (row_bytes 0: no memory)")
      .field("base_bytes", &ExactInput::base_bytes, "bytes of every rank's fixed copies")
      .field("replica_bytes", &ExactInput::replica_bytes, "bytes of one replica (owners)")
      .field("row_bytes", &ExactInput::row_bytes, "bytes per row (0: no memory limit)")
      .field("max_nodes", &ExactInput::max_nodes, "placements the search may visit")
      .done();
  Struct<ExactResult>(m, "ExactResult", "The exact optimum (planner/exact.h).")
      .field("feasible", &ExactResult::feasible, "some placement fits the memory")
      .field("proven", &ExactResult::proven, "the search finished (else: best found)")
      .field("optimum", &ExactResult::optimum, "rows: min of the max rows per rank")
      .field("lower_bound", &ExactResult::lower_bound, "rows: the counting bound")
      .field("nodes", &ExactResult::nodes, "placements visited")
      .field("holds_EW", &ExactResult::holds_EW, "(E * W,) int32 1 where an instance is")
      .field("rows_EW", &ExactResult::rows_EW, "(E * W,) int64 rows of an optimal split")
      .done();
  m.def("exact_optimum", &planner::exact_optimum, py::arg("input"),
        "exact_optimum(input: ExactInput) -> ExactResult: min over placements and integer "
        "splits of the max rows per rank (planner/exact.h).\n\nRaises ValueError naming "
        "the field (W > 8, E > 16, slots over the limit, ...).");
  m.def(
      "exact_input",
      [](const PlanInput& input, planner::PlacementModel model, py::handle demand_E,
         bool with_memory) {
        std::vector<int64_t> d;
        if (!demand_E.is_none()) d = int_vector<int64_t>(demand_E, "demand_E");
        return planner::exact_input(input, model, d, with_memory);
      },
      py::arg("input"), py::arg("model"), py::arg("demand_E") = py::none(),
      py::arg("with_memory") = true,
        "exact_input(input: PlanInput, model, demand_E=None, with_memory=True) -> ExactInput: "
        "the instance of a plan's input (planner/exact.h).");

  m.def(
      "plan",
      [](const std::string& policy, const PlanInput& input) {
        check_slots(input);
        return planner::make_plan(policy, input);
      },
      py::arg("policy"), py::arg("input"),
      "plan(policy, input) -> Plan: plan `input` with the policy named fixed, ultraep, symi "
      "or lrmoe (planner::make_plan).\n\nRaises ValueError naming the bad field (the "
      "planner's std::invalid_argument messages).");
}

}  // namespace python
}  // namespace lrmoe
