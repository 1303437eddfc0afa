// The cluster simulator: replays routed loads through a placement policy
// (csrc/planner) and a cost model to predict per-layer time, traffic and memory
// (docs/simulation.md describes every formula; the numbers it gives are simulated).
//
// Plain C++17, no torch: tests/cpp/test_sim.cpp checks it on hand-computed toy
// clusters, tests/cpp/bench_sim.cpp times it, csrc/python/sim_bindings.cpp binds it for
// lrmoe/sim/simulate.py.
//
// Legend: W ranks of the expert-parallel group (nodes of G GPUs), E experts,
// I instances of a plan, L_WE routed pairs from source s to expert e, F_IW / B_IW
// forward / retained rows of (instance, source) cells (planner/plan.h), M_WW rows
// sent from rank s (row) to rank d (column). Times in ms, bytes plain bytes,
// bandwidths GB/s (1e9 bytes per second).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "planner/plan.h"
#include "sim/activations.h"
#include "sim/roofline.h"

namespace lrmoe {
namespace sim {

// Grouped-GEMM time of one rank, measured (lrmoe calibrate) over a grid of experts
// per rank k and rows per expert r.
struct GemmPoint {
  double experts = 0, rows = 0, fwd_ms = 0, bwd_ms = 0;
};

// ms per routed pair (or per retained pair) of every non-GEMM step of one MoE layer.
struct PerRowCosts {
  double router = 0, permute = 0, combine = 0, fwd_rest = 0;   // per source pair, forward
  double router_grad = 0, score = 0, select = 0, bwd_rest = 0; // per source pair, backward
  double compact = 0;   // per retained row on the expert rank
  double scatter = 0;   // per retained row on the source rank
  // the expert-parallel layer's own work beyond the one-device layer and its
  // all-to-alls (counts exchange, re-sorts, gathers; lrmoe/calibrate_ep.py), per forward
  // / retained row on the expert rank; charged only when W > 1 (an EP group of one is
  // the one-device layer). Measured at c = 0, where every row is retained: that the
  // backward part scales with retained rather than forward rows is an assumption
  double ep_fwd = 0, ep_bwd = 0;
};

struct CostModel {
  std::vector<GemmPoint> gemm;  // any order; at least one point
  PerRowCosts per_row;
  double h2d_GBps = 0;          // host <-> device, for offload (0: offload not timed)
  Roofline roofline;            // the expert GEMMs' floor (roofline.h; off when peak is 0)
};

// All-to-all links: per-GPU bandwidth and latency within a node and between nodes.
struct LinkModel {
  int32_t gpus_per_node = 8;
  double intra_GBps = 0, intra_latency_us = 0;  // NVLink
  double inter_GBps = 0, inter_latency_us = 0;  // network (RDMA)
  // rows a rank sends itself never touch a link, but NCCL copies them on the device:
  // GB/s of that copy (bytes counted once; 0: free)
  double self_GBps = 0;
  // us per distinct peer a rank exchanges with over a link class, on top of that
  // class's latency (a2a.h hierarchical_a2a_ms; 0: one latency per class)
  double per_peer_us = 0;
  // chunks the network and NVLink phases of a hierarchical all-to-all are pipelined
  // over (1: in sequence; a2a.h hierarchical_a2a_ms)
  int32_t chunks = 1;
  // chunks a layer's token all-to-alls are pipelined with its expert GEMMs over (the
  // dispatcher splits the rows and runs chunk i's GEMM while chunk i + 1 is dispatched
  // and chunk i - 1 combined; sim.cpp pipelined_ms). 1: phases in sequence (the model
  // before issue 30's overlap); each chunk pays the collectives' latencies again and runs
  // its GEMMs on 1 / overlap_chunks of the rows (the calibrated curve at those rows)
  int32_t overlap_chunks = 1;
  // tile-level overlap inside one fused kernel (the Comet approach; docs/simulation.md,
  // "Compute / all-to-all overlap"): > 0 rows per GEMM tile, 0 off. Rows arrive and leave
  // tile by tile while the GEMMs run at their whole size, so the collectives pay their
  // latencies once (not once per chunk) and the GEMMs are not split; the GEMMs and the
  // EP layer's own row work run on the SMs the communication leaves them
  // (1 - overlap_comm_share). Per rank: max(a2a, compute) + min(a2a, compute) / tiles
  // (the first tile in and the last one out, not hidden), a2a the dispatch plus combine
  // (forward) or gradient plus dx (backward) phases of the slowest rank (sim.cpp
  // tiled_ms). Exclusive with overlap_chunks > 1 (two models of one overlap).
  int32_t overlap_tile_rows = 0;
  // share of the GPU's SMs the fused kernel gives to communication, in [0, 1); the
  // links keep their bandwidth (an assumption: DeepEP's README reports near-peak NVLink
  // bandwidth from 20-24 of 132 SMs). Used only with overlap_tile_rows > 0
  double overlap_comm_share = 0;
};

struct SimConfig {
  CostModel cost;
  LinkModel link;
  int64_t hidden = 0;            // H
  int64_t elem_bytes = 2;        // bytes per activation element (bf16: 2)
  bool offload = false;          // saved activations in host memory
  int64_t offload_row_bytes = 0; // saved bytes per forward row moved to the host
  bool per_rank_bytes = false;   // fill LayerResult::sent_bytes_5W (5 W numbers per layer)
  // experts per token K for the all-to-all's dedup (a2a.h expected_dispatch): a token
  // crosses to a rank or a remote node once however many of its K experts sit there.
  // 1: every (token, expert) pair is its own row, which is what lrmoe's own EP layer
  // sends (lrmoe/parallel); K > 1 models a deduplicating dispatcher (DeepEP-style)
  int32_t top_k = 1;
  // batch pressure only (simulate_pressure): the activations every other layer of the
  // model holds at the step's peak, added to the resident (activations.h); mode kLayer
  // (the default, and the model before issue 30): none
  ActivationModel activations;
  // Hysteresis across steps (planner/hysteresis.h) in simulate_trace, simulate_cluster and
  // simulate_pressure_trace: < 0 off (every cell planned alone); in [0, 1) each layer's
  // plan keeps the placement of that layer's plan one step earlier unless a fresh plan's
  // max rank time is lower by more than this fraction (PlanInput::replan_threshold).
  // Policies fixed, ultraep and lrmoe; symi is refused (its slots move every step).
  double replan_threshold = -1.0;
  // Where replica weights live (ultraep, lrmoe; symi has its own model, step.h):
  // false (the model of every figure): a replica's slot is reused across layers, so its
  // weights stream to it per layer, for the forward and again for the backward, and a
  // moved replica costs nothing a kept one does not. true: a replica keeps its slot and
  // weights from step to step (one slot per layer); a kept replica's weights are
  // refreshed after the optimizer step, as symi's copies are (LayerResult::broadcast_ms,
  // a step term), and only a replica absent from the layer's previous-step placement
  // (every replica on a layer's first step) fetches its weights from the owner inside
  // the layer (LayerResult::move_ms). The memory of the other layers' resident replicas
  // is not added to the resident (one layer's memory, as the figures count it).
  bool resident_replicas = false;
};

// The grid grouped by experts per rank, each curve sorted by rows (built once per layer).
class GemmTable {
 public:
  // Throws std::invalid_argument on an empty grid (run `lrmoe calibrate`) or a roofline
  // set with bad fields (Roofline::enabled). With a roofline (peak_TFLOPs > 0) every time
  // is at least its floor, and a curve beyond its last measured rows adds the roofline's
  // time for the extra rows at the grid's marginal efficiency (its largest measured
  // segment's roofline time over measured time, at most 1); without one, the curve's
  // last slope (its last point's ms per row where that slope is <= 0).
  explicit GemmTable(const std::vector<GemmPoint>& grid, const Roofline& roofline = Roofline());
  // The grouped-GEMM time of a rank holding k instances with `rows` rows in all: the
  // grid interpolated at (k, rows / k); see docs/simulation.md, "Cost model".
  double ms(double k, double rows, bool backward) const;
  // The grouped-GEMM time of a rank whose instances have rows_I rows each (those with 0
  // rows run nothing): the k-expert curve taken at every instance's own rows and
  // averaged, then interpolated along k as ms() does; equal to ms() when the rows are
  // even. A skewed rank costs more than its mean where the curve is flat (small
  // experts are launch-bound); docs/simulation.md, "Cost model".
  double ms_instances(const std::vector<double>& rows_I, bool backward) const;

