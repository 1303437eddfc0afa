// Token-level, hierarchical all-to-all of one MoE dispatch (issue 30): a token whose
// experts sit on several ranks of one remote node crosses the network once, to the rank
// of that node with the source's local index (its "proxy"), which forwards it over NVLink
// to each distinct destination rank there; a token sent to two experts of one rank moves
// once. docs/simulation.md, "All-to-all", gives the model.
//
// Legend: W ranks in nodes of G (rank r on node r / G, local index r % G), T tokens, K
// experts per token; rows are token rows of row_bytes each. Times ms, bandwidths GB/s.
#pragma once

#include <cstdint>
#include <vector>

#include "sim/sim.h"

namespace lrmoe {
namespace sim {

// Rows per rank of a token-level dispatch, deduplicated per destination rank and node.
struct TokenDispatch {
  std::vector<int64_t> self_W;       // rows a rank keeps (a device copy)
  std::vector<int64_t> inter_out_W;  // network rows sent (one per token and remote node)
  std::vector<int64_t> inter_in_W;   // network rows received as a node's proxy
  std::vector<int64_t> intra_out_W;  // NVLink rows sent: own tokens to same-node ranks
                                     // plus rows forwarded as a proxy
  std::vector<int64_t> intra_in_W;   // NVLink rows received
  std::vector<int64_t> inter_peers_W, intra_peers_W;  // distinct ranks each rank sends to
  int64_t pair_inter_rows = 0;       // network rows without dedup (one per remote pair)
};

// Count the dispatch of tokens with sources src_T (T ranks) and destinations dest_TK
// (T x K ranks, row-major; -1: no expert). Throws std::invalid_argument (naming the
// argument) when dest_TK is not T x K, a rank is outside [0, W) or G < 1.
TokenDispatch token_dispatch(const std::vector<int32_t>& src_T, const std::vector<int32_t>& dest_TK,
                             int32_t K, int32_t W, int32_t G);

// The hierarchical all-to-all time of `d`: a network phase (per rank the larger of its
// sent and received network rows at inter_GBps, plus inter_latency_us and per_peer_us
// for each distinct network peer) and an NVLink phase (the same at intra_GBps with the
// intra latency), each as long as its slowest rank, pipelined over `chunks` chunks:
// max(net, nvl) + min(net, nvl) / chunks (chunks = 1: in sequence). The self copy runs
// beside both at link.self_GBps (0: free). Throws std::invalid_argument for chunks < 1
// or per_peer_us < 0.
double hierarchical_a2a_ms(const TokenDispatch& d, double row_bytes, const LinkModel& link,
                           double per_peer_us, int32_t chunks);

}  // namespace sim
}  // namespace lrmoe
