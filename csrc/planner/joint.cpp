// joint_refine (joint.h): local search on max rank time over cuts and replicas.
#include "planner/joint.h"

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>

#include "planner/common.h"

namespace lrmoe {
namespace planner {
namespace {

constexpr int64_t kUnbounded = std::numeric_limits<int64_t>::max() / 4;

struct Inst {
  int32_t rank;
  int64_t f, b;
};

// One candidate step; `value` = max(t_r*, t_j) after it.
struct Move {
  int64_t value = kUnbounded;
  bool fresh = false;      // a new replica on j
  bool far = false;        // j is on another node than the bottleneck (gpus_per_node)
  bool cut = false;        // a cut moved from (e, i) to (e2, k)
  int32_t e = -1, i = -1, j = -1, e2 = -1, k = -1;
  int64_t df = 0, db = 0;
  // fewer new replicas first at equal value: they cost a slot for nothing
  // then moves inside the bottleneck's node (NVLink) before moves over the network
  bool better(const Move& o) const {
    if (value != o.value) return value < o.value;
    if (fresh != o.fresh) return !fresh;
    return !far && o.far;
  }
};

}  // namespace

std::vector<int64_t> rank_times(const Plan& p, int64_t kappa) {
  if (kappa < 0)
    throw std::invalid_argument("replica_cost_rows must be >= 0, got " + std::to_string(kappa));
  std::vector<int64_t> t(static_cast<size_t>(p.num_ranks), 0);
  for (int32_t r = 0; r < p.num_ranks; ++r) t[r] = p.forward_rows_W[r] + p.backward_rows_W[r];
  for (int32_t e = 0; e < p.num_experts; ++e)
    for (int32_t i = p.instance_offsets[e] + 1; i < p.instance_offsets[e + 1]; ++i)
      t[p.instance_rank[i]] += kappa;
  return t;
}

namespace detail {

Plan joint_refine(const PlanInput& in, const Plan& start, const std::vector<int64_t>& floor_E) {
  const int32_t W = in.num_ranks, E = in.num_experts, per = E / W;
  const int32_t G = node_size(in);  // node(r) = r / G
  const MemoryModel& m = in.memory;
  const int64_t copy = m.expert_weight_bytes + m.expert_grad_bytes;
  const int64_t base = (copy + (m.optimizer_on_device ? m.expert_optimizer_bytes : 0)) * per;
  const int64_t limit = m.budget_bytes - m.resident_bytes;
  const int64_t fb = m.forward_row_bytes, bb = m.backward_row_bytes;
  const int64_t kappa = in.replica_cost_rows;
  const int64_t cap = in.backward_row_capacity > 0 ? in.backward_row_capacity : kUnbounded;

  std::vector<std::vector<Inst>> X(static_cast<size_t>(E));
  std::vector<int64_t> Q(start.quota_E);
  std::vector<int64_t> F(static_cast<size_t>(W), 0), B(static_cast<size_t>(W), 0);
  std::vector<int32_t> reps(static_cast<size_t>(W), 0);
  std::vector<int32_t> at_EW(static_cast<size_t>(E) * W, -1);  // index into X[e], or -1
  for (int32_t e = 0; e < E; ++e)
    for (int32_t i = start.instance_offsets[e]; i < start.instance_offsets[e + 1]; ++i) {
      Inst x{start.instance_rank[i], 0, 0};
      for (int32_t s = 0; s < W; ++s) {
        x.f += start.forward_IW[static_cast<size_t>(i) * W + s];
        x.b += start.retained_IW[static_cast<size_t>(i) * W + s];
      }
      at_EW[static_cast<size_t>(e) * W + x.rank] = static_cast<int32_t>(X[e].size());
      F[x.rank] += x.f;
      B[x.rank] += x.b;
      if (i > start.instance_offsets[e]) reps[x.rank] += 1;
      X[e].push_back(x);
    }
  auto t = [&](int32_t r) { return F[r] + B[r] + kappa * reps[r]; };
  auto bytes = [&](int32_t r) { return base + reps[r] * copy + F[r] * fb + B[r] * bb; };
  auto fits = [&](int32_t j, int64_t df, int64_t db, bool fresh) {
    return bytes(j) + (fresh ? copy : 0) + df * fb + db * bb <= limit && B[j] + db <= cap;
  };

  // the split of x rows moved from a (spare s_a = f - b) to an instance with spare s_k:
  // df + db = x, 0 <= db <= b_a, df <= f_a, and b <= f after on both sides; the fewer
  // bytes at the receiver among the valid db. false when no split exists.
  auto split = [&](const Inst& a, int64_t s_k, int64_t x, int64_t* df, int64_t* db) {
    const int64_t s_a = a.f - a.b;
    const int64_t lo = std::max<int64_t>({0, x - a.f, (x - s_a + 1) / 2});
    const int64_t hi = std::min<int64_t>({a.b, (x + s_k) / 2, x});
    if (lo > hi) return false;
    *db = bb >= fb ? lo : hi;
    *df = x - *db;
    return true;
  };

  const int64_t max_steps = 64 * (static_cast<int64_t>(E) + W) + 1024;  // a guard only
  for (int64_t step = 0; step < max_steps; ++step) {
    int32_t rs = 0;
    for (int32_t r = 1; r < W; ++r)
      if (t(r) > t(rs)) rs = r;
    const int64_t T = t(rs);
    Move best;
    best.value = T;  // a move must end strictly below T
    for (int32_t e = 0; e < E; ++e) {
      const int32_t i = at_EW[static_cast<size_t>(e) * W + rs];
      if (i < 0) continue;
      const Inst& a = X[e][i];
      if (a.f == 0) continue;
      for (int32_t j = 0; j < W; ++j) {  // rows to another instance or a new replica
        if (j == rs) continue;
        const int32_t k = at_EW[static_cast<size_t>(e) * W + j];
        const bool fresh = k < 0;
        if (fresh && reps[j] >= in.replica_slots) continue;
        const int64_t gap = T - t(j) - (fresh ? kappa : 0);
        if (gap < 2) continue;
        const int64_t s_k = fresh ? 0 : X[e][k].f - X[e][k].b;
        int64_t df = 0, db = 0;
        // with no spare rows on either side rows move in (forward, retained) pairs, so an
        // odd x may fail where x - 1 fits: ok(x) tries both and sets x to the one taken
        auto ok = [&](int64_t* x) {
          for (int64_t y : {*x, *x - 1})
            if (y > 0 && split(a, s_k, y, &df, &db) && fits(j, df, db, fresh)) {
              *x = y;
              return true;
            }
          return false;
        };
        int64_t x = gap / 2;
        if (!ok(&x)) {  // the largest x that fits, by bisection (x = 0 always does)
          int64_t lo = 0, hi = x;
          while (lo < hi) {
            const int64_t mid = lo + (hi - lo + 1) / 2;
            int64_t y = mid;  // ok(mid or mid - 1): monotone in mid
            if (ok(&y)) lo = mid; else hi = mid - 1;
          }
          x = lo;
          if (x == 0 || !ok(&x)) continue;
        }
        Move mv;
        mv.value = std::max(T - x, T - gap + x);
        mv.fresh = fresh;
        mv.far = j / G != rs / G;
        mv.e = e; mv.i = i; mv.j = j; mv.k = k; mv.df = df; mv.db = db;
        if (mv.better(best)) best = mv;
      }
      // a cut moved to rows already computed elsewhere (c as a budget)
      const int64_t can_cut = std::min(a.b, Q[e] - floor_E[e]);
      if (can_cut <= 0) continue;
      for (int32_t e2 = 0; e2 < E; ++e2) {
        if (e2 == e) continue;
        for (int32_t k = 0; k < static_cast<int32_t>(X[e2].size()); ++k) {
          const Inst& c = X[e2][k];
          if (c.rank == rs || c.f == c.b) continue;
          const int64_t gap = T - t(c.rank);
          if (gap < 2) continue;
          int64_t d = std::min({gap / 2, can_cut, c.f - c.b, cap - B[c.rank]});
          if (bb > 0) d = std::min(d, (limit - bytes(c.rank)) / bb);
          if (d <= 0) continue;
          Move mv;
          mv.value = std::max(T - d, T - gap + d);
          mv.cut = true;
          mv.far = c.rank / G != rs / G;
          mv.e = e; mv.i = i; mv.j = c.rank; mv.e2 = e2; mv.k = k; mv.db = d;
          if (mv.better(best)) best = mv;
        }
      }
    }
    if (best.e < 0) break;  // no move lowers the bottleneck
    Inst& a = X[best.e][best.i];
    if (best.cut) {
      Inst& c = X[best.e2][best.k];
      a.b -= best.db; Q[best.e] -= best.db; B[rs] -= best.db;
      c.b += best.db; Q[best.e2] += best.db; B[c.rank] += best.db;
      continue;
    }
    a.f -= best.df; a.b -= best.db;
    F[rs] -= best.df; B[rs] -= best.db;
    if (best.fresh) {
      at_EW[static_cast<size_t>(best.e) * W + best.j] = static_cast<int32_t>(X[best.e].size());
      X[best.e].push_back({best.j, best.df, best.db});  // invalidates `a`
      reps[best.j] += 1;
    } else {
      Inst& k = X[best.e][best.k];
      k.f += best.df; k.b += best.db;
    }
    F[best.j] += best.df; B[best.j] += best.db;
  }

  // flatten, without the replicas left empty
  Layout lay;
  std::vector<int64_t> retained;
  lay.offsets.assign(static_cast<size_t>(E) + 1, 0);
  std::fill(reps.begin(), reps.end(), 0);
  for (int32_t e = 0; e < E; ++e) {
    for (size_t i = 0; i < X[e].size(); ++i) {
      const Inst& x = X[e][i];
      if (i > 0 && x.f == 0) continue;
      if (i > 0) reps[x.rank] += 1;
      lay.rank.push_back(x.rank);
      lay.rows.push_back(x.f);
      retained.push_back(x.b);
    }
    lay.offsets[e + 1] = static_cast<int32_t>(lay.rank.size());
  }
  RankBytes rb;
  rb.base_W.assign(static_cast<size_t>(W), base);
  rb.replica_W.resize(static_cast<size_t>(W));
  for (int32_t r = 0; r < W; ++r) rb.replica_W[r] = reps[r] * copy;
  return assemble(in, PolicyKind::kLRMoE, lay, Q, rb, true, 0, &retained);
}

}  // namespace detail
}  // namespace planner
}  // namespace lrmoe
