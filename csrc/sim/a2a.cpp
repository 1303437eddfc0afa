// Token-level, hierarchical all-to-all (a2a.h; docs/simulation.md, "All-to-all").
#include "sim/a2a.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

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

// m as a double, exactly, for 0 <= m < 2^52: the bits of 2^52 + m, less 2^52. The same
// value as static_cast<double>(m), but it vectorises without AVX-512's conversion.
inline double small_to_double(int64_t m) {
  const uint64_t bits = 0x4330000000000000ull | static_cast<uint64_t>(m);
  double v;
  std::memcpy(&v, &bits, sizeof v);
  return v - 4503599627370496.0;
}

// The expected rows of n cells (pairs m_S, of sources with T_S = P_s / K and
// inv_P_S = 1 / P_s) into x_S: T_s (1 - (1 - m inv_P_s)^K) with the operations of hit(),
// so the same bits, but a whole row at once with K fixed (vectorisable); K = 1: m
// itself. small: every m < 2^52 (small_to_double). A cell with m = 0 (also of a source
// with P_s = 0, given T_s = inv_P_s = 0) gets exactly +0.0, which leaves every sum of
// non-negative terms it is added to unchanged.
// hit()'s loop for the bits k of K at compile time: acc *= base where the bit is set,
// then base squared (straight-line code, which the vectoriser takes)
template <int32_t k>
inline void power_steps(double& acc, double& base) {
  if constexpr (k > 0) {
    if constexpr ((k & 1) != 0) acc *= base;
    base *= base;
    power_steps<(k >> 1)>(acc, base);
  }
}

template <int32_t K, bool small>
void cell_rows_k(const int64_t* m_S, const double* T_S, const double* inv_P_S, size_t n,
                 double* x_S) {
  for (size_t s = 0; s < n; ++s) {
    const double m = small ? small_to_double(m_S[s]) : static_cast<double>(m_S[s]);
    if constexpr (K == 1) {
      x_S[s] = m;
    } else {
      double base = 1.0 - m * inv_P_S[s], acc = 1.0;
      power_steps<K>(acc, base);
      x_S[s] = T_S[s] * (1.0 - acc);
    }
  }
}

template <bool small>
void cell_rows_small(const int64_t* m_S, const double* T_S, const double* inv_P_S, size_t n,
                     int32_t K, double* x_S) {
  switch (K) {  // the usual top-k unrolled; any other K entry by entry through hit()
    case 1: return cell_rows_k<1, small>(m_S, T_S, inv_P_S, n, x_S);
    case 2: return cell_rows_k<2, small>(m_S, T_S, inv_P_S, n, x_S);
    case 4: return cell_rows_k<4, small>(m_S, T_S, inv_P_S, n, x_S);
    case 6: return cell_rows_k<6, small>(m_S, T_S, inv_P_S, n, x_S);
    case 8: return cell_rows_k<8, small>(m_S, T_S, inv_P_S, n, x_S);
    default:
      for (size_t s = 0; s < n; ++s) {
        const double m = small ? small_to_double(m_S[s]) : static_cast<double>(m_S[s]);
        x_S[s] = T_S[s] * hit(m * inv_P_S[s], K);
      }
  }
}

void cell_rows(const int64_t* m_S, const double* T_S, const double* inv_P_S, size_t n,
               int32_t K, bool small, double* x_S) {
  if (small) cell_rows_small<true>(m_S, T_S, inv_P_S, n, K, x_S);
  else cell_rows_small<false>(m_S, T_S, inv_P_S, n, K, x_S);
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
  thread_local std::vector<int64_t> M_t;
  M_t.resize(Wz * Wz);
  for (size_t s = 0; s < Wz; ++s)
    for (size_t d = 0; d < Wz; ++d) M_t[d * Wz + s] = M_WW[s * Wz + d];
  expected_dispatch_transposed(M_t.data(), W, K, G, out);
}

