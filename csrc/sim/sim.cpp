// The cluster simulator (sim.h): cost-model interpolation, all-to-all timing and the
// per-layer, per-trace and batch-pressure drivers. docs/simulation.md gives the model.
//
// Legend as in sim.h: W ranks, E experts, I instances, L_WE loads, F_IW / B_IW forward
// / retained rows, M_WW rows from rank s to rank d.
#include "sim/sim.h"

#include "sim/a2a.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>

namespace lrmoe {
namespace sim {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// ms to move `bytes` at `GBps` (1e9 bytes/s): bytes / (GBps * 1e6).
double transfer_ms(double bytes, double GBps) {
  if (bytes <= 0) return 0.0;
  if (GBps <= 0) throw std::invalid_argument("a link or copy bandwidth is <= 0 GB/s; set it "
                                             "in the link config (configs/links/) or cost file");
  return bytes / (GBps * 1e6);
}

// One experts-per-rank curve: the time of `k` experts (the curve's own count) at `rows`
// per expert each, linear between the measured rows, the first point's time below it
// (small GEMMs are launch-bound). Beyond the last measured rows: with a roofline, the
// last point's time plus the roofline's extra time for the k experts' extra rows at the
// grid's marginal efficiency `eta` (GemmTable::GemmTable, which measures eta on k x one
// expert's roofline too); without one, the last segment's slope, or the last point's ms
// per row where that slope is <= 0. Never a clamped slope: a zero slope let 262k rows of
// one expert cost 1.3 ms, below the H200's 2.5 ms floor (issue 30; docs/simulation.md,
// "Cost model"). (Before 2026-12-07 the roofline term was one expert's for every k, so a
// k-expert curve beyond the grid grew k times too slowly.)
double curve_ms(const std::vector<std::pair<double, double>>& pts, double k, double rows,
                const Roofline* roof, double eta, bool backward) {
  if (rows <= pts.front().first) return pts.front().second;
  for (size_t j = 1; j < pts.size(); ++j) {
    if (rows <= pts[j].first) {
      const auto& a = pts[j - 1];
      const auto& b = pts[j];
      return a.second + (b.second - a.second) * (rows - a.first) / (b.first - a.first);
    }
  }
  const auto& b = pts.back();
  if (roof)
    return b.second + k * (roof->expert_ms(rows, backward) - roof->expert_ms(b.first, backward)) / eta;
  double slope = 0.0;
  if (pts.size() > 1) {
    const auto& a = pts[pts.size() - 2];
    slope = (b.second - a.second) / (b.first - a.first);
  }
  if (!(slope > 0)) slope = b.second / b.first;
  return b.second + slope * (rows - b.first);
}

// The grid's marginal efficiency against the roofline (0, 1]: of the curves' last
// segments, the one with the most roofline time between its two points (the largest
// measured work, the least noisy), its roofline time delta over its measured delta;
// 1 (peak) where no curve has two points with a rising time.
double marginal_eta(const std::vector<std::vector<std::pair<double, double>>>& curves,
                    const std::vector<double>& k, const Roofline& roof, bool backward) {
  double best_work = 0.0, eta = 1.0;
  for (size_t j = 0; j < curves.size(); ++j) {
    const auto& c = curves[j];
    if (c.size() < 2) continue;
    const auto& a = c[c.size() - 2];
    const auto& b = c.back();
    const double work = k[j] * (roof.expert_ms(b.first, backward) - roof.expert_ms(a.first, backward));
    const double dt = b.second - a.second;
    if (dt > 0 && work > best_work) {
      best_work = work;
      eta = std::min(1.0, work / dt);
    }
  }
  return eta;
}

// Sorts replica cells by (source, rank) and merges repeated ones (a sum per matrix
// entry, as the dense matrices added them): expected_dispatch_sparse's input.
void sorted_cells(std::vector<PairCell>* cells) {
  std::vector<PairCell>& v = *cells;
  std::sort(v.begin(), v.end(), [](const PairCell& a, const PairCell& b) {
    return a.s != b.s ? a.s < b.s : a.d < b.d;
  });
  size_t k = 0;
  for (size_t i = 0; i < v.size(); ++i) {
    if (k > 0 && v[k - 1].s == v[i].s && v[k - 1].d == v[i].d) v[k - 1].pairs += v[i].pairs;
    else v[k++] = v[i];
  }
  v.resize(k);
}

}  // namespace

GemmTable::GemmTable(const std::vector<GemmPoint>& grid, const Roofline& roofline)
    : roof_(roofline), has_roof_(roofline.enabled()) {
  if (grid.empty()) throw std::invalid_argument("cost model: no grouped-GEMM points; run "
                                                "`lrmoe calibrate`");
  std::map<double, std::pair<std::vector<std::pair<double, double>>,
                             std::vector<std::pair<double, double>>>> by_k;
  for (const GemmPoint& p : grid) {
    if (!(p.experts > 0 && p.rows > 0))
      throw std::invalid_argument("cost model: a grouped-GEMM point needs experts > 0 and rows > 0");
    by_k[p.experts].first.push_back({p.rows, p.fwd_ms});
    by_k[p.experts].second.push_back({p.rows, p.bwd_ms});
  }
  for (auto& kv : by_k) {
    k_.push_back(kv.first);
    std::sort(kv.second.first.begin(), kv.second.first.end());
    std::sort(kv.second.second.begin(), kv.second.second.end());
    fwd_.push_back(kv.second.first);
    bwd_.push_back(kv.second.second);
  }
  if (has_roof_) {
    eta_fwd_ = marginal_eta(fwd_, k_, roof_, false);
    eta_bwd_ = marginal_eta(bwd_, k_, roof_, true);
  }
}

template <typename F>
double GemmTable::along_k(double k, F v) const {
  const size_t n = k_.size();
  if (k <= k_[0]) return v(0) * k / k_[0];
  if (k >= k_[n - 1]) return v(n - 1) * k / k_[n - 1];
  const size_t hi = static_cast<size_t>(std::lower_bound(k_.begin(), k_.end(), k) - k_.begin());
  if (k_[hi] == k) return v(hi);
  const double a = v(hi - 1), b = v(hi);
  return a + (b - a) * (k - k_[hi - 1]) / (k_[hi] - k_[hi - 1]);
}

double GemmTable::ms(double k, double rows, bool backward) const {
  if (k <= 0 || rows <= 0) return 0.0;
  const auto& curves = backward ? bwd_ : fwd_;
  const double per_expert = rows / k;
  const Roofline* roof = has_roof_ ? &roof_ : nullptr;
  const double eta = backward ? eta_bwd_ : eta_fwd_;
  const double t = along_k(k, [&](size_t j) { return curve_ms(curves[j], k_[j], per_expert, roof, eta, backward); });
  if (!has_roof_) return t;
  // the floor: k experts of rows / k each (a fractional k counts as its share of one)
  const double floor = k * roof_.expert_ms(per_expert, backward) + roof_.launch_us * 1e-3;
  return std::max(t, floor);
}

double GemmTable::ms_instances(const std::vector<double>& rows_I, bool backward) const {
  const auto& curves = backward ? bwd_ : fwd_;
  double k = 0;
  for (double r : rows_I) k += r > 0;
  if (k == 0) return 0.0;
  const Roofline* roof = has_roof_ ? &roof_ : nullptr;
  const double eta = backward ? eta_bwd_ : eta_fwd_;
  const double t = along_k(k, [&](size_t j) {
    double sum = 0;
    for (double r : rows_I)
      if (r > 0) sum += curve_ms(curves[j], k_[j], r, roof, eta, backward);
    return sum / k;
  });
  return has_roof_ ? std::max(t, roof_.rank_ms(rows_I, backward)) : t;
}

double gemm_ms(const std::vector<GemmPoint>& grid, double k, double rows, bool backward) {
  if (k <= 0 || rows <= 0) return 0.0;
  return GemmTable(grid).ms(k, rows, backward);
}

double all_to_all_ms(const std::vector<int64_t>& M_WW, int32_t W, double row_bytes,
                     const LinkModel& link, double* link_bytes_out) {
  if (link.gpus_per_node < 1) throw std::invalid_argument("gpus_per_node must be >= 1");
  const TokenDispatch d = expected_dispatch(M_WW, W, 1, link.gpus_per_node);
  if (link_bytes_out) *link_bytes_out = link_bytes(d, row_bytes);
  return hierarchical_a2a_ms(d, row_bytes, link);
}

namespace {

// simulate_plan with the grouped-GEMM table built at most once per trace: *gemm is
// built from cfg on the first feasible plan (GemmTable's constructor sorts the grid into
// a map, which per layer was a measurable share of simulate_trace; an infeasible plan
// never needs it, so an empty grid still throws only where a plan is timed).
// n chunks through three stages, the first and last on the links (an all-to-all out,
// one back), the middle on the SMs: chunk i computes while chunk i + 1 goes out and
// chunk i - 1 comes back. The links carry both directions' chunks, so the steady state
// is the slower of (out + back) and compute per chunk; the first chunk fills the pipe:
// out + compute + back + (n - 1) * max(out + back, compute). n = 1: the phases in
// sequence. (The two-resource pipeline bound; Comet / DeepEP-style chunked overlap.)
double pipelined_ms(double out1, double compute1, double back1, int32_t n) {
  return out1 + compute1 + back1 + (n - 1) * std::max(out1 + back1, compute1);
}

// one rank's phases overlapped tile by tile (LinkModel::overlap_tile_rows): the
// all-to-alls (a2a, latencies once) and the GEMMs (compute, already on the SMs left to
// them) run side by side; the first tile's rows must arrive before its GEMM starts and
// the last tile's results leave after it ends, the shorter side's 1 / tiles each way
// (the limit of pipelined_ms over `tiles` equal chunks with no per-chunk latency).
// A rank with no rows (tiles = 0) only takes part in the collectives.
double tiled_ms(double a2a, double compute, int64_t tiles) {
  if (tiles <= 0) return a2a;
  return std::max(a2a, compute) + std::min(a2a, compute) / static_cast<double>(tiles);
}

// GEMM tiles of one rank: each instance's rows in tiles of `tile` rows (a tile never
// spans two experts: the grouped GEMM's M tiles are per group)
int64_t tiles_of(const std::vector<double>& rows_I, int32_t tile) {
  int64_t n = 0;
  for (double x : rows_I) n += static_cast<int64_t>(std::ceil(x / tile));
  return n;
}

}  // namespace

namespace detail {

LayerResult time_plan(const planner::Plan& plan, const planner::PlanInput& in,
                      const SimConfig& cfg, std::optional<GemmTable>* gemm_cache,
                      const std::vector<int32_t>* prev_offsets,
                      const std::vector<int32_t>* prev_rank) {
  const int32_t W = plan.num_ranks, E = plan.num_experts;
  const size_t Wz = static_cast<size_t>(W);
  LayerResult res;
  res.kept_previous = plan.kept_previous;
  // (expert, rank) cells of the previous placement: a replica of this plan outside them
  // was placed anew (hysteresis.cpp with_hysteresis counts the same way)
  // (an empty previous placement: the layer's first step, every replica placed anew)
  const bool known_prev = prev_offsets && prev_rank;
  thread_local std::vector<uint8_t> had_EW;
  had_EW.assign(known_prev ? static_cast<size_t>(E) * Wz : 0, 0);
  if (known_prev && !prev_offsets->empty()) {
    if (prev_offsets->size() != static_cast<size_t>(E) + 1 ||
        prev_rank->size() != static_cast<size_t>(prev_offsets->back()))
      throw std::invalid_argument("simulate: the previous placement must have E + 1 offsets "
                                  "and one rank per instance (a Plan's instance_offsets, "
                                  "instance_rank)");
    for (int32_t e = 0; e < E; ++e)
      for (int32_t i = (*prev_offsets)[e]; i < (*prev_offsets)[e + 1]; ++i) {
        const int32_t r = (*prev_rank)[i];
        if (r < 0 || r >= W) throw std::invalid_argument("simulate: a previous instance's rank "
                                                         "is outside [0, W)");
        had_EW[static_cast<size_t>(e) * Wz + r] = 1;
      }
  }
  res.feasible = plan.feasible;
  res.binding = plan.binding;
  res.reason = plan.reason;
  res.limit_bytes = plan.limit_bytes;
  res.replicas = plan.replicas;
  int64_t retained = 0;  // a local: a sum into res.* stored on every entry
  for (int32_t e = 0; e < E; ++e) retained += plan.quota_E[e];
  res.retained = retained;
  if (plan.policy == planner::PolicyKind::kSymi) {
    // symi shards every expert's optimizer state over the group's ranks (symi.cpp: E x
    // optimizer / W per rank), so a rank reduces and steps ceil(E / W) experts' worth,
    // whichever copies it holds; its first copies mean nothing there
    res.owned_experts_max = (E + W - 1) / W;
  } else {  // experts per owner (an expert's first instance), for the step terms (step.h)
    thread_local std::vector<int32_t> owned_W;
    owned_W.assign(static_cast<size_t>(W), 0);
    for (int32_t e = 0; e < E; ++e) {
      const int32_t k = ++owned_W[static_cast<size_t>(plan.instance_rank[plan.instance_offsets[e]])];
      res.owned_experts_max = std::max(res.owned_experts_max, k);
    }
  }
  // memory: each part's maximum over ranks and the largest rank's total
  for (const auto& m : plan.memory_W) {
    res.memory_max.base_experts = std::max(res.memory_max.base_experts, m.base_experts);
    res.memory_max.replicas = std::max(res.memory_max.replicas, m.replicas);
    res.memory_max.forward_tokens = std::max(res.memory_max.forward_tokens, m.forward_tokens);
    res.memory_max.backward_tokens = std::max(res.memory_max.backward_tokens, m.backward_tokens);
    res.memory_peak = std::max(res.memory_peak, m.total());
  }
  // pairs per source, and in all (integers: the sum source by source is exact)
  std::vector<int64_t> P_W(Wz, 0);
  int64_t pairs = 0;
  for (int32_t s = 0; s < W; ++s) {
    const int64_t* L_E = in.load_WE.data() + static_cast<size_t>(s) * E;
    int64_t P = 0;
    for (int32_t e = 0; e < E; ++e) P += L_E[e];
    P_W[s] = P;
    pairs += P;
  }
  res.pairs = pairs;
  const double rb = static_cast<double>(cfg.hidden * cfg.elem_bytes);  // one activation row
  // rows per (source, rank) and per-rank counts
  if (cfg.link.gpus_per_node < 1) throw std::invalid_argument("gpus_per_node must be >= 1");
  const int32_t G = cfg.link.gpus_per_node;
  double mean_f = 0, mean_b = 0, max_f = 0, max_b = 0;
  for (int32_t r = 0; r < W; ++r) {
    mean_f += plan.forward_rows_W[r]; mean_b += plan.backward_rows_W[r];
    max_f = std::max(max_f, double(plan.forward_rows_W[r]));
    max_b = std::max(max_b, double(plan.backward_rows_W[r]));
  }
  mean_f /= W; mean_b /= W;
  res.fwd_imbalance = mean_f > 0 ? max_f / mean_f : 1.0;
  res.bwd_imbalance = mean_b > 0 ? max_b / mean_b : 1.0;
  // an infeasible plan is reported, never timed: only the per-rank bytes (when asked
  // for) need its (instance, source) cells
  const bool timed = plan.feasible;
  if (!timed && !cfg.per_rank_bytes) {
    for (double* t : {&res.fwd_ms, &res.bwd_ms, &res.src_fwd_ms, &res.dispatch_ms,
                      &res.expert_fwd_ms, &res.combine_ms, &res.src_bwd_ms, &res.grad_a2a_ms,
                      &res.expert_bwd_ms, &res.dx_a2a_ms, &res.replica_ms, &res.offload_ms,
                      &res.broadcast_ms, &res.overlap_fwd_ms, &res.overlap_bwd_ms})
      *t = kNaN;
    return res;
  }
  std::vector<int64_t> R_W(Wz, 0), recv_f_W(Wz, 0), recv_b_W(Wz, 0);
  // each instance's rows per rank; kept per thread so that their capacity is reused
  // from layer to layer (simulate_trace runs millions of layers)
  thread_local std::vector<std::vector<double>> rows_f_W, rows_b_W;
  rows_f_W.resize(Wz);
  rows_b_W.resize(Wz);
  for (size_t r = 0; r < Wz; ++r) {
    rows_f_W[r].clear();
    rows_b_W[r].clear();
  }
  // pair rows from source s computed on rank d, forward and retained, as their
  // transposes (row d: what rank d computes, contiguous; a2a.h takes them so, and the
  // column writes of M[s][d] were a tenth of the simulator's time), and the replica
  // bytes from rank a to rank b, forward and backward, as sparse cells (a handful per
  // layer; dense W x W matrices cost two clears and two scans each)
  thread_local std::vector<int64_t> Mf_t, Mb_t;
  thread_local std::vector<uint8_t> filled_W;  // rank rows of Mf_t / Mb_t written so far
  thread_local std::vector<PairCell> rep_f, rep_b, rep_mv, rep_cast;
  Mf_t.resize(Wz * Wz);
  Mb_t.resize(Wz * Wz);
  filled_W.assign(Wz, 0);
  rep_f.clear();
  rep_b.clear();
  rep_mv.clear();
  rep_cast.clear();
  // replica weights stream per layer (ultraep, lrmoe); symi places its copies with the
  // weight update of the step before, off the layer's critical path
  const bool stream = plan.policy != planner::PolicyKind::kSymi;
  for (int32_t e = 0; e < E; ++e) {
    const int32_t owner = plan.instance_rank[plan.instance_offsets[e]];
    for (int32_t i = plan.instance_offsets[e]; i < plan.instance_offsets[e + 1]; ++i) {
      const int32_t r = plan.instance_rank[i];
      int64_t f = 0, b = 0;
      const int64_t* F_W = plan.forward_IW.data() + static_cast<size_t>(i) * W;
      const int64_t* B_W = plan.retained_IW.data() + static_cast<size_t>(i) * W;
      int64_t* Mf_r = Mf_t.data() + static_cast<size_t>(r) * Wz;
      int64_t* Mb_r = Mb_t.data() + static_cast<size_t>(r) * Wz;
      if (!filled_W[r]) {  // the rank's first instance writes its rows (no clear first)
        filled_W[r] = 1;
        for (int32_t s = 0; s < W; ++s) {
          const int64_t fi = F_W[s], bi = B_W[s];
          f += fi;
          b += bi;
          R_W[s] += bi;
          Mf_r[s] = fi;
          Mb_r[s] = bi;
        }
      } else {
        for (int32_t s = 0; s < W; ++s) {
          const int64_t fi = F_W[s], bi = B_W[s];
          f += fi;
          b += bi;
          R_W[s] += bi;
          Mf_r[s] += fi;
          Mb_r[s] += bi;
        }
      }
      if (f > 0) rows_f_W[r].push_back(static_cast<double>(f));
      if (b > 0) rows_b_W[r].push_back(static_cast<double>(b));
      recv_f_W[r] += f;
      recv_b_W[r] += b;
      const bool replica = i != plan.instance_offsets[e];
      const bool moved = replica && stream &&
                         (!known_prev || !had_EW[static_cast<size_t>(e) * Wz + r]);
      if (moved && known_prev) res.moved_replicas += 1;
      if (replica && stream && cfg.resident_replicas) {
        // the slot is the replica's own from step to step: a replica placed anew fetches
        // its weights (rep_mv), every replica's weights are refreshed after the optimizer
        // step (rep_cast, as symi's copies), its gradient is reduced back into the owner's
        if (moved) rep_mv.push_back({owner, r, in.memory.expert_weight_bytes});
        rep_cast.push_back({owner, r, in.memory.expert_weight_bytes});
        rep_b.push_back({r, owner, in.memory.expert_grad_bytes});
      } else if (replica && stream) {
        // weights to the replica for the forward, again for the backward (the slot is
        // reused across layers), its gradient reduced back into the owner's
        rep_f.push_back({owner, r, in.memory.expert_weight_bytes});
        rep_b.push_back({owner, r, in.memory.expert_weight_bytes});
        rep_b.push_back({r, owner, in.memory.expert_grad_bytes});
      } else if (i != plan.instance_offsets[e]) {
        // symi: the copy gets the owner's new weights once per step (step.h
        // symi_broadcast_ms; rep_f is otherwise unused for symi)
        rep_f.push_back({owner, r, in.memory.expert_weight_bytes});
      }
    }
  }
  for (size_t r = 0; r < Wz; ++r)  // ranks without an instance receive nothing
    if (!filled_W[r]) {
      std::fill(Mf_t.begin() + r * Wz, Mf_t.begin() + (r + 1) * Wz, int64_t(0));
      std::fill(Mb_t.begin() + r * Wz, Mb_t.begin() + (r + 1) * Wz, int64_t(0));
    }
  // bytes each rank sends into each collective, self rows included (the EP layer's count)
  const int64_t rbi = cfg.hidden * cfg.elem_bytes;
  if (cfg.per_rank_bytes) res.sent_bytes_5W.assign(5 * Wz, 0);
  for (int32_t s = 0; cfg.per_rank_bytes && s < W; ++s) {
    const int64_t recv_f = recv_f_W[s], recv_b = recv_b_W[s];
    res.sent_bytes_5W[0 * Wz + s] = P_W[s] * rbi;
    res.sent_bytes_5W[1 * Wz + s] = recv_f * (rbi + 4);
    res.sent_bytes_5W[2 * Wz + s] = R_W[s] * rbi;
    res.sent_bytes_5W[3 * Wz + s] = R_W[s] * 4;
    res.sent_bytes_5W[4 * Wz + s] = recv_b * rbi;
  }
  if (!timed) {
    for (double* t : {&res.fwd_ms, &res.bwd_ms, &res.src_fwd_ms, &res.dispatch_ms,
                      &res.expert_fwd_ms, &res.combine_ms, &res.src_bwd_ms, &res.grad_a2a_ms,
                      &res.expert_bwd_ms, &res.dx_a2a_ms, &res.replica_ms, &res.offload_ms,
                      &res.broadcast_ms, &res.overlap_fwd_ms, &res.overlap_bwd_ms})
      *t = kNaN;
    return res;
  }
  const PerRowCosts& c = cfg.cost.per_row;
  const double ep_f = W > 1 ? c.ep_fwd : 0.0, ep_b = W > 1 ? c.ep_bwd : 0.0;
  if (!gemm_cache->has_value()) gemm_cache->emplace(cfg.cost.gemm, cfg.cost.roofline);
  const GemmTable& gemm = **gemm_cache;
  // the four token all-to-alls (a2a.h): dispatch and gradient rows from sources to
  // expert ranks, deduplicated over the token's top_k experts; combine and dx the same
  // rows back (reversed). Row sizes as the EP layer's: x rows, y + fp32 phi_sq, gradient
  // + int32 position, dx rows
  thread_local TokenDispatch Df, Db, Df_back, Db_back;
  expected_dispatch_transposed(Mf_t.data(), W, cfg.top_k, G, &Df);
  // every row retained (the baselines, c = 0): the gradient's rows are the dispatch's,
  // so is their dedup; comparing is a tenth of recomputing it
  if (Mb_t == Mf_t) Db = Df;
  else expected_dispatch_transposed(Mb_t.data(), W, cfg.top_k, G, &Db);
  reversed(Df, &Df_back);
  reversed(Db, &Db_back);
  res.dispatch_ms = hierarchical_a2a_ms(Df, rb, cfg.link);
  res.combine_ms = hierarchical_a2a_ms(Df_back, rb + 4, cfg.link);
  res.grad_a2a_ms = hierarchical_a2a_ms(Db, rb + 4, cfg.link);
  res.dx_a2a_ms = hierarchical_a2a_ms(Db_back, rb, cfg.link);
  res.fwd_link_bytes = link_bytes(Df, rb) + link_bytes(Df_back, rb + 4);
  res.bwd_link_bytes = link_bytes(Db, rb + 4) + link_bytes(Db_back, rb);
  double pre_f = 0, post_f = 0, pre_b = 0, post_b = 0, gf = 0, gb = 0, d2h = 0, h2d = 0;
  for (int32_t r = 0; r < W; ++r) {
    const double P = static_cast<double>(P_W[r]), R = static_cast<double>(R_W[r]);
    const double F = static_cast<double>(plan.forward_rows_W[r]);
    const double B = static_cast<double>(plan.backward_rows_W[r]);
    pre_f = std::max(pre_f, P * (c.router + c.permute + c.fwd_rest));
    post_f = std::max(post_f, P * c.combine);
    pre_b = std::max(pre_b, P * (c.router_grad + c.score + c.select + c.bwd_rest));
    post_b = std::max(post_b, R * c.scatter);
    gf = std::max(gf, gemm.ms_instances(rows_f_W[r], false) + F * ep_f);
    gb = std::max(gb, gemm.ms_instances(rows_b_W[r], true) + B * (c.compact + ep_b));
    if (cfg.offload) {
      d2h = std::max(d2h, transfer_ms(F * cfg.offload_row_bytes, cfg.cost.h2d_GBps));
      h2d = std::max(h2d, transfer_ms(B * cfg.offload_row_bytes, cfg.cost.h2d_GBps));
      res.offload_bytes += (F + B) * cfg.offload_row_bytes;
    }
  }
  res.src_fwd_ms = pre_f + post_f;
  res.expert_fwd_ms = gf;
  res.src_bwd_ms = pre_b + post_b;
  res.expert_bwd_ms = gb;
  // replica weights (and gradients back) as one-byte rows of the same all-to-all, no
  // dedup: each copy is its own transfer
  double rep_f_bytes = 0, rep_b_bytes = 0, t_rep_f = 0, t_rep_b = 0;
  if (stream && res.replicas > 0) {
    thread_local TokenDispatch Dr;
    if (!rep_f.empty()) {
      sorted_cells(&rep_f);
      expected_dispatch_sparse(rep_f, W, 1, G, &Dr);
      t_rep_f = hierarchical_a2a_ms(Dr, 1.0, cfg.link);
      rep_f_bytes = link_bytes(Dr, 1.0);
    }
    if (!rep_mv.empty()) {
      // Where the fetch of a moved replica goes: in the forward, before the expert GEMMs,
      // in full. Which replicas are new is known only once the plan is made from the
      // all-gathered counts, after the router (planner/plan.h: every rank computes the
      // same plan from the same counts), and from then to the GEMMs the links carry the
      // dispatch all-to-all (dispatch_ms above): the fetch shares those links, so it is
      // not hidden behind the dispatch (the per-layer stream below is, a bound in its
      // favour). Its GEMM waits for it.
      sorted_cells(&rep_mv);
      expected_dispatch_sparse(rep_mv, W, 1, G, &Dr);
      res.move_ms = hierarchical_a2a_ms(Dr, 1.0, cfg.link);
      res.move_bytes = link_bytes(Dr, 1.0);
    }
    if (!rep_cast.empty()) {
      // resident replicas: every replica's weights after the optimizer step (step.h
      // step_terms adds broadcast_ms to the step, as symi's)
      sorted_cells(&rep_cast);
      expected_dispatch_sparse(rep_cast, W, 1, G, &Dr);
      res.broadcast_ms = hierarchical_a2a_ms(Dr, 1.0, cfg.link);
    }
    sorted_cells(&rep_b);
    expected_dispatch_sparse(rep_b, W, 1, G, &Dr);
    t_rep_b = hierarchical_a2a_ms(Dr, 1.0, cfg.link);
    rep_b_bytes = link_bytes(Dr, 1.0);
  }
  if (!stream && res.replicas > 0) {
    // symi's copies as one all-to-all of weight-byte rows, no dedup: the same
    // expectation as symi_broadcast_ms's dense all_to_all_ms, linear in the copies
    thread_local TokenDispatch Db_cast;
    sorted_cells(&rep_f);
    expected_dispatch_sparse(rep_f, W, 1, G, &Db_cast);
    res.broadcast_ms = hierarchical_a2a_ms(Db_cast, 1.0, cfg.link);
  }
  res.replica_bytes = rep_f_bytes + rep_b_bytes + res.move_bytes;
  const bool any_rep = rep_f_bytes + rep_b_bytes > 0;
  // replica weights stream while the sources route and dispatch; their backward copies
  // and gradient reduction while the expert backward runs: only the excess is exposed
  const double rep_f_exposed = any_rep ? std::max(0.0, t_rep_f - (res.src_fwd_ms + res.dispatch_ms)) : 0.0;
  const double rep_b_exposed = any_rep ? std::max(0.0, t_rep_b - res.expert_bwd_ms) : 0.0;
  res.replica_ms = rep_f_exposed + rep_b_exposed;
  double fwd = res.src_fwd_ms + res.dispatch_ms + res.expert_fwd_ms + res.combine_ms;
  double bwd = res.src_bwd_ms + res.grad_a2a_ms + res.expert_bwd_ms + res.dx_a2a_ms;
  const int32_t n = cfg.link.overlap_chunks;
  if (n < 1) throw std::invalid_argument("simulate: link.overlap_chunks must be >= 1");
  if (cfg.link.overlap_tile_rows < 0)
    throw std::invalid_argument("simulate: link.overlap_tile_rows must be >= 0 (rows per "
                                "GEMM tile of the tile-level overlap; 0: off)");
  if (!(cfg.link.overlap_comm_share >= 0 && cfg.link.overlap_comm_share < 1))
    throw std::invalid_argument("simulate: link.overlap_comm_share must be in [0, 1) (the "
                                "share of the SMs the fused kernel gives to communication)");
  if (cfg.link.overlap_tile_rows > 0 && n > 1)
    throw std::invalid_argument("simulate: link.overlap_tile_rows > 0 (tile-level overlap) "
                                "and link.overlap_chunks > 1 (chunked) are two models of one "
                                "overlap; set one of them");
  if (n > 1) {
    // one chunk of each phase: the all-to-alls at 1/n of the row bytes (their latencies
    // whole), every rank's GEMMs at 1/n of its instances' rows
    const double inv = 1.0 / n;
    double gf1 = 0, gb1 = 0;
    thread_local std::vector<double> part;
    for (int32_t r = 0; r < W; ++r) {
      const double F = static_cast<double>(plan.forward_rows_W[r]);
      const double B = static_cast<double>(plan.backward_rows_W[r]);
      part.assign(rows_f_W[r].begin(), rows_f_W[r].end());
      for (double& x : part) x *= inv;
      gf1 = std::max(gf1, gemm.ms_instances(part, false) + F * inv * ep_f);
      part.assign(rows_b_W[r].begin(), rows_b_W[r].end());
      for (double& x : part) x *= inv;
      gb1 = std::max(gb1, gemm.ms_instances(part, true) + B * inv * (c.compact + ep_b));
    }
    const double pf = pipelined_ms(hierarchical_a2a_ms(Df, rb * inv, cfg.link), gf1,
                                   hierarchical_a2a_ms(Df_back, (rb + 4) * inv, cfg.link), n);
    const double pb = pipelined_ms(hierarchical_a2a_ms(Db, (rb + 4) * inv, cfg.link), gb1,
                                   hierarchical_a2a_ms(Db_back, rb * inv, cfg.link), n);
    res.overlap_fwd_ms = res.dispatch_ms + res.expert_fwd_ms + res.combine_ms - pf;
    res.overlap_bwd_ms = res.grad_a2a_ms + res.expert_bwd_ms + res.dx_a2a_ms - pb;
    fwd = res.src_fwd_ms + pf;
    bwd = res.src_bwd_ms + pb;
  }
  const int32_t tile = cfg.link.overlap_tile_rows;
  const double share = cfg.link.overlap_comm_share;
  if (tile > 0) {
    // every rank's GEMMs (and the EP layer's own row work) whole, on 1 - share of the
    // SMs; the slowest rank's all-to-alls beside them (LinkModel::overlap_tile_rows)
    const double slow = 1.0 / (1.0 - share);
    const double a2a_f = res.dispatch_ms + res.combine_ms;
    const double a2a_b = res.grad_a2a_ms + res.dx_a2a_ms;
    double pf = 0, pb = 0;
    for (int32_t r = 0; r < W; ++r) {
      const double F = static_cast<double>(plan.forward_rows_W[r]);
      const double B = static_cast<double>(plan.backward_rows_W[r]);
      const double cf = (gemm.ms_instances(rows_f_W[r], false) + F * ep_f) * slow;
      const double cb = (gemm.ms_instances(rows_b_W[r], true) + B * (c.compact + ep_b)) * slow;
      pf = std::max(pf, tiled_ms(a2a_f, cf, tiles_of(rows_f_W[r], tile)));
      pb = std::max(pb, tiled_ms(a2a_b, cb, tiles_of(rows_b_W[r], tile)));
    }
    res.overlap_fwd_ms = a2a_f + res.expert_fwd_ms - pf;
    res.overlap_bwd_ms = a2a_b + res.expert_bwd_ms - pb;
    fwd = res.src_fwd_ms + pf;
    bwd = res.src_bwd_ms + pb;
  }
  // offload: saved rows leave during the layer's expert forward; the retained rows come
  // back during the backward of the layer above (about as long as this one)
  const double off_f = std::max(0.0, d2h - res.expert_fwd_ms);
  const double off_b = std::max(0.0, h2d - bwd);
  res.offload_ms = off_f + off_b;
  res.fwd_ms = fwd + rep_f_exposed + res.move_ms + off_f;
  res.bwd_ms = bwd + rep_b_exposed + off_b;
  return res;
}

}  // namespace detail

LayerResult simulate_plan(const planner::Plan& plan, const planner::PlanInput& in,
                          const SimConfig& cfg) {
  std::optional<GemmTable> gemm;
  const bool prev = !in.previous_instance_offsets.empty();
  return detail::time_plan(plan, in, cfg, &gemm, prev ? &in.previous_instance_offsets : nullptr,
                           prev ? &in.previous_instance_rank : nullptr);
}

int64_t derived_replica_cost_rows(const SimConfig& cfg, int64_t weight_bytes,
                                  double experts_per_rank, double rows_per_expert) {
  if (weight_bytes < 0)
    throw std::invalid_argument("replica cost: weight_bytes must be >= 0 (one expert's "
                                "weights, 3 x hidden x moe_intermediate x dtype bytes)");
  if (!(experts_per_rank > 0) || !(rows_per_expert > 0))
    throw std::invalid_argument("replica cost: experts_per_rank and rows_per_expert must be "
                                "> 0 (E / W and the mean routed rows per expert)");
  const double t_w = transfer_ms(static_cast<double>(weight_bytes), cfg.link.intra_GBps) +
                     (weight_bytes > 0 ? cfg.link.intra_latency_us * 1e-3 : 0.0);
  const GemmTable gemm(cfg.cost.gemm, cfg.cost.roofline);
  const double k = experts_per_rank, rows = k * rows_per_expert;
  const double t_row = (gemm.ms(k, rows, false) + gemm.ms(k, rows, true)) / (2.0 * rows);
  if (!(t_row > 0)) return 0;
  return static_cast<int64_t>(std::llround(t_w / t_row));
}

LayerResult simulate_layer(const std::string& policy, const planner::PlanInput& input,
                           const SimConfig& cfg) {
  const planner::Plan plan = planner::make_plan(policy, input);
  return simulate_plan(plan, input, cfg);
}

}  // namespace sim
}  // namespace lrmoe
