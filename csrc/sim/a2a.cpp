// Token-level, hierarchical all-to-all (a2a.h; docs/simulation.md, "All-to-all").
#include "sim/a2a.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace lrmoe {
namespace sim {
namespace {

// Sizes every per-rank vector of *d to W zeros, keeping capacity (the simulator calls
// this for every collective of millions of layers).
void reset(TokenDispatch* d, size_t W) {
  for (auto* v : {&d->self_W, &d->inter_out_W, &d->inter_in_W, &d->intra_out_W, &d->intra_in_W})
    v->assign(W, 0.0);
  for (auto* v : {&d->inter_peers_W, &d->intra_peers_W, &d->inter_in_peers_W, &d->intra_in_peers_W})
    v->assign(W, 0);
  d->pair_inter_rows = 0;
}

// Marks (a, b) in the W x W flags and counts a new peer on both ends.
inline void peer(std::vector<char>& flag, size_t W, size_t a, size_t b, std::vector<int64_t>& out,
                 std::vector<int64_t>& in) {
  char& f = flag[a * W + b];
  if (f) return;
  f = 1;
  ++out[a];
  ++in[b];
}

// 1 - (1 - q)^K for integer K >= 1 by repeated squaring (std::pow is several times
// slower and this runs for every cell of every collective).
inline double hit(double q, int32_t K) {
  double base = 1.0 - q, acc = 1.0;
  for (int32_t k = K; k > 0; k >>= 1) {
    if (k & 1) acc *= base;
    base *= base;
  }
  return 1.0 - acc;
}

}  // namespace

TokenDispatch token_dispatch(const std::vector<int32_t>& src_T, const std::vector<int32_t>& dest_TK,
                             int32_t K, int32_t W, int32_t G) {
  if (G < 1) throw std::invalid_argument("token_dispatch: G (gpus_per_node) must be >= 1");
  if (K < 1 || W < 1) throw std::invalid_argument("token_dispatch: K and W must be >= 1");
  if (dest_TK.size() != src_T.size() * static_cast<size_t>(K))
    throw std::invalid_argument("token_dispatch: dest_TK must hold T x K = " +
                                std::to_string(src_T.size() * static_cast<size_t>(K)) +
                                " ranks, got " + std::to_string(dest_TK.size()));
  const size_t Wz = static_cast<size_t>(W);
  TokenDispatch d;
  reset(&d, Wz);
  // which peers each rank sends to, over each link class (W x W flags)
  std::vector<char> inter_peer(Wz * Wz, 0), intra_peer(Wz * Wz, 0);
  auto link_intra = [&](int32_t a, int32_t b) {
    d.intra_out_W[static_cast<size_t>(a)] += 1;
    d.intra_in_W[static_cast<size_t>(b)] += 1;
    peer(intra_peer, Wz, static_cast<size_t>(a), static_cast<size_t>(b), d.intra_peers_W,
         d.intra_in_peers_W);
  };
  std::vector<int32_t> ranks;
  for (size_t t = 0; t < src_T.size(); ++t) {
    const int32_t s = src_T[t];
    if (s < 0 || s >= W) throw std::invalid_argument("token_dispatch: src_T holds a rank outside [0, W)");
    ranks.clear();
    for (int32_t j = 0; j < K; ++j) {
      const int32_t r = dest_TK[t * static_cast<size_t>(K) + static_cast<size_t>(j)];
      if (r == -1) continue;
      if (r < 0 || r >= W) throw std::invalid_argument("token_dispatch: dest_TK holds a rank outside [0, W) (-1: none)");
      if (r / G != s / G) d.pair_inter_rows += 1;
      ranks.push_back(r);
    }
    std::sort(ranks.begin(), ranks.end());
    ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());  // per-rank dedup
    int32_t node = -1, proxy = -1;
    for (int32_t r : ranks) {  // sorted: the ranks of one node are consecutive
      if (r == s) {
        d.self_W[static_cast<size_t>(s)] += 1;
      } else if (r / G == s / G) {
        link_intra(s, r);
      } else {
        if (r / G != node) {  // first rank of a new remote node: one network row
          node = r / G;
          proxy = std::min(W - 1, node * G + s % G);
          d.inter_out_W[static_cast<size_t>(s)] += 1;
          d.inter_in_W[static_cast<size_t>(proxy)] += 1;
          peer(inter_peer, Wz, static_cast<size_t>(s), static_cast<size_t>(proxy),
               d.inter_peers_W, d.inter_in_peers_W);
        }
        if (r != proxy) link_intra(proxy, r);  // the proxy forwards it over NVLink
      }
    }
  }
  return d;
}