void expected_dispatch_transposed(const int64_t* M_t, int32_t W, int32_t K, int32_t G,
                                  TokenDispatch* out) {
  if (G < 1) throw std::invalid_argument("expected_dispatch: G (gpus_per_node) must be >= 1");
  if (K < 1 || W < 1) throw std::invalid_argument("expected_dispatch: K (top_k) and W must be >= 1");
  const size_t Wz = static_cast<size_t>(W);
  TokenDispatch& d = *out;
  reset(&d, Wz);
  // pairs per source P_s (column sums of the transpose) and the factors of rows(); the
  // bits of every entry OR-ed: a negative entry sets the sign bit, and below 2^52 every
  // entry converts by small_to_double
  thread_local std::vector<int64_t> P_S_buf;
  thread_local std::vector<double> T_S_buf, inv_P_S_buf;
  P_S_buf.assign(Wz, 0);
  T_S_buf.resize(Wz);
  inv_P_S_buf.resize(Wz);
  int64_t* P_S = P_S_buf.data();
  double* T_S = T_S_buf.data();
  double* inv_P_S = inv_P_S_buf.data();
  uint64_t bits = 0;
  for (size_t r = 0; r < Wz; ++r) {
    const int64_t* row = M_t + r * Wz;
    for (size_t s = 0; s < Wz; ++s) {
      P_S[s] += row[s];
      bits |= static_cast<uint64_t>(row[s]);
    }
  }
  if (static_cast<int64_t>(bits) < 0)
    throw std::invalid_argument("expected_dispatch: M_WW holds a negative entry");
  const bool small = (bits >> 52) == 0;  // node sums below may still reach 2^52
  for (size_t s = 0; s < Wz; ++s) {
    const bool any = P_S[s] != 0;
    T_S[s] = any ? static_cast<double>(P_S[s]) / K : 0.0;
    inv_P_S[s] = any ? 1.0 / static_cast<double>(P_S[s]) : 0.0;
  }
  double* self_W = d.self_W.data();
  double* inter_out_W = d.inter_out_W.data();
  double* inter_in_W = d.inter_in_W.data();
  int64_t* inter_peers_W = d.inter_peers_W.data();
  int64_t* inter_in_peers_W = d.inter_in_peers_W.data();
  // Node by node (nodes of G ranks): every sum below gets its terms in the order of the
  // definition's loop (source s ascending, then its ranks ascending), because each
  // accumulator of a node's ranks is only ever added to while that node is processed:
  // intra_in of r takes one term per source; intra_out of r its own rows to its node
  // and those it forwards as the proxy of remote sources; inter_out of s one term per
  // remote node, nodes ascending; inter_in of a proxy one per remote source.
  const int32_t nodes = (W + G - 1) / G;
  thread_local std::vector<double> X_buf, Xn_buf;  // x of the node's cells; of node sums
  thread_local std::vector<int64_t> node_NS;       // pairs from source s to node n
  X_buf.resize(static_cast<size_t>(std::min(G, W)) * Wz);
  Xn_buf.resize(Wz);
  node_NS.resize(static_cast<size_t>(nodes) * Wz);
  const double* X_R = X_buf.data();
  double* Xn_S = Xn_buf.data();
  for (int32_t n = 0; n < nodes; ++n) {
    const int32_t r0 = n * G, r1 = std::min(W, r0 + G), g = r1 - r0;
    const size_t gz = static_cast<size_t>(g);
    const int64_t* M_n = M_t + static_cast<size_t>(r0) * Wz;  // the node's g rows
    for (int32_t j = 0; j < g; ++j)
      cell_rows(M_n + j * Wz, T_S, inv_P_S, Wz, K, small, X_buf.data() + j * Wz);
    int64_t* node_S = node_NS.data() + static_cast<size_t>(n) * Wz;
    std::fill(node_S, node_S + Wz, int64_t(0));
    uint64_t node_bits = 0;
    for (int32_t j = 0; j < g; ++j)
      for (size_t s = 0; s < Wz; ++s) node_S[s] += M_n[j * Wz + s];
    for (size_t s = 0; s < Wz; ++s) node_bits |= static_cast<uint64_t>(node_S[s]);
    // one network row per token and remote node: rows() of the node sums
    cell_rows(node_S, T_S, inv_P_S, Wz, K, (node_bits >> 52) == 0, Xn_S);
    double* in_R = d.intra_in_W.data() + r0;    // this node's accumulators
    double* out_R = d.intra_out_W.data() + r0;
    // sender of each source's rows on this node: itself on its own node (direct NVLink
    // rows), else its proxy there (a network row per token, forwarded over NVLink)
    thread_local std::vector<int32_t> a_S;
    a_S.resize(Wz);
    for (int32_t s = 0; s < W; ++s)
      a_S[static_cast<size_t>(s)] = (s >= r0 && s < r1 ? s : std::min(W - 1, r0 + s % G)) - r0;
    // NVLink peers: sender a reaches rank j != a where some source it sends for has pairs
    // on j (the bits of those entries OR-ed; sources with no pairs have none anywhere)
    thread_local std::vector<uint64_t> any_A;
    any_A.resize(gz);
    for (int32_t j = 0; j < g; ++j) {
      std::fill(any_A.begin(), any_A.end(), uint64_t(0));
      const int64_t* row = M_n + j * Wz;
      for (size_t s = 0; s < Wz; ++s) any_A[static_cast<size_t>(a_S[s])] |= static_cast<uint64_t>(row[s]);
      for (int32_t a = 0; a < g; ++a)
        if (a != j && any_A[static_cast<size_t>(a)] != 0) {
          ++d.intra_peers_W[static_cast<size_t>(r0 + a)];
          ++d.intra_in_peers_W[static_cast<size_t>(r0 + j)];
        }
    }
    // the terms of source s on the node's ranks j != a (a: its sender), a's sum in a
    // register (through memory it was a chain of store-to-load latencies); a cell with
    // no pairs adds +0.0 (cell_rows)
    auto deal = [&](size_t sz, int32_t j0, int32_t j1, double& out_a) {
      for (int32_t j = j0; j < j1; ++j) {
        const double x = X_R[j * Wz + sz];
        out_a += x;
        in_R[j] += x;
      }
    };
    for (int32_t s = 0; s < W; ++s) {
      const size_t sz = static_cast<size_t>(s);
      if (P_S[sz] == 0) continue;
      const int32_t a = a_S[sz], proxy = r0 + a;
      double out_a = out_R[a];
      deal(sz, 0, a, out_a);
      deal(sz, a + 1, g, out_a);
      out_R[a] = out_a;
      if (proxy == s) {  // its own node
        if (M_n[a * Wz + sz] != 0) self_W[sz] += X_R[a * Wz + sz];
        continue;
      }
      if (node_S[sz] == 0) continue;
      const double x = Xn_S[sz];
      inter_out_W[sz] += x;
      inter_in_W[proxy] += x;
      ++inter_peers_W[sz];
      ++inter_in_peers_W[proxy];
    }
  }
  // network pairs without dedup, summed source by source as the definition does
  double pair_rows = 0;
  for (int32_t s = 0; s < W; ++s) {
    if (P_S[s] == 0) continue;
    for (int32_t n = 0; n < nodes; ++n) {
      if (n == s / G) continue;
      const int64_t node_m = node_NS[static_cast<size_t>(n) * Wz + s];
      if (node_m != 0) pair_rows += static_cast<double>(node_m);
    }
  }
  d.pair_inter_rows = pair_rows;
}

