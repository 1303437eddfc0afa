// select, CPU: fill each expert's quota with its best rows and compact them.
//
// Legend: P rows (expert-sorted order), E experts, R retained rows, n_e / Q_e
// rows / quota of expert e, score_P, row_pair_P (pair id of each row),
// offsets_E (inclusive ends), kept_* (R) the compacted buffers, pair_kept_P.
//
// Every ordering, sum and sampling step is written to match select.cu bit for
// bit (csrc/core/selection.h holds the shared pieces): the per-expert sort is by
// (score desc, row asc) with NaN last; the importance prefix sums follow the
// canonical 32-chunk order of that header, emulated here lane by lane.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "core/random.h"
#include "core/selection.h"
#include "ops/common.h"
#include "ops/select.h"

namespace lrmoe {
namespace {

// Canonical prefix sums of x(0..n-1) (see core/selection.h) into out.
template <typename F>
void canonical_prefix(int64_t n, F x, double* out) {
  const int64_t cl = core::scan_chunk_len(n);
  double totals[core::kScanLanes];
  for (int l = 0; l < core::kScanLanes; ++l) {
    const int64_t lo = l * cl, hi = std::min(n, lo + cl);
    double t = 0.0;
    for (int64_t i = lo; i < hi; ++i) t += x(i);
    totals[l] = t;
  }
  for (int l = 0; l < core::kScanLanes; ++l) {
    double base = 0.0;
    for (int j = 0; j < l; ++j) base += totals[j];
    const int64_t lo = l * cl, hi = std::min(n, lo + cl);
    double local = 0.0;
    for (int64_t i = lo; i < hi; ++i) {
      local += x(i);
      out[i] = base + local;
    }
  }
}

struct ExpertOut {
  int32_t* kept_rows;
  int32_t* kept_pair;
  int32_t* pair_kept;
  float* kept_scale;
};

// Rows [start, start + n) of one expert, ranked by (score desc, row asc).
std::vector<std::pair<uint32_t, int32_t>> rank_rows(const float* score, int64_t start, int64_t n) {
  std::vector<std::pair<uint32_t, int32_t>> key_row(n);
  for (int64_t i = 0; i < n; ++i)
    key_row[i] = {core::score_order_key(score[start + i]), static_cast<int32_t>(start + i)};
  std::sort(key_row.begin(), key_row.end());
  return key_row;
}

void select_topk_expert(const float* score, const int32_t* row_pair, int64_t start, int64_t n,
                        int64_t Q, int64_t kept_start, const ExpertOut& o) {
  if (Q == 0) return;
  const auto ranked = rank_rows(score, start, n);
  std::vector<char> keep(n, 0);
  for (int64_t j = 0; j < Q; ++j) keep[ranked[j].second - start] = 1;
  int64_t pos = kept_start;
  for (int64_t i = 0; i < n; ++i) {
    if (!keep[i]) continue;
    const int32_t row = static_cast<int32_t>(start + i), pair = row_pair[row];
    o.kept_rows[pos] = row;
    o.kept_pair[pos] = pair;
    o.pair_kept[pair] = static_cast<int32_t>(pos);
    o.kept_scale[pos] = 1.0f;
    ++pos;
  }
}

void select_importance_expert(const float* score, const int32_t* row_pair, int64_t e,
                              int64_t start, int64_t n, int64_t Q, int64_t kept_start,
                              uint64_t seed, const ExpertOut& o) {
  if (Q == 0) return;
  const auto ranked = rank_rows(score, start, n);
  std::vector<double> w(n);  // weights in ranked order
  int64_t npos = 0;
  for (int64_t j = 0; j < n; ++j) {
    w[j] = core::importance_weight(score[ranked[j].second]);
    npos += w[j] > 0.0;
  }
  core::ImportancePlan plan = core::zero_weight_plan(n, npos, Q);
  if (npos > Q) {
    // T_m = sum of w[m..n), in the canonical order over the reversed sequence
    std::vector<double> tail(n);
    canonical_prefix(n, [&](int64_t i) { return w[n - 1 - i]; }, tail.data());
    int64_t m_star = Q - 1;
    for (int64_t m = 0; m < Q; ++m) {
      if (core::water_level_feasible(w[m], m, Q, tail[n - 1 - m])) { m_star = m; break; }
    }
    plan = core::water_plan(m_star, Q, tail[n - 1 - m_star]);
  }
  std::vector<double> p(n), C(n);  // row order
  for (int64_t j = 0; j < n; ++j)
    p[ranked[j].second - start] = core::inclusion_probability(plan, j, w[j]);
  canonical_prefix(n, [&](int64_t i) { return p[i]; }, C.data());
  const double u = core::uniform01(seed, core::kImportanceStream, static_cast<uint64_t>(e));
  int64_t max_d = INT64_MIN;
  for (int64_t k = 0; k < Q; ++k) {
    max_d = std::max(max_d, core::sample_point(C.data(), n, u, k));
    const int64_t i = core::sample_row(max_d, n, Q, k);
    const int32_t row = static_cast<int32_t>(start + i), pair = row_pair[row];
    const int64_t pos = kept_start + k;
    o.kept_rows[pos] = row;
    o.kept_pair[pos] = pair;
    o.pair_kept[pair] = static_cast<int32_t>(pos);
    o.kept_scale[pos] = core::inverse_probability(p[i]);
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> select_cpu(
    const at::Tensor& score, const at::Tensor& row_pair, const at::Tensor& offsets,
    const at::Tensor& quota, int64_t num_retained, c10::string_view selection_name, int64_t seed) {
  const Selection selection = parse_selection(std::string(selection_name));
  check_select_args(score, row_pair, offsets, quota, num_retained);
  const at::Tensor score_P = score.contiguous(), row_pair_P = row_pair.contiguous();
  const at::Tensor offsets_E = offsets.contiguous(), quota_E = quota.contiguous();
  const int64_t P = score_P.size(0), E = offsets_E.size(0), R = num_retained;
  const float* s = score_P.data_ptr<float>();
  const int32_t* rp = row_pair_P.data_ptr<int32_t>();
  const int32_t* off = offsets_E.data_ptr<int32_t>();
  const int32_t* q = quota_E.data_ptr<int32_t>();

  std::vector<char> seen(P, 0);  // pair_kept is an inverse: row_pair must be a permutation
  for (int64_t r = 0; r < P; ++r) {
    LRMOE_CHECK(rp[r] >= 0 && rp[r] < P, "row_pair[", r, "] = ", rp[r], " is outside [0, ", P,
                "); pass the row_pair returned by permute");
    LRMOE_CHECK(!seen[rp[r]], "row_pair must be a permutation of [0, ", P, "); pair ", rp[r],
                " appears twice (second at row ", r, ")");
    seen[rp[r]] = 1;
  }
  int64_t prev = 0, quota_sum = 0;
  for (int64_t e = 0; e < E; ++e) {
    LRMOE_CHECK(off[e] >= prev, "offsets must be non-decreasing inclusive ends starting at >= 0; "
                "offsets[", e, "] = ", off[e], " after ", prev);
    const int64_t n_e = off[e] - prev;
    LRMOE_CHECK(q[e] >= 0 && q[e] <= n_e, "quota[", e, "] = ", q[e], " must be in [0, n_e = ", n_e,
                "] (an expert keeps at most its routed rows); use lrmoe.ops.quota");
    quota_sum += q[e];
    prev = off[e];
  }
  LRMOE_CHECK(E == 0 || off[E - 1] == P, "offsets[-1] must equal the number of rows ", P, ", got ",
              E ? off[E - 1] : 0);
  LRMOE_CHECK(quota_sum == R, "sum(quota) = ", quota_sum, " must equal num_retained = ", R,
              "; pass num_retained = int(quota.sum()) or floor((1 - c) * P) from the same c");

  const auto i32 = row_pair_P.options();
  at::Tensor kept_rows = at::empty({R}, i32), kept_pair = at::empty({R}, i32);
  at::Tensor pair_kept = at::full({P}, -1, i32), kept_offsets = at::empty({E}, i32);
  at::Tensor kept_scale = at::empty({R}, score_P.options());
  at::Tensor retained_mass = at::empty({}, score_P.options());
  int32_t* ko = kept_offsets.data_ptr<int32_t>();
  int64_t acc = 0;
  for (int64_t e = 0; e < E; ++e) ko[e] = static_cast<int32_t>(acc += q[e]);
  const ExpertOut o{kept_rows.data_ptr<int32_t>(), kept_pair.data_ptr<int32_t>(),
                    pair_kept.data_ptr<int32_t>(), kept_scale.data_ptr<float>()};

  at::parallel_for(0, E, 1, [&](int64_t e0, int64_t e1) {
    for (int64_t e = e0; e < e1; ++e) {
      const int64_t start = e ? off[e - 1] : 0, n = off[e] - start;
      const int64_t kept_start = e ? ko[e - 1] : 0;
      if (selection == Selection::kTopk)
        select_topk_expert(s, rp, start, n, q[e], kept_start, o);
      else
        select_importance_expert(s, rp, e, start, n, q[e], kept_start,
                                 static_cast<uint64_t>(seed), o);
    }
  });

  double total = 0.0, kept = 0.0;
  for (int64_t r = 0; r < P; ++r) total += s[r];
  for (int64_t k = 0; k < R; ++k) kept += s[o.kept_rows[k]];
  retained_mass.fill_(total == 0.0 ? 1.0f : static_cast<float>(kept / total));
  return {kept_rows, kept_pair, pair_kept, kept_offsets, kept_scale, retained_mass};
}

}  // namespace

TORCH_LIBRARY_IMPL(lrmoe, CPU, m) { m.impl("select", &select_cpu); }

}  // namespace lrmoe
