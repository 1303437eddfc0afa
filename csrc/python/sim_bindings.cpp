// lrmoe._C.sim: the cluster simulator (csrc/sim/sim.h) bound as a program -- its cost,
// link and run settings and its per-layer results as structs with named fields, and its
// entry points. lrmoe/sim/simulate.py is its Python face; docs/simulation.md gives every
// formula.
//
// Legend (sim/sim.h): S steps, Lyr layers, W ranks, E experts; times ms, bytes plain,
// bandwidths GB/s. Loads come in as int numpy arrays (S, Lyr, W, E); the GIL is released
// while the simulator runs (simulate_trace runs on its own threads).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <string>
#include <vector>

#include "python/bindings.h"
#include "python/fields.h"
#include "sim/cluster.h"
#include "sim/sim.h"

namespace lrmoe {
namespace python {
namespace {

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "(";
  for (size_t j = 0; j < shape.size(); ++j) s += (j ? ", " : "") + std::to_string(shape[j]);
  return s + (shape.size() == 1 ? ",)" : ")");
}

// The loads of `input`'s W x E cluster, with `dims` leading axes; their leading sizes.
std::vector<int64_t> cluster_loads(py::handle v, const char* name, const char* axes,
                                   size_t dims, const planner::PlanInput& input,
                                   std::vector<int64_t>* lead) {
  std::vector<int64_t> shape;
  std::vector<int64_t> out = int_vector<int64_t>(v, name, &shape);
  if (shape.size() != dims + 2 || shape[dims] != input.num_ranks ||
      shape[dims + 1] != input.num_experts)
    throw py::value_error(std::string(name) + " must be " + axes + "W=" +
                          std::to_string(input.num_ranks) + ", E=" +
                          std::to_string(input.num_experts) +
                          ") (input.num_ranks, input.num_experts), got shape " +
                          shape_text(shape));
  lead->assign(shape.begin(), shape.begin() + static_cast<std::ptrdiff_t>(dims));
  return out;
}

}  // namespace

void bind_sim(py::module_ m) {
  using sim::CostModel;
  using sim::GemmPoint;
  using sim::LayerResult;
  using sim::LinkModel;
  using sim::PerRowCosts;
  using sim::PressureResult;
  using sim::SimConfig;

  Struct<GemmPoint>(m, "GemmPoint", "One calibrated grouped-GEMM point of one rank.")
      .field("experts", &GemmPoint::experts, "experts per rank")
      .field("rows", &GemmPoint::rows, "rows per expert")
      .field("fwd_ms", &GemmPoint::fwd_ms, "forward ms")
      .field("bwd_ms", &GemmPoint::bwd_ms, "backward ms")
      .done();

  // the names are lrmoe/sim/costs.py PER_ROW's, which fills them by name
  Struct<PerRowCosts>(m, "PerRowCosts", "ms per routed (or retained) row of each non-GEMM step.")
      .field("router", &PerRowCosts::router, "ms per source pair, forward")
      .field("permute", &PerRowCosts::permute, "ms per source pair, forward")
      .field("combine", &PerRowCosts::combine, "ms per source pair, forward")
      .field("fwd_rest", &PerRowCosts::fwd_rest, "ms per source pair, forward")
      .field("router_grad", &PerRowCosts::router_grad, "ms per source pair, backward")
      .field("score", &PerRowCosts::score, "ms per source pair, backward")
      .field("select", &PerRowCosts::select, "ms per source pair, backward")
      .field("bwd_rest", &PerRowCosts::bwd_rest, "ms per source pair, backward")
      .field("compact", &PerRowCosts::compact, "ms per retained row on the expert rank")
      .field("scatter", &PerRowCosts::scatter, "ms per retained row on the source rank")
      .field("ep_fwd", &PerRowCosts::ep_fwd, "EP layer's own ms per forward row (W > 1)")
      .field("ep_bwd", &PerRowCosts::ep_bwd, "EP layer's own ms per retained row (W > 1)")
      .done();

  Struct<sim::Roofline>(m, "Roofline", "The expert GEMMs' floor (sim/roofline.h; off at peak 0).")
      .field("peak_TFLOPs", &sim::Roofline::peak_TFLOPs, "dense bf16 TFLOP/s (0: no roofline)")
      .field("hbm_GBps", &sim::Roofline::hbm_GBps, "device memory GB/s")
      .field("launch_us", &sim::Roofline::launch_us, "us per grouped-GEMM pass of one rank")
      .field("hidden", &sim::Roofline::hidden, "H of one expert")
      .field("inter", &sim::Roofline::inter, "I of one expert")
      .field("elem_bytes", &sim::Roofline::elem_bytes, "bytes per element (bf16: 2)")
      .done();

  Struct<CostModel>(m, "CostModel", "The calibrated cost model (lrmoe calibrate).")
      .field("gemm", &CostModel::gemm, "list of GemmPoint, any order, at least one")
      .field("per_row", &CostModel::per_row, "PerRowCosts")
      .field("h2d_GBps", &CostModel::h2d_GBps, "host <-> device GB/s (0: offload not timed)")
      .field("roofline", &CostModel::roofline, "Roofline")
      .done();

  Struct<LinkModel>(m, "LinkModel", "All-to-all links per GPU (configs/links/*.yaml).")
      .field("gpus_per_node", &LinkModel::gpus_per_node, "G")
      .field("intra_GBps", &LinkModel::intra_GBps, "NVLink GB/s")
      .field("intra_latency_us", &LinkModel::intra_latency_us, "NVLink us per collective")
      .field("inter_GBps", &LinkModel::inter_GBps, "network GB/s")
      .field("inter_latency_us", &LinkModel::inter_latency_us, "network us per collective")
      .field("self_GBps", &LinkModel::self_GBps, "device copy of a rank's own rows (0: free)")
      .field("per_peer_us", &LinkModel::per_peer_us, "us per distinct peer of a link class")
      .field("chunks", &LinkModel::chunks, "network/NVLink phases pipelined over (1: in sequence)")
      .field("overlap_chunks", &LinkModel::overlap_chunks,
             "all-to-alls pipelined with the expert GEMMs over (1: in sequence)")
      .field("overlap_tile_rows", &LinkModel::overlap_tile_rows,
             "rows per GEMM tile of the tile-level overlap (0: off)")
      .field("overlap_comm_share", &LinkModel::overlap_comm_share,
             "share of the SMs given to communication under tile-level overlap, [0, 1)")
      .done();

  // the whole model's activations under batch pressure (sim/activations.h)
  py::enum_<sim::ActivationMode>(m, "ActivationMode",
                                 "What each layer keeps between forward and backward "
                                 "(sim/activations.h).")
      .value("layer", sim::ActivationMode::kLayer)
      .value("keep", sim::ActivationMode::kKeep)
      .value("recompute", sim::ActivationMode::kRecompute)
      .value("offload", sim::ActivationMode::kOffload);
  Struct<sim::ActivationModel>(m, "ActivationModel",
                               "Per-token / per-row activation bytes of one layer and the "
                               "layers held (sim/activations.h).")
      .field("mode", &sim::ActivationModel::mode, "ActivationMode (layer: none, the old model)")
      .field("layers", &sim::ActivationModel::layers, "layers held on a GPU, the planned one included")
      .field("top_k", &sim::ActivationModel::top_k, "K routed rows per token")
      .field("dense_token_bytes", &sim::ActivationModel::dense_token_bytes,
             "saved per token per layer outside the experts (attention, norms, router)")
      .field("moe_row_bytes", &sim::ActivationModel::moe_row_bytes,
             "saved per routed row per layer by the experts (forward_row_bytes)")
      .field("offload_row_bytes", &sim::ActivationModel::offload_row_bytes,
             "of moe_row_bytes, what offload moves to the host")
      .field("input_token_bytes", &sim::ActivationModel::input_token_bytes,
             "a layer's input per token (H x elem_bytes), kept under recompute")
      .done();
  Struct<sim::ActivationBytes>(m, "ActivationBytes",
                               "Activation bytes on one GPU by part (sim/activations.h).")
      .field("dense", &sim::ActivationBytes::dense, "attention + norms")
      .field("moe", &sim::ActivationBytes::moe, "saved expert rows of the other layers")
      .field("inputs", &sim::ActivationBytes::inputs, "recompute: the other layers' inputs")
      .done();
  m.def(
      "activation_bytes",
      [](const sim::ActivationModel& model, int64_t tokens) {
        return sim::activation_bytes(model, tokens);
      },
      py::arg("model"), py::arg("tokens"),
      "activation_bytes(model, tokens) -> ActivationBytes of `tokens` tokens per GPU "
      "(sim/activations.h gives the formulas).\n\nRaises ValueError naming the bad field.");
  m.def(
      "tokens_per_gpu",
      [](py::handle load_WE, int32_t W, int32_t E, int32_t K) {
        return sim::tokens_per_gpu(int_vector<int64_t>(load_WE, "load_WE"), W, E, K);
      },
      py::arg("load_WE"), py::arg("num_ranks"), py::arg("num_experts"), py::arg("top_k"),
      "tokens_per_gpu(load_WE, W, E, K) -> the largest source rank's ceil(sum_e L[s][e] / K).");

  Struct<SimConfig>(m, "SimConfig", "Costs, links and sizes of a simulated layer.")
      .field("cost", &SimConfig::cost, "CostModel")
      .field("link", &SimConfig::link, "LinkModel")
      .field("hidden", &SimConfig::hidden, "H")
      .field("elem_bytes", &SimConfig::elem_bytes, "bytes per activation element (bf16: 2)")
      .field("offload", &SimConfig::offload, "saved activations in host memory")
      .field("offload_row_bytes", &SimConfig::offload_row_bytes,
             "saved bytes per forward row moved to the host")
      .field("per_rank_bytes", &SimConfig::per_rank_bytes, "fill LayerResult.sent_bytes_5W")
      .field("top_k", &SimConfig::top_k, "experts per token for the all-to-all dedup (1: none)")
      .field("replan_threshold", &SimConfig::replan_threshold,
             "hysteresis across steps in simulate_trace / simulate_cluster / "
             "simulate_pressure_trace: < 0 off, else in [0, 1) (sim/sim.h)")
      .field("resident_replicas", &SimConfig::resident_replicas,
             "replicas keep their slot between steps: moved ones fetch their weights in the "
             "layer (move_ms), all are refreshed after the optimizer step (broadcast_ms); "
             "False: weights stream per layer (sim/sim.h)")
      .field("activations", &SimConfig::activations,
             "ActivationModel of batch pressure (mode layer: none)")
      .done();

  // lrmoe/sim/simulate.py FIELDS (its result keys) are derived from these fields, in
  // this order: keep the order of sim/sim.h LayerResult
  Struct<LayerResult>(m, "LayerResult", "One MoE layer of one step, simulated (sim/sim.h).")
      .field("feasible", &LayerResult::feasible, "the plan fits")
      .field("binding", &LayerResult::binding, "lrmoe._C.planner.Binding")
      .field("reason", &LayerResult::reason, "the planner's, when infeasible")
      .field("fwd_ms", &LayerResult::fwd_ms, "forward ms (NaN when infeasible)")
      .field("bwd_ms", &LayerResult::bwd_ms, "backward ms")
      .field("src_fwd_ms", &LayerResult::src_fwd_ms, "ms")
      .field("dispatch_ms", &LayerResult::dispatch_ms, "ms")
      .field("expert_fwd_ms", &LayerResult::expert_fwd_ms, "ms")
      .field("combine_ms", &LayerResult::combine_ms, "ms")
      .field("src_bwd_ms", &LayerResult::src_bwd_ms, "ms")
      .field("grad_a2a_ms", &LayerResult::grad_a2a_ms, "ms")
      .field("expert_bwd_ms", &LayerResult::expert_bwd_ms, "ms")
      .field("dx_a2a_ms", &LayerResult::dx_a2a_ms, "ms")
      .field("replica_ms", &LayerResult::replica_ms, "exposed ms")
      .field("offload_ms", &LayerResult::offload_ms, "exposed ms")
      .field("overlap_fwd_ms", &LayerResult::overlap_fwd_ms,
             "ms the a2a / GEMM overlap saves in the forward (negative: chunking costs)")
      .field("overlap_bwd_ms", &LayerResult::overlap_bwd_ms, "the same in the backward")
      .field("fwd_link_bytes", &LayerResult::fwd_link_bytes, "bytes over links, all ranks")
      .field("bwd_link_bytes", &LayerResult::bwd_link_bytes, "bytes over links, all ranks")
      .field("replica_bytes", &LayerResult::replica_bytes, "bytes")
      .field("offload_bytes", &LayerResult::offload_bytes, "bytes")
      .field("sent_bytes_5W", &LayerResult::sent_bytes_5W,
             "(5 * W,) int64 bytes each rank sends into forward_dispatch, forward_combine, "
             "backward_grad, backward_index, backward_dx (empty unless per_rank_bytes)")
      .field("memory_max", &LayerResult::memory_max,
             "lrmoe._C.planner.MemoryBreakdown: each part's maximum over ranks")
      .field("memory_peak", &LayerResult::memory_peak, "the largest rank's total, bytes")
      .field("limit_bytes", &LayerResult::limit_bytes, "budget - resident, bytes")
      .field("replicas", &LayerResult::replicas, "instances beyond the owners")
      .field("pairs", &LayerResult::pairs, "routed pairs")
      .field("retained", &LayerResult::retained, "retained pairs")
      .field("fwd_imbalance", &LayerResult::fwd_imbalance, "max / mean forward rows per rank")
      .field("bwd_imbalance", &LayerResult::bwd_imbalance, "max / mean retained rows per rank")
      .field("owned_experts_max", &LayerResult::owned_experts_max,
             "the most experts a rank owns (first copies; step terms)")
      .field("broadcast_ms", &LayerResult::broadcast_ms,
             "the weight broadcast of this layer's copies after the optimizer step: symi's, or "
             "every replica's under resident_replicas (0 otherwise)")
      .field("kept_previous", &LayerResult::kept_previous,
             "hysteresis kept the layer's previous-step placement")
      .field("moved_replicas", &LayerResult::moved_replicas,
             "replicas absent from the previous-step placement (0 when it is not known)")
      .field("move_ms", &LayerResult::move_ms,
             "resident_replicas: the moved replicas' weight fetch, ms in fwd_ms")
      .field("move_bytes", &LayerResult::move_bytes, "its bytes over links (in replica_bytes)")
      .done();

  Struct<PressureResult>(m, "PressureResult", "Batch pressure of one layer (sim/sim.h).")
      .field("micro_batches", &PressureResult::micro_batches, "micro-batches (0: none fits)")
      .field("time_ms", &PressureResult::time_ms,
             "k x (fwd + bwd [+ fwd under recompute]); NaN when none fits")
      .field("layer", &PressureResult::layer, "LayerResult of the micro-batch that fits")
      .field("activation_bytes", &PressureResult::activation_bytes,
             "that micro-batch's all-layer activation bytes, added to the resident")
      .field("recompute_ms", &PressureResult::recompute_ms,
             "k x fwd under recompute (part of time_ms; 0 otherwise)")
      .done();

  m.def(
      "simulate_layer",
      [](const std::string& policy, const planner::PlanInput& input, const SimConfig& config) {
        check_slots(input);
        return sim::simulate_layer(policy, input, config);
      },
      py::arg("policy"), py::arg("input"), py::arg("config"),
      "simulate_layer(policy, input, config) -> LayerResult: plan input.load_WE, then time "
      "it.\n\nRaises ValueError naming the bad field.");

  m.def(
      "simulate_trace",
      [](const std::string& policy, const planner::PlanInput& input, py::handle loads_SLWE,
         const SimConfig& config, int32_t threads, py::handle previous_LWE) {
        check_slots(input);
        std::vector<int64_t> lead, prev_lead;
        const std::vector<int64_t> loads = cluster_loads(
            loads_SLWE, "loads_SLWE", "(steps, layers, ", 2, input, &lead);
        std::vector<int64_t> prev;
        if (!previous_LWE.is_none()) {
          prev = cluster_loads(previous_LWE, "previous_LWE", "(layers, ", 1, input, &prev_lead);
          if (prev_lead[0] != lead[1])
            throw py::value_error("previous_LWE must hold the " + std::to_string(lead[1]) +
                                  " layers of loads_SLWE, got " + std::to_string(prev_lead[0]));
        }
        const planner::PlanInput base = input;  // copies: Python may not touch them meanwhile
        const SimConfig cfg = config;
        std::vector<LayerResult> out;
        {
          py::gil_scoped_release nogil;
          out = sim::simulate_trace(policy, base, loads, lead[0], lead[1], cfg, threads,
                                    prev.empty() ? nullptr : &prev);
        }
        py::list results;
        for (auto& r : out) results.append(py::cast(std::move(r)));
        return results;
      },
      py::arg("policy"), py::arg("input"), py::arg("loads_SLWE"), py::arg("config"),
      py::arg("threads") = 1, py::arg("previous_LWE") = py::none(),
      "simulate_trace(policy, input, loads_SLWE, config, threads=1, previous_LWE=None) -> "
      "list of S x Lyr LayerResult in (step, layer) order.\n\nloads_SLWE: (S, Lyr, W, E) "
      "ints for input's W, E (input.load_WE is not read); previous_LWE: (Lyr, W, E), the "
      "step before (symi's popularity for the first step). Raises ValueError naming the "
      "bad argument or field.");

  m.def(
      "simulate_pressure_trace",
      [](const std::string& policy, const planner::PlanInput& input, py::handle loads_SLWE,
         double multiplier, int32_t max_micro_batches, const SimConfig& config,
         int32_t threads) {
        check_slots(input);
        std::vector<int64_t> lead;
        const std::vector<int64_t> loads = cluster_loads(
            loads_SLWE, "loads_SLWE", "(steps, layers, ", 2, input, &lead);
        const planner::PlanInput base = input;
        const SimConfig cfg = config;
        std::vector<sim::PressureResult> out;
        {
          py::gil_scoped_release nogil;
          out = sim::simulate_pressure_trace(policy, base, loads, lead[0], lead[1], multiplier,
                                             max_micro_batches, cfg, threads);
        }
        py::list results;
        for (auto& r : out) results.append(py::cast(std::move(r)));
        return results;
      },
      py::arg("policy"), py::arg("input"), py::arg("loads_SLWE"), py::arg("multiplier"),
      py::arg("max_micro_batches"), py::arg("config"), py::arg("threads") = 1,
      "simulate_pressure_trace(policy, input, loads_SLWE, multiplier, max_micro_batches, "
      "config, threads=1) -> list of S x Lyr PressureResult in (step, layer) order; with "
      "config.replan_threshold >= 0 each layer's steps in order, hysteresis against the "
      "previous step's plan (sim/sim.h).\n\nRaises ValueError naming the bad argument.");

  m.def(
      "derived_replica_cost_rows",
      [](const SimConfig& config, int64_t weight_bytes, double experts_per_rank,
         double rows_per_expert) {
        return sim::derived_replica_cost_rows(config, weight_bytes, experts_per_rank,
                                              rows_per_expert);
      },
      py::arg("config"), py::arg("weight_bytes"), py::arg("experts_per_rank"),
      py::arg("rows_per_expert"),
      "derived_replica_cost_rows(config, weight_bytes, experts_per_rank, rows_per_expert) -> "
      "int kappa = round(t_w / t_row): one replica's weight transfer over NVLink, "
      "weight_bytes / intra_GBps + intra latency, over one row of expert compute, the "
      "calibrated forward and backward GEMM at (k, k x rows) averaged per row (sim/sim.h)."
      "\n\nRaises ValueError for weight_bytes < 0 or a size <= 0.");

  Struct<sim::ClusterLayer>(m, "ClusterLayer", "One (step, layer) of a cluster (sim/cluster.h).")
      .field("feasible", &sim::ClusterLayer::feasible, "every group's plan fits")
      .field("time_ms", &sim::ClusterLayer::time_ms, "slowest group's fwd + bwd (NaN: infeasible)")
      .field("slowest_group", &sim::ClusterLayer::slowest_group, "its group (-1: none)")
      .field("mean_group_ms", &sim::ClusterLayer::mean_group_ms, "mean over feasible groups")
      .field("owned_experts_max", &sim::ClusterLayer::owned_experts_max,
             "the most experts a rank owns, max over groups")
      .field("broadcast_ms", &sim::ClusterLayer::broadcast_ms,
             "symi's broadcast of the layer's copies, slowest group (NaN: infeasible)")
      .done();

  Struct<sim::StepModel>(m, "StepModel", "The model outside the MoE layers (sim/step.h).")
      .field("dp_size", &sim::StepModel::dp_size, "EP groups (data-parallel copies), >= 1")
      .field("dense_grad_bytes", &sim::StepModel::dense_grad_bytes,
             "dense gradient bytes per rank")
      .field("dense_params", &sim::StepModel::dense_params, "dense parameters per rank")
      .field("expert_params", &sim::StepModel::expert_params, "one expert's parameters")
      .field("hbm_GBps", &sim::StepModel::hbm_GBps, "device memory GB/s (for Adam)")
      .field("moe_layers", &sim::StepModel::moe_layers,
             "MoE layers the simulated ones stand for (0: as simulated)")
      .done();

  Struct<sim::StepTerms>(m, "StepTerms", "A step's terms outside the MoE layers, ms (sim/step.h).")
      .field("expert_allreduce_ms", &sim::StepTerms::expert_allreduce_ms,
             "owned experts' gradients, ring over the groups")
      .field("dense_allreduce_ms", &sim::StepTerms::dense_allreduce_ms,
             "dense gradients, ring over all GPUs")
      .field("optimizer_ms", &sim::StepTerms::optimizer_ms, "Adam, bandwidth-bound")
      .field("broadcast_ms", &sim::StepTerms::broadcast_ms, "symi's weight broadcast")
      .done();

  Struct<sim::ClusterStep>(m, "ClusterStep", "One step of a cluster (sim/cluster.h).")
      .field("feasible", &sim::ClusterStep::feasible, "every layer of every group fits")
      .field("moe_ms", &sim::ClusterStep::moe_ms, "MoE layers, slowest group each (NaN: infeasible)")
      .field("mean_group_moe_ms", &sim::ClusterStep::mean_group_moe_ms, "the mean group's")
      .field("terms", &sim::ClusterStep::terms, "StepTerms")
      .done();

  m.def(
      "cluster_steps",
      [](py::sequence layers_SL, int64_t steps, int64_t layers, int32_t num_ranks,
         double expert_grad_bytes, const sim::LinkModel& link, const sim::StepModel& model) {
        std::vector<sim::ClusterLayer> in;  // no pybind11/stl.h here: element by element
        in.reserve(py::len(layers_SL));
        for (py::handle h : layers_SL) {
          if (!py::isinstance<sim::ClusterLayer>(h))
            throw py::type_error("layers_SL must hold ClusterLayer (simulate_cluster's "
                                 "results), got " + std::string(py::str(py::type::of(h))));
          in.push_back(h.cast<sim::ClusterLayer>());
        }
        py::list out;
        for (auto& st : sim::cluster_steps(in, steps, layers, num_ranks, expert_grad_bytes,
                                           link, model))
          out.append(py::cast(std::move(st)));
        return out;
      },
      py::arg("layers_SL"), py::arg("steps"), py::arg("layers"), py::arg("num_ranks"),
      py::arg("expert_grad_bytes"), py::arg("link"), py::arg("model"),
      "cluster_steps(layers_SL, steps, layers, num_ranks, expert_grad_bytes, link, model) -> "
      "list of S ClusterStep: simulate_cluster's S x Lyr results summed per step (scaled to "
      "model.moe_layers) plus the step terms of sim/step.h.\n\nRaises ValueError when "
      "layers_SL is not S x Lyr long or a StepModel field is out of range (naming it).");

  m.def(
      "simulate_cluster",
      [](const std::string& policy, const planner::PlanInput& input, py::handle loads_SGLWE,
         const SimConfig& config, int32_t threads, py::handle previous_GLWE) {
        check_slots(input);
        std::vector<int64_t> lead, prev_lead;
        const std::vector<int64_t> loads = cluster_loads(
            loads_SGLWE, "loads_SGLWE", "(steps, groups, layers, ", 3, input, &lead);
        std::vector<int64_t> prev;
        if (!previous_GLWE.is_none()) {
          prev = cluster_loads(previous_GLWE, "previous_GLWE", "(groups, layers, ", 2, input,
                               &prev_lead);
          if (prev_lead[0] != lead[1] || prev_lead[1] != lead[2])
            throw py::value_error("previous_GLWE must hold the groups x layers of loads_SGLWE");
        }
        const planner::PlanInput base = input;
        const SimConfig cfg = config;
        std::vector<sim::ClusterLayer> out;
        {
          py::gil_scoped_release nogil;
          out = sim::simulate_cluster(policy, base, loads, lead[0], lead[1], lead[2], cfg,
                                      threads, prev.empty() ? nullptr : &prev);
        }
        py::list results;
        for (auto& r : out) results.append(py::cast(std::move(r)));
        return results;
      },
      py::arg("policy"), py::arg("input"), py::arg("loads_SGLWE"), py::arg("config"),
      py::arg("threads") = 1, py::arg("previous_GLWE") = py::none(),
      "simulate_cluster(policy, input, loads_SGLWE, config, threads=1, previous_GLWE=None) "
      "-> list of S x Lyr ClusterLayer in (step, layer) order: every group of the cluster "
      "on its own loads, the slowest deciding.\n\nloads_SGLWE: (S, Gr, Lyr, W, E) ints for "
      "input's W, E; previous_GLWE: (Gr, Lyr, W, E), the step before. Raises ValueError "
      "naming the bad argument or field.");

  m.def(
      "simulate_pressure",
      [](const std::string& policy, const planner::PlanInput& input, double multiplier,
         int32_t max_micro_batches, const SimConfig& config) {
        check_slots(input);
        const planner::PlanInput base = input;
        const SimConfig cfg = config;
        py::gil_scoped_release nogil;
        return sim::simulate_pressure(policy, base, multiplier, max_micro_batches, cfg);
      },
      py::arg("policy"), py::arg("input"), py::arg("multiplier"), py::arg("max_micro_batches"),
      py::arg("config"),
      "simulate_pressure(policy, input, multiplier, max_micro_batches, config) -> "
      "PressureResult: input.load_WE x multiplier, split into up to max_micro_batches "
      "micro-batches until one fits.\n\nRaises ValueError naming the bad argument or field.");
}

}  // namespace python
}  // namespace lrmoe
