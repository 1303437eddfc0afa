// The exact optimum of the max rows per rank on small instances, offline: the reference
// that every policy's gap is measured against (docs/planner.md, "Lower bound and exact
// optimum"). Not used by the policies; far too slow for a plan per micro-batch.
//
// Legend: W ranks, E experts, d_E rows per expert to place (n_E: the forward and the
// exact backward; Q_E: lrmoe's retained rows), R replica slots per rank, S instance
// slots per rank, T a max rows per rank.
#pragma once

#include <cstdint>
#include <vector>

#include "planner/plan.h"

namespace lrmoe {
namespace planner {

// Which placements the optimum ranges over.
enum class PlacementModel : int {
  // fixed ownership (expert e on rank e / (E / W), E % W == 0) plus at most R replicas
  // per rank: the placements of fixed (R = 0), ultraep and lrmoe
  kOwners = 0,
  // any S distinct experts per rank, every expert on at least one rank: symi's placements
  // (with S = ceil(E / W) + R it holds every kOwners placement too)
  kFree = 1,
};

struct ExactInput {
  int32_t num_ranks = 1;         // W <= 8
  int32_t num_experts = 1;       // E <= 16
  std::vector<int64_t> demand_E; // d_E >= 0 rows per expert
  PlacementModel model = PlacementModel::kOwners;
  int32_t slots = 2;             // kOwners: R <= 2 replicas per rank; kFree: S <= ceil(E/W) + 2
  // Memory (row_bytes = 0: none): a rank holding k replicas computes at most
  // floor((limit_bytes - base_bytes - k replica_bytes) / row_bytes) rows, and a placement
  // whose copies alone exceed limit_bytes on a rank is not allowed. kFree charges its S
  // slots in base_bytes (replica_bytes 0), as symi does.
  int64_t limit_bytes = 0;
  int64_t base_bytes = 0;
  int64_t replica_bytes = 0;
  int64_t row_bytes = 0;
  int64_t max_nodes = 2000000;   // placements the search may visit before it gives up
};

struct ExactResult {
  bool feasible = false;      // some placement fits the memory (always when row_bytes = 0)
  bool proven = false;        // the search finished: `optimum` is the optimum (else the
                              // best found within max_nodes, an upper bound on it)
  int64_t optimum = 0;        // rows: min over placements and integer splits of the max
                              // rows per rank (meaningful when feasible)
  int64_t lower_bound = 0;    // rows_lower_bound (bound.h) with the model's spare instances
  int64_t nodes = 0;          // placements visited
  std::vector<int32_t> holds_EW;  // E * W, 1 where an optimal placement puts an instance
  std::vector<int64_t> rows_EW;   // E * W rows of (expert, rank) of a split reaching `optimum`
};

// Minimises max_r (rows computed on rank r) over every placement of the model (slots,
// memory) and every integer split of each d_e over the ranks holding e. Method: binary
// search on T from rows_lower_bound; for each T a depth-first search over placements
// that starts from the owners (kOwners) or from nothing (kFree) and only adds
// instances. At a placement, a max-flow (experts -> ranks holding them -> sink, rank
// capacity min(T, its memory rows)) decides T exactly for integer rows; if it fails, the
// experts A reachable in the residual graph have sum d_A > the capacity of their ranks
// N(A), and every feasible superset must hold some e in A on a rank outside N(A): those
// are the branches (complete). Pruned by the instances ceil(d_e / T) each expert needs
// against the free slots, by placements already refuted at this T, and (kFree) by taking
// one rank of each class of identical ranks. Throws std::invalid_argument naming the
// field when W > 8, E > 16, slots over the limits, E % W != 0 for kOwners, or a negative
// demand or size.
ExactResult exact_optimum(const ExactInput& in);

// The ExactInput of a plan's instance: d = demand_E (empty: the routed demand n_E),
// slots and memory from `in` (kOwners: R = replica_slots, base = E/W owned experts,
// each replica weights + grads; kFree: S = symi_slots or ceil(E/W) + R charged in base
// with the sharded optimizer, as symi.cpp does), each row costing forward_row_bytes +
// backward_row_bytes (the exact backward); with_memory = false: no memory limit.
ExactInput exact_input(const PlanInput& in, PlacementModel model,
                       const std::vector<int64_t>& demand_E = {}, bool with_memory = true);

}  // namespace planner
}  // namespace lrmoe
