// combine, CPU: unpermute + weighted sum out_TH[t] = sum_k w_TK[t,k] * y_NH[pair_row_P[t*K+k]].
//
// Legend: T tokens, K top_k, P = T*K pairs, N rows of y, H hidden size.
// Sum over k in order with an fp32 accumulator (fp64 for double) as acc + w*y, the
// exact operation order of the CUDA kernel, so both give identical bits. Row -1
// (a dropped pair) contributes nothing.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "combine.h"

namespace lrmoe {
namespace {

at::Tensor combine_cpu(const at::Tensor& y, const at::Tensor& pair_row,
                       const std::optional<at::Tensor>& weights, int64_t top_k) {
  check_combine_args(y, pair_row, weights, top_k);
  const at::Tensor y_NH = y.contiguous();
  const at::Tensor pair_row_P = pair_row.contiguous();
  const int64_t N = y_NH.size(0), H = y_NH.size(1), P = pair_row_P.numel(), K = top_k;
  const int64_t T = P / K;
  const int32_t* rows = pair_row_P.const_data_ptr<int32_t>();
  check_pair_row_values(rows, P, N);
  at::Tensor out_TH = at::empty({T, H}, y_NH.options());
  if (T == 0 || H == 0) return out_TH;
  const at::Tensor w_TK =
      weights.has_value() ? weights->to(at::kFloat).contiguous() : at::Tensor();
  const float* w = w_TK.defined() ? w_TK.const_data_ptr<float>() : nullptr;

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y_NH.scalar_type(),
                                  "lrmoe_combine_cpu", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const scalar_t* yp = y_NH.const_data_ptr<scalar_t>();
    scalar_t* op = out_TH.data_ptr<scalar_t>();
    const int64_t grain = std::max<int64_t>(1, 8192 / (H * K));
    at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) {
      std::vector<opmath_t> acc(H);
      for (int64_t t = begin; t < end; ++t) {
        std::fill(acc.begin(), acc.end(), opmath_t(0));
        for (int64_t k = 0; k < K; ++k) {
          const int32_t r = rows[t * K + k];
          if (r < 0) continue;
          const opmath_t wk = w ? static_cast<opmath_t>(w[t * K + k]) : opmath_t(1);
          const scalar_t* yr = yp + static_cast<int64_t>(r) * H;
          for (int64_t h = 0; h < H; ++h) {
            const opmath_t prod = wk * static_cast<opmath_t>(yr[h]);  // no fma: match CUDA
            acc[h] = acc[h] + prod;
          }
        }
        scalar_t* o = op + t * H;
        for (int64_t h = 0; h < H; ++h) o[h] = static_cast<scalar_t>(acc[h]);
      }
    });
  });
  return out_TH;
}

}  // namespace

TORCH_LIBRARY_IMPL(lrmoe, CPU, m) { m.impl("combine", &combine_cpu); }

}  // namespace lrmoe
