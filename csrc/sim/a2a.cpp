// Token-level, hierarchical all-to-all (a2a.h; docs/simulation.md, "All-to-all").
#include "sim/a2a.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace lrmoe {
namespace sim {

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
  for (auto* v : {&d.self_W, &d.inter_out_W, &d.inter_in_W, &d.intra_out_W, &d.intra_in_W,
                  &d.inter_peers_W, &d.intra_peers_W})
    v->assign(Wz, 0);
  // which peers each rank sends to, over each link class (W x W flags)
  std::vector<char> inter_peer(Wz * Wz, 0), intra_peer(Wz * Wz, 0);
  auto link_intra = [&](int32_t a, int32_t b) {
    ++d.intra_out_W[static_cast<size_t>(a)];
    ++d.intra_in_W[static_cast<size_t>(b)];
    intra_peer[static_cast<size_t>(a) * Wz + static_cast<size_t>(b)] = 1;
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
      if (r / G != s / G) ++d.pair_inter_rows;
      ranks.push_back(r);
    }
    std::sort(ranks.begin(), ranks.end());
    ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());  // per-rank dedup
    int32_t node = -1, proxy = -1;
    for (int32_t r : ranks) {  // sorted: the ranks of one node are consecutive
      if (r == s) {
        ++d.self_W[static_cast<size_t>(s)];
      } else if (r / G == s / G) {
        link_intra(s, r);
      } else {
        if (r / G != node) {  // first rank of a new remote node: one network row
          node = r / G;
          proxy = std::min(W - 1, node * G + s % G);
          ++d.inter_out_W[static_cast<size_t>(s)];
          ++d.inter_in_W[static_cast<size_t>(proxy)];
          inter_peer[static_cast<size_t>(s) * Wz + static_cast<size_t>(proxy)] = 1;
        }
        if (r != proxy) link_intra(proxy, r);  // the proxy forwards it over NVLink
      }
    }
  }
  for (size_t a = 0; a < Wz; ++a)
    for (size_t b = 0; b < Wz; ++b) {
      d.inter_peers_W[a] += inter_peer[a * Wz + b];
      d.intra_peers_W[a] += intra_peer[a * Wz + b];
    }
  return d;
}

double hierarchical_a2a_ms(const TokenDispatch& d, double row_bytes, const LinkModel& link,
                           double per_peer_us, int32_t chunks) {
  if (chunks < 1) throw std::invalid_argument("hierarchical_a2a_ms: chunks must be >= 1");
  if (per_peer_us < 0) throw std::invalid_argument("hierarchical_a2a_ms: per_peer_us must be >= 0");
  double net = 0, nvl = 0, self = 0;
  for (size_t r = 0; r < d.self_W.size(); ++r) {
    const double xo = static_cast<double>(std::max(d.inter_out_W[r], d.inter_in_W[r])) * row_bytes;
    const double io = static_cast<double>(std::max(d.intra_out_W[r], d.intra_in_W[r])) * row_bytes;
    if (xo > 0) {
      if (!(link.inter_GBps > 0)) throw std::invalid_argument("hierarchical_a2a_ms: link.inter_GBps must be > 0");
      net = std::max(net, (link.inter_latency_us + per_peer_us * d.inter_peers_W[r]) * 1e-3 +
                              xo / (link.inter_GBps * 1e6));
    }
    if (io > 0) {
      if (!(link.intra_GBps > 0)) throw std::invalid_argument("hierarchical_a2a_ms: link.intra_GBps must be > 0");
      nvl = std::max(nvl, (link.intra_latency_us + per_peer_us * d.intra_peers_W[r]) * 1e-3 +
                              io / (link.intra_GBps * 1e6));
    }
    if (link.self_GBps > 0)
      self = std::max(self, static_cast<double>(d.self_W[r]) * row_bytes / (link.self_GBps * 1e6));
  }
  const double pipe = std::max(net, nvl) + std::min(net, nvl) / chunks;
  return std::max(pipe, self);
}

}  // namespace sim
}  // namespace lrmoe