void expected_dispatch(const std::vector<int64_t>& M_WW, int32_t W, int32_t K, int32_t G,
                       TokenDispatch* out) {
  if (G < 1) throw std::invalid_argument("expected_dispatch: G (gpus_per_node) must be >= 1");
  if (K < 1 || W < 1) throw std::invalid_argument("expected_dispatch: K (top_k) and W must be >= 1");
  const size_t Wz = static_cast<size_t>(W);
  if (M_WW.size() != Wz * Wz)
    throw std::invalid_argument("expected_dispatch: M_WW must hold W x W = " +
                                std::to_string(Wz * Wz) + " entries, got " +
                                std::to_string(M_WW.size()));
  TokenDispatch& d = *out;
  reset(&d, Wz);
  const int32_t nodes = (W + G - 1) / G;
  // per-thread scratch: which (sender, rank) NVLink pairs carry rows (a rank sends its
  // own rows and forwards others' as a proxy to the same ranks; network peers are
  // distinct per (source, node) by construction and need no flags)
  thread_local std::vector<char> fwd_peer;
  fwd_peer.assign(Wz * Wz, 0);
  for (int32_t s = 0; s < W; ++s) {
    const int64_t* row = M_WW.data() + static_cast<size_t>(s) * Wz;
    int64_t P = 0;
    for (int32_t r = 0; r < W; ++r) {
      if (row[r] < 0) throw std::invalid_argument("expected_dispatch: M_WW holds a negative entry");
      P += row[r];
    }
    if (P == 0) continue;
    // expected rows of m pairs out of P: K = 1 gives m itself (no rounding)
    const double T = static_cast<double>(P) / K, inv_P = 1.0 / static_cast<double>(P);
    auto rows = [&](int64_t m) {
      return K == 1 ? static_cast<double>(m) : T * hit(static_cast<double>(m) * inv_P, K);
    };
    const int32_t home = s / G, local = s % G;
    // node by node, no division per cell (this is the simulator's innermost loop)
    for (int32_t n = 0; n < nodes; ++n) {
      const int32_t r0 = n * G, r1 = std::min(W, r0 + G);
      if (n == home) {
        for (int32_t r = r0; r < r1; ++r) {
          const int64_t m = row[r];
          if (m == 0) continue;
          const double x = rows(m);
          if (r == s) {
            d.self_W[static_cast<size_t>(s)] += x;
            continue;
          }
          d.intra_out_W[static_cast<size_t>(s)] += x;
          d.intra_in_W[static_cast<size_t>(r)] += x;
          peer(fwd_peer, Wz, static_cast<size_t>(s), static_cast<size_t>(r), d.intra_peers_W,
               d.intra_in_peers_W);  // s may also forward to r as a proxy
        }
        continue;
      }
      const int32_t proxy = std::min(W - 1, r0 + local);
      int64_t node_m = 0;
      for (int32_t r = r0; r < r1; ++r) {
        const int64_t m = row[r];
        if (m == 0) continue;
        node_m += m;
        if (r == proxy) continue;  // the network row lands on it
        const double x = rows(m);
        d.intra_out_W[static_cast<size_t>(proxy)] += x;
        d.intra_in_W[static_cast<size_t>(r)] += x;
        peer(fwd_peer, Wz, static_cast<size_t>(proxy), static_cast<size_t>(r), d.intra_peers_W,
             d.intra_in_peers_W);
      }
      if (node_m == 0) continue;
      d.pair_inter_rows += static_cast<double>(node_m);
      const double x = rows(node_m);  // one network row per token and remote node
      d.inter_out_W[static_cast<size_t>(s)] += x;
      d.inter_in_W[static_cast<size_t>(proxy)] += x;
      ++d.inter_peers_W[static_cast<size_t>(s)];
      ++d.inter_in_peers_W[static_cast<size_t>(proxy)];
    }
  }
}

TokenDispatch expected_dispatch(const std::vector<int64_t>& M_WW, int32_t W, int32_t K, int32_t G) {
  TokenDispatch d;
  expected_dispatch(M_WW, W, K, G, &d);
  return d;
}

TokenDispatch reversed(const TokenDispatch& d) {
  TokenDispatch r = d;
  std::swap(r.inter_out_W, r.inter_in_W);
  std::swap(r.intra_out_W, r.intra_in_W);
  std::swap(r.inter_peers_W, r.inter_in_peers_W);
  std::swap(r.intra_peers_W, r.intra_in_peers_W);
  return r;
}

double hierarchical_a2a_ms(const TokenDispatch& d, double row_bytes, const LinkModel& link,
                           double per_peer_us, int32_t chunks) {
  if (chunks < 1) throw std::invalid_argument("hierarchical_a2a_ms: chunks must be >= 1");
  if (per_peer_us < 0) throw std::invalid_argument("hierarchical_a2a_ms: per_peer_us must be >= 0");
  double net = 0, nvl = 0, self = 0;
  for (size_t r = 0; r < d.self_W.size(); ++r) {
    const double xo = std::max(d.inter_out_W[r], d.inter_in_W[r]) * row_bytes;
    const double io = std::max(d.intra_out_W[r], d.intra_in_W[r]) * row_bytes;
    if (xo > 0) {
      if (!(link.inter_GBps > 0)) throw std::invalid_argument("hierarchical_a2a_ms: link.inter_GBps must be > 0");
      const double peers = static_cast<double>(std::max(d.inter_peers_W[r], d.inter_in_peers_W[r]));
      net = std::max(net, (link.inter_latency_us + per_peer_us * peers) * 1e-3 +
                              xo / (link.inter_GBps * 1e6));
    }
    if (io > 0) {
      if (!(link.intra_GBps > 0)) throw std::invalid_argument("hierarchical_a2a_ms: link.intra_GBps must be > 0");
      const double peers = static_cast<double>(std::max(d.intra_peers_W[r], d.intra_in_peers_W[r]));
      nvl = std::max(nvl, (link.intra_latency_us + per_peer_us * peers) * 1e-3 +
                              io / (link.intra_GBps * 1e6));
    }
    if (link.self_GBps > 0) self = std::max(self, d.self_W[r] * row_bytes / (link.self_GBps * 1e6));
  }
  const double pipe = std::max(net, nvl) + std::min(net, nvl) / chunks;
  return std::max(pipe, self);
}

double hierarchical_a2a_ms(const TokenDispatch& d, double row_bytes, const LinkModel& link) {
  return hierarchical_a2a_ms(d, row_bytes, link, link.per_peer_us, link.chunks);
}

double link_bytes(const TokenDispatch& d, double row_bytes) {
  double rows = 0;
  for (size_t r = 0; r < d.self_W.size(); ++r) rows += d.inter_out_W[r] + d.intra_out_W[r];
  return rows * row_bytes;
}

}  // namespace sim
}  // namespace lrmoe
