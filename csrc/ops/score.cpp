// score, CPU: backward priority of every routed pair, in row order, fp32.
//
// Legend: T tokens, K top_k, P = T*K rows, H hidden size. g_TH = grad_out,
// alpha_TK = routing weights, phi_sq_P = ||phi||^2 per row, row_pair_P = pair
// id t*K + k of each row; gnorm_T = ||g_t||^2 or ||g_t||_1 per token.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

#include "core/random.h"
#include "ops/common.h"
#include "ops/score.h"

namespace lrmoe {
namespace {

// ||g_t||^2 (square = true) or ||g_t||_1 per token, accumulated in opmath.
at::Tensor token_norms_cpu(const at::Tensor& g_TH, bool square) {
  const int64_t T = g_TH.size(0), H = g_TH.size(1);
  at::Tensor gnorm_T = at::empty({T}, g_TH.options().dtype(at::kFloat));
  float* out = gnorm_T.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, g_TH.scalar_type(), "lrmoe_score_norms", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* g = g_TH.data_ptr<scalar_t>();
    at::parallel_for(0, T, 64, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const scalar_t* row = g + t * H;
        acc_t acc = 0;
        if (square) {
          for (int64_t h = 0; h < H; ++h) { const acc_t v = static_cast<acc_t>(row[h]); acc += v * v; }
        } else {
          for (int64_t h = 0; h < H; ++h) acc += std::abs(static_cast<acc_t>(row[h]));
        }
        out[t] = static_cast<float>(acc);
      }
    });
  });
  return gnorm_T;
}

at::Tensor score_cpu(const at::Tensor& grad_out, const at::Tensor& weights, const at::Tensor& phi_sq,
                     const at::Tensor& row_pair, c10::string_view metric_name, int64_t seed) {
  const Metric metric = parse_metric(std::string(metric_name));
  check_score_args(grad_out, weights, phi_sq, row_pair);
  const int64_t K = weights.size(1), P = row_pair.size(0);
  const at::Tensor row_pair_P = row_pair.contiguous();
  const int32_t* rp = row_pair_P.data_ptr<int32_t>();
  for (int64_t r = 0; r < P; ++r)
    LRMOE_CHECK(rp[r] >= 0 && rp[r] < P, "row_pair[", r, "] = ", rp[r], " is outside [0, ", P,
                "); pass the row_pair returned by permute");
  at::Tensor score_P = at::empty({P}, phi_sq.options());
  float* out = score_P.data_ptr<float>();
  if (P == 0) return score_P;

  if (metric == Metric::kRandom) {
    at::parallel_for(0, P, 4096, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        out[r] = core::uniform01(static_cast<uint64_t>(seed), core::kScoreStream,
                                 static_cast<uint64_t>(rp[r]));
    });
    return score_P;
  }
  const at::Tensor gnorm_T = token_norms_cpu(grad_out.contiguous(), metric != Metric::kGradAbs);
  const float* gn = gnorm_T.data_ptr<float>();
  const at::Tensor alpha_TK = weights.to(at::kFloat).contiguous();
  const float* alpha = alpha_TK.data_ptr<float>();
  const at::Tensor phi_sq_P = phi_sq.contiguous();
  const float* phi = phi_sq_P.data_ptr<float>();
  at::parallel_for(0, P, 4096, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t pair = rp[r], t = pair / K;
      if (metric == Metric::kLrm) {
        const float a = alpha[pair];
        out[r] = a * a * gn[t] * phi[r];
      } else {
        out[r] = gn[t];
      }
    }
  });
  return score_P;
}

}  // namespace

TORCH_LIBRARY_IMPL(lrmoe, CPU, m) { m.impl("score", &score_cpu); }

}  // namespace lrmoe
