// Capacity-aware routing: how one expert's rows are spread over its instances.
//
// The per-source quota split of expert parallelism (core::source_share, largest
// remainder over the W sources of one expert) generalised to (source, instance)
// cells: first the expert's retained rows Q_e are split over its instances, each
// bounded by the rows it ran in the forward (default eligibility: saved activations
// never move) and by the backward rows its rank can still take; then each instance's
// share is split over the sources that sent it rows. With one instance per expert
// the result equals core::source_share (tests/cpp/test_planner.cpp checks it).
// docs/planner.md, "Capacity-aware routing", states the rules.
//
// Legend: W sources, n instances of one expert, L_W its routed rows per source,
// F_nW forward rows of (instance, source), f_n = sum_s F_nW, B_nW retained rows.
// Integer arithmetic only: every rank computes identical splits.
#pragma once

#include <cstdint>

namespace lrmoe {
namespace planner {

// out_n[i] = floor(total w[i] / sum(w)) plus one for the total - sum(floor) entries
// with the largest remainders (total w[i]) mod sum(w), ties to the lower index.
// Requires 0 <= total <= sum(w), w >= 0, total * w[i] < 2^63; then out[i] <= w[i].
void largest_remainder(int64_t total, const int64_t* w, int32_t n, int64_t* out);

// Forward split of one expert: instance i (on rank rank_n[i]) computes quota_n[i]
// rows (sum = sum(L_W)). Locality first: source s fills the instance on its own
// rank; then, with nodes of gpus_per_node ranks (node(r) = r / gpus_per_node), each
// source in order fills the instances of its own node in instance order (NVLink
// before the network); the rest are dealt in source order to the instances in order
// (north-west corner), so the split is exact and deterministic. gpus_per_node >= W
// (one node) skips the node pass: it would deal exactly what the north-west corner
// deals, so the split equals the flat one. spare: the rest is dealt instead source by
// source in proportion to the instances' remaining capacity (largest remainder of the
// source's rows over quota - rows taken so far; UltraEP's split, ../shared/policies.md):
// each source's share never exceeds what is left (sum of the capacities >= its rows),
// and the last source fills them exactly.
void split_forward(const int64_t* L_W, int32_t W, const int32_t* rank_n,
                   const int64_t* quota_n, int32_t n, int64_t* F_nW,
                   int32_t gpus_per_node = 0, bool spare = false);

// Backward rows per instance: b_n[i] <= min(f_n[i], room_n[i]) with sum(b) = quota,
// proportional to f where the rooms allow (largest remainder), the rows over a room
// re-dealt over the instances with slack, in proportion to it. Returns the rows that
// no instance could take (0 when sum(min(f, room)) >= quota); b then holds the caps.
int64_t split_over_instances(int64_t quota, const int64_t* f_n, const int64_t* room_n,
                             int32_t n, int64_t* b_n);

// Cells: B_nW[i][s] = largest_remainder(b_n[i], F_nW[i][:]), so B <= F.
void split_cells(const int64_t* b_n, const int64_t* F_nW, int32_t n, int32_t W, int64_t* B_nW);

}  // namespace planner
}  // namespace lrmoe