void expected_dispatch_sparse(const std::vector<PairCell>& cells, int32_t W, int32_t K, int32_t G,
                              TokenDispatch* out) {
  if (G < 1) throw std::invalid_argument("expected_dispatch: G (gpus_per_node) must be >= 1");
  if (K < 1 || W < 1) throw std::invalid_argument("expected_dispatch: K (top_k) and W must be >= 1");
  TokenDispatch& d = *out;
  reset(&d, static_cast<size_t>(W));
  // NVLink (sender, receiver) pairs that carry rows, counted once each at the end
  thread_local std::vector<std::pair<int32_t, int32_t>> links;
  links.clear();
  for (size_t c = 0; c < cells.size(); ++c) {
    const PairCell& x = cells[c];
    if (x.s < 0 || x.s >= W || x.d < 0 || x.d >= W)
      throw std::invalid_argument("expected_dispatch_sparse: a cell's rank is outside [0, W)");
    if (x.pairs < 0) throw std::invalid_argument("expected_dispatch: M_WW holds a negative entry");
    if (c > 0 && (cells[c - 1].s > x.s || (cells[c - 1].s == x.s && cells[c - 1].d >= x.d)))
      throw std::invalid_argument("expected_dispatch_sparse: cells must be sorted by (s, d), "
                                  "each at most once");
  }
  // the definition's loop (expected_dispatch) over the nonzero cells only: a source's
  // cells, sorted by rank, visit its nodes ascending and their ranks ascending
  for (size_t b = 0; b < cells.size();) {
    const int32_t s = cells[b].s;
    size_t e = b;
    int64_t P = 0;
    while (e < cells.size() && cells[e].s == s) P += cells[e++].pairs;
    if (P == 0) { b = e; continue; }
    const double T = static_cast<double>(P) / K, inv_P = 1.0 / static_cast<double>(P);
    auto rows = [&](int64_t m) {
      return K == 1 ? static_cast<double>(m) : T * hit(static_cast<double>(m) * inv_P, K);
    };
    const int32_t home = s / G, local = s % G;
    const size_t sz = static_cast<size_t>(s);
    for (size_t i = b; i < e;) {
      const int32_t n = cells[i].d / G;
      size_t k = i;
      while (k < e && cells[k].d / G == n) ++k;
      if (n == home) {
        for (; i < k; ++i) {
          const int64_t m = cells[i].pairs;
          const int32_t r = cells[i].d;
          if (m == 0) continue;
          const double x = rows(m);
          if (r == s) {
            d.self_W[sz] += x;
            continue;
          }
          d.intra_out_W[sz] += x;
          d.intra_in_W[static_cast<size_t>(r)] += x;
          links.push_back({s, r});
        }
        continue;
      }
      const int32_t proxy = std::min(W - 1, n * G + local);
      int64_t node_m = 0;
      for (; i < k; ++i) {
        const int64_t m = cells[i].pairs;
        const int32_t r = cells[i].d;
        if (m == 0) continue;
        node_m += m;
        if (r == proxy) continue;
        const double x = rows(m);
        d.intra_out_W[static_cast<size_t>(proxy)] += x;
        d.intra_in_W[static_cast<size_t>(r)] += x;
        links.push_back({proxy, r});
      }
      if (node_m == 0) continue;
      d.pair_inter_rows += static_cast<double>(node_m);
      const double x = rows(node_m);
      d.inter_out_W[sz] += x;
      d.inter_in_W[static_cast<size_t>(proxy)] += x;
      ++d.inter_peers_W[sz];
      ++d.inter_in_peers_W[static_cast<size_t>(proxy)];
    }
    b = e;
  }
  std::sort(links.begin(), links.end());
  links.erase(std::unique(links.begin(), links.end()), links.end());
  for (const auto& l : links) {
    ++d.intra_peers_W[static_cast<size_t>(l.first)];
    ++d.intra_in_peers_W[static_cast<size_t>(l.second)];
  }
}

TokenDispatch expected_dispatch(const std::vector<int64_t>& M_WW, int32_t W, int32_t K, int32_t G) {
  TokenDispatch d;
  expected_dispatch(M_WW, W, K, G, &d);
  return d;
}

TokenDispatch reversed(const TokenDispatch& d) {
  TokenDispatch r;
  reversed(d, &r);
  return r;
}

void reversed(const TokenDispatch& d, TokenDispatch* out) {
  TokenDispatch& r = *out;
  r.self_W = d.self_W;
  r.inter_out_W = d.inter_in_W;
  r.inter_in_W = d.inter_out_W;
  r.intra_out_W = d.intra_in_W;
  r.intra_in_W = d.intra_out_W;
  r.inter_peers_W = d.inter_in_peers_W;
  r.inter_in_peers_W = d.inter_peers_W;
  r.intra_peers_W = d.intra_in_peers_W;
  r.intra_in_peers_W = d.intra_peers_W;
  r.pair_inter_rows = d.pair_inter_rows;
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
