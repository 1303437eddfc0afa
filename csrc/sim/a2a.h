// Token-level, hierarchical all-to-all of one MoE dispatch (issue 30): a token whose
// experts sit on several ranks of one remote node crosses the network once, to the rank
// of that node with the source's local index (its "proxy"), which forwards it over NVLink
// to each distinct destination rank there; a token sent to two experts of one rank moves
// once. docs/simulation.md, "All-to-all", gives the model. The layer time of sim.cpp
// times every collective with it (dispatch, combine, gradient, dx, replica weights), from
// token identities (token_dispatch) or, where a plan knows only pair counts, from their
// expectation (expected_dispatch).
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
// Rows are counts (token_dispatch) or expected counts (expected_dispatch), hence double.
struct TokenDispatch {
  std::vector<double> self_W;       // rows a rank keeps (a device copy)
  std::vector<double> inter_out_W;  // network rows sent (one per token and remote node)
  std::vector<double> inter_in_W;   // network rows received as a node's proxy
  std::vector<double> intra_out_W;  // NVLink rows sent: own tokens to same-node ranks
                                    // plus rows forwarded as a proxy
  std::vector<double> intra_in_W;   // NVLink rows received
  std::vector<int64_t> inter_peers_W, intra_peers_W;  // distinct ranks each rank sends to
  std::vector<int64_t> inter_in_peers_W, intra_in_peers_W;  // ... and receives from
  double pair_inter_rows = 0;       // network rows without dedup (one per remote pair)
};

// Count the dispatch of tokens with sources src_T (T ranks) and destinations dest_TK
// (T x K ranks, row-major; -1: no expert). Throws std::invalid_argument (naming the
// argument) when dest_TK is not T x K, a rank is outside [0, W) or G < 1.
TokenDispatch token_dispatch(const std::vector<int32_t>& src_T, const std::vector<int32_t>& dest_TK,
                             int32_t K, int32_t W, int32_t G);

// The expected token-level dispatch of a pair matrix M_WW (W x W row-major: M[s][d]
// (token, expert) pairs from source s computed on rank d), when each of source s's
// T_s = P_s / K tokens (P_s = sum_d M[s][d]) picks its K experts as K independent draws
// from s's pair distribution. A token then reaches rank d with probability
// 1 - (1 - M[s][d] / P_s)^K and remote node n with 1 - (1 - M[s][n] / P_s)^K
// (M[s][n] summed over n's ranks), so the expected rows are T_s times those (the
// standard occupancy expectation: Feller, An Introduction to Probability Theory, vol. 1,
// ch. II.11). K = 1 is no dedup: every pair is a row, exactly M[s][d]. Draws are with
// replacement while a router's top-K are distinct, so the dedup is slightly
// underestimated (tests/cpp/test_sim.cpp compares it with token_dispatch on sampled
// tokens). Routing as token_dispatch: network rows to the proxy, NVLink from there.
// Writes into *out (reusing its storage). Throws std::invalid_argument for K, W or G < 1,
// M_WW of the wrong size or a negative entry.
void expected_dispatch(const std::vector<int64_t>& M_WW, int32_t W, int32_t K, int32_t G,
                       TokenDispatch* out);
TokenDispatch expected_dispatch(const std::vector<int64_t>& M_WW, int32_t W, int32_t K, int32_t G);

// expected_dispatch of M_WW given as its transpose, M_t[d * W + s] = M[s][d] (W x W:
// one row per computing rank, which is how sim.cpp builds it from a plan's instances).
// The same result bit for bit: every sum is taken in expected_dispatch's order (the
// row-major overload above is this over the transpose). Throws as expected_dispatch.
void expected_dispatch_transposed(const int64_t* M_t, int32_t W, int32_t K, int32_t G,
                                  TokenDispatch* out);

// One nonzero entry of a sparse pair matrix: `pairs` from source s to rank d.
struct PairCell {
  int32_t s = 0, d = 0;
  int64_t pairs = 0;
};

// expected_dispatch of the W x W matrix whose entries are `cells` (sorted by (s, d),
// each (s, d) at most once; every other entry 0), in time linear in the cells: a
// layer's replica copies are a few cells of a W x W matrix. The same result bit for
// bit. Throws as expected_dispatch, and for cells out of order or outside [0, W).
void expected_dispatch_sparse(const std::vector<PairCell>& cells, int32_t W, int32_t K, int32_t G,
                              TokenDispatch* out);

// The same rows in the opposite direction (combine after dispatch, dx after the
// gradient): sent <-> received and the peer counts with them; the proxies now reduce
// a token's rows of their node into one network row (what a dispatch deduplicated a
// combine sums; DeepEP's combine does this).
TokenDispatch reversed(const TokenDispatch& d);
// The same into *out, reusing its storage (out != &d).
void reversed(const TokenDispatch& d, TokenDispatch* out);

// The hierarchical all-to-all time of `d`: a network phase (per rank the larger of its
// sent and received network rows at inter_GBps, plus inter_latency_us and per_peer_us
// for each distinct network peer, the larger of its send and receive peers) and an
// NVLink phase (the same at intra_GBps with the intra latency), each as long as its
// slowest rank, pipelined over `chunks` chunks: max(net, nvl) + min(net, nvl) / chunks
// (chunks = 1: in sequence). A phase with no rows takes no time (no latency). The self
// copy runs beside both at link.self_GBps (0: free). Throws std::invalid_argument for
// chunks < 1, per_peer_us < 0, or rows over a link whose GB/s is <= 0.
double hierarchical_a2a_ms(const TokenDispatch& d, double row_bytes, const LinkModel& link,
                           double per_peer_us, int32_t chunks);

// hierarchical_a2a_ms with the link's own per_peer_us and chunks.
double hierarchical_a2a_ms(const TokenDispatch& d, double row_bytes, const LinkModel& link);

// Bytes over links of `d` (x row_bytes): network and NVLink rows sent, summed over
// ranks (a forwarded row counts on both of its hops; self rows on none).
double link_bytes(const TokenDispatch& d, double row_bytes);

}  // namespace sim
}  // namespace lrmoe