 private:
  // v(curve index) interpolated along the experts-per-rank grid at k (ms() and
  // ms_instances() share it)
  template <typename F>
  double along_k(double k, F v) const;
  Roofline roof_;
  bool has_roof_ = false;
  double eta_fwd_ = 1.0, eta_bwd_ = 1.0;  // marginal efficiency beyond the grid's rows
  std::vector<double> k_;                                  // ascending experts per rank
  std::vector<std::vector<std::pair<double, double>>> fwd_, bwd_;  // (rows, ms) per k
};

// GemmTable(grid).ms(k, rows, backward).
double gemm_ms(const std::vector<GemmPoint>& grid, double k, double rows, bool backward);

// Time of one all-to-all with row matrix M_WW (M[s][d] rows from s to d, row_bytes
// each, every row its own token: no dedup): the hierarchical model of a2a.h (network
// rows to the destination node's proxy, forwarded over NVLink; hierarchical_a2a_ms with
// link.per_peer_us and link.chunks; rows to itself a device copy at self_GBps).
// link_bytes: bytes over links, a forwarded row on both hops. The layer time uses the
// same functions (one implementation).
double all_to_all_ms(const std::vector<int64_t>& M_WW, int32_t W, double row_bytes,
                     const LinkModel& link, double* link_bytes = nullptr);

// Everything the simulator says about one MoE layer of one step.
struct LayerResult {
  bool feasible = true;
  planner::Binding binding = planner::Binding::kNone;
  std::string reason;  // the planner's, when infeasible (then no time is given)
  // times (ms; NaN when infeasible): the slowest rank of each phase, phases in sequence;
  // the four all-to-alls by a2a.h (hierarchical, deduplicated over SimConfig::top_k)
  double fwd_ms = 0, bwd_ms = 0;
  double src_fwd_ms = 0, dispatch_ms = 0, expert_fwd_ms = 0, combine_ms = 0;
  double src_bwd_ms = 0, grad_a2a_ms = 0, expert_bwd_ms = 0, dx_a2a_ms = 0;
  double replica_ms = 0, offload_ms = 0;  // exposed (not hidden behind compute)
  // what pipelining the all-to-alls with the expert GEMMs over link.overlap_chunks (or
  // tile by tile, link.overlap_tile_rows) saves against the phases in sequence
  // (dispatch + expert + combine, and gradient + expert backward + dx), ms; fwd_ms /
  // bwd_ms include it; 0 with one chunk and no tiles, negative where the chunks' extra
  // latencies and smaller GEMMs (or the tiles' slower GEMMs on the SMs communication
  // leaves) cost more than the overlap hides
  double overlap_fwd_ms = 0, overlap_bwd_ms = 0;
  // bytes over links (rows a rank keeps are not counted; a row a proxy forwards counts
  // on both hops), summed over ranks
  double fwd_link_bytes = 0, bwd_link_bytes = 0, replica_bytes = 0, offload_bytes = 0;
  // bytes each rank sends into the collectives, self rows included (the EP layer's
  // stats.a2a_bytes, lrmoe/parallel/__init__.py), per rank: 5 x W, where
  // SimConfig::per_rank_bytes asks for them
  // (forward_dispatch, forward_combine, backward_grad, backward_index, backward_dx)
  std::vector<int64_t> sent_bytes_5W;
  // memory: the largest rank's total and each part's maximum over ranks
  planner::MemoryBreakdown memory_max;
  int64_t memory_peak = 0, limit_bytes = 0;
  int32_t replicas = 0;
  int64_t pairs = 0, retained = 0;
  double fwd_imbalance = 0, bwd_imbalance = 0;  // max / mean rows per rank
  // inputs of the step terms (step.h), which are per step, not part of fwd_ms / bwd_ms:
  // the most experts any rank owns (first copies: it all-reduces their gradients and
  // steps their optimizer; symi, whose optimizer state is sharded: ceil(E / W)), and symi's weight broadcast of this layer's copies after the
  // optimizer step (symi_broadcast_ms; 0 for the other policies, NaN when infeasible)
  int32_t owned_experts_max = 0;
  double broadcast_ms = 0;
  // Hysteresis (SimConfig::replan_threshold): whether the layer kept its previous-step
  // placement, and the replicas of this plan absent from that placement (replicas
  // placed anew; every replica on a layer's first step). Counted whenever the previous
  // placement is known (replan_threshold >= 0 or resident_replicas); else 0.
  bool kept_previous = false;
  int32_t moved_replicas = 0;
  // resident_replicas: the moved replicas' weight fetch from their owners (one
  // all-to-all of weight bytes, a2a.h), ms in fwd_ms before the expert GEMMs, not hidden
  // (sim.cpp time_plan says why), and its bytes over links (part of replica_bytes); 0
  // otherwise
  double move_ms = 0, move_bytes = 0;
};

// Simulate one layer: plan `input` with `policy`, then time it. With
// input.previous_instance_* set, make_plan's hysteresis applies and the previous
// placement is the one moves are counted (and, under resident_replicas, charged) against.
LayerResult simulate_layer(const std::string& policy, const planner::PlanInput& input,
                           const SimConfig& cfg);

// Time an existing plan (the loads must be those it was planned from).
LayerResult simulate_plan(const planner::Plan& plan, const planner::PlanInput& input,
                          const SimConfig& cfg);

// Every (step, layer) of loads_SLWE (S steps x Lyr layers x W x E, row-major) on
// `threads` threads; symi gets the previous step's per-expert loads of the same layer
// (for the first step: previous_LWE when given, a chunk of a longer trace, else none).
// With cfg.replan_threshold >= 0 or cfg.resident_replicas the cells of a layer depend on
// its previous step: the threads take whole layers, each walking its steps in order and
// handing each plan's placement to the next step (hysteresis; the first step has none,
// so the walk must not be split into chunks of steps). base.previous_instance_* are
// ignored. Throws std::invalid_argument for replan_threshold >= 1 or with symi.
std::vector<LayerResult> simulate_trace(const std::string& policy, const planner::PlanInput& base,
                                        const std::vector<int64_t>& loads_SLWE, int64_t steps,
                                        int64_t layers, const SimConfig& cfg, int32_t threads,
                                        const std::vector<int64_t>* previous_LWE = nullptr);

// The W x E loads of cell j of a trace (j = step x layers + layer), or of the first
// step's previous cell when asked for j < 0 (j + layers: that layer one step earlier;
// nullptr: none). The pointer must stay valid for the whole call; the function is
// called from several threads at once.
using CellLoads = std::function<const int64_t*(int64_t j)>;

// simulate_trace over loads the caller keeps (no copy of the trace: a benchmark or a
// generator points into its own buffers). simulate_trace above is this over its array.
// Throws std::invalid_argument for steps or layers < 1, threads < 1, a null pointer for
// a cell j >= 0, or whatever the planner throws.
std::vector<LayerResult> simulate_trace(const std::string& policy, const planner::PlanInput& base,
                                        const CellLoads& loads, int64_t steps, int64_t layers,
                                        const SimConfig& cfg, int32_t threads);

// Batch pressure: the loads multiplied by m. A plan that does not fit is split into
// k = 2, 3, ... micro-batches (loads ceil(m L / k)) until one fits or k > max_micro.
// With cfg.activations (mode other than kLayer) a micro-batch fits when
//   resident + activation_bytes(T) + the planned layer's experts and token buffers <= budget,
// T = tokens_per_gpu of its loads (activations.h): the planner runs with
// resident_bytes + activation_bytes(T) as its resident; a micro-batch whose activations
// alone exceed budget - resident is infeasible without a plan (binding kMemory). Under
// kRecompute every micro-batch's MoE forward runs again in the backward (recompute_ms).
struct PressureResult {
  int32_t micro_batches = 0;   // 0: no k <= max_micro fits
  // k x (fwd + bwd [+ fwd under kRecompute]) of one micro-batch; NaN when none fits
  double time_ms = 0;
  LayerResult layer;           // the micro-batch that fits (or the m x plan that failed)
  // the activation bytes of that micro-batch (0 under kLayer), added to the resident
  int64_t activation_bytes = 0;
  double recompute_ms = 0;     // k x fwd under kRecompute, part of time_ms (0 otherwise)
};
PressureResult simulate_pressure(const std::string& policy, const planner::PlanInput& base,
                                 double multiplier, int32_t max_micro, const SimConfig& cfg);

// simulate_pressure of every (step, layer) of loads_SLWE (S x Lyr x W x E) on `threads`
// threads, in (step, layer) order. With cfg.replan_threshold >= 0 (or
// resident_replicas) each layer's steps run in order, the plan of the micro-batch that
// fit (else of the last one tried) handed to the next step as its previous placement
// (every micro-batch count k of that step plans against it). Throws
// std::invalid_argument as simulate_trace and simulate_pressure.
std::vector<PressureResult> simulate_pressure_trace(const std::string& policy,
                                                    const planner::PlanInput& base,
                                                    const std::vector<int64_t>& loads_SLWE,
                                                    int64_t steps, int64_t layers,
                                                    double multiplier, int32_t max_micro,
                                                    const SimConfig& cfg, int32_t threads);

// The replica cost kappa of lrmoe's joint objective (PlanInput::replica_cost_rows) from
// the links and the calibrated curve: one replica's weight transfer inside a node,
//   t_w = weight_bytes / (intra_GBps x 1e6) + intra_latency_us / 1e3      (ms)
// (replicas go inside the owner's NVLink domain first: docs/planner.md, "Topology"),
// over the time of one row of expert compute on a balanced rank holding k =
// experts_per_rank experts of r = rows_per_expert rows each, a forward and a retained
// row averaged as the objective counts each as one row (joint.h):
//   t_row = (gemm.ms(k, k r, fwd) + gemm.ms(k, k r, bwd)) / (2 k r)      (ms per row)
//   kappa = round(t_w / t_row).
// Throws std::invalid_argument for weight_bytes < 0, experts_per_rank or rows_per_expert
// <= 0, intra_GBps <= 0 with weight_bytes > 0, or an empty grid (GemmTable).
int64_t derived_replica_cost_rows(const SimConfig& cfg, int64_t weight_bytes,
                                  double experts_per_rank, double rows_per_expert);

namespace detail {
// Time `plan` of `in` (simulate_plan), with moves counted against the previous placement
// prev_offsets (E + 1) / prev_rank (I) when both are non-null; gemm_cache holds the
// thread's GemmTable, built on first use. sim.cpp and pressure.cpp share it.
LayerResult time_plan(const planner::Plan& plan, const planner::PlanInput& in,
                      const SimConfig& cfg, std::optional<GemmTable>* gemm_cache,
                      const std::vector<int32_t>* prev_offsets = nullptr,
                      const std::vector<int32_t>* prev_rank = nullptr);

// How the cells of a trace depend on each other (trace.cpp; simulate_trace and
// simulate_pressure_trace share it). hysteresis: cfg.replan_threshold >= 0; chained: a
// layer's steps run in order on one thread (hysteresis, or resident replicas off symi).
struct Chaining {
  bool hysteresis = false;
  bool chained = false;
};
// Throws std::invalid_argument for replan_threshold >= 1, or >= 0 with symi.
Chaining chaining(const SimConfig& cfg, bool symi);

// `plan` as the next step's previous placement in `in` (planner/hysteresis.h): its
// instances, their ranks and forward rows (summed over sources).
void hand_on(const planner::Plan& plan, planner::PlanInput* in);

// Clears the previous placement of `in` (a layer's first step).
void clear_previous(planner::PlanInput* in);

// work(t) for t = 0 .. threads - 1, on threads (inline when threads == 1); after all
// have joined, the first message a thread threw is rethrown as std::invalid_argument.
void on_threads(int32_t threads, const std::function<void(int32_t)>& work);
}  // namespace detail

}  // namespace sim
}  // namespace lrmoe
