// routing_weight_grad, CPU: exact router gradient
// grad_w_TK[t, k] = <grad_out_TH[t], y_NH[pair_row_P[t*K+k]]>, fp32 (row -1 gives 0).
//
// Legend: T tokens, K top_k, P = T*K pairs, N rows of y, H hidden size.
// Dropped pairs still get this gradient: it needs only the forward output y.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>

#include "routing_weight_grad.h"

namespace lrmoe {
namespace {

at::Tensor routing_weight_grad_cpu(const at::Tensor& grad_out, const at::Tensor& y,
                                   const at::Tensor& pair_row, int64_t top_k) {
  check_routing_weight_grad_args(grad_out, y, pair_row, top_k);
  const at::Tensor g_TH = grad_out.contiguous();
  const at::Tensor y_NH = y.contiguous();
  const at::Tensor pair_row_P = pair_row.contiguous();
  const int64_t N = y_NH.size(0), H = y_NH.size(1), P = pair_row_P.numel(), K = top_k;
  const int32_t* rows = pair_row_P.const_data_ptr<int32_t>();
  check_pair_row_values(rows, P, N);
  at::Tensor grad_w_TK = at::empty({P / K, K}, g_TH.options().dtype(at::kFloat));
  if (P == 0) return grad_w_TK;
  float* gw = grad_w_TK.data_ptr<float>();

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, g_TH.scalar_type(),
                                  "lrmoe_routing_weight_grad_cpu", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const scalar_t* gp = g_TH.const_data_ptr<scalar_t>();
    const scalar_t* yp = y_NH.const_data_ptr<scalar_t>();
    const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(H, 1));
    at::parallel_for(0, P, grain, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const int32_t r = rows[p];
        opmath_t acc = 0;
        if (r >= 0) {
          const scalar_t* g = gp + (p / K) * H;
          const scalar_t* yr = yp + static_cast<int64_t>(r) * H;
          for (int64_t h = 0; h < H; ++h)
            acc += static_cast<opmath_t>(g[h]) * static_cast<opmath_t>(yr[h]);
        }
        gw[p] = static_cast<float>(acc);
      }
    });
  });
  return grad_w_TK;
}

}  // namespace

TORCH_LIBRARY_IMPL(lrmoe, CPU, m) { m.impl("routing_weight_grad", &routing_weight_grad_cpu); }

}  // namespace lrmoe
