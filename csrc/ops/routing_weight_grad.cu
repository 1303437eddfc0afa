// routing_weight_grad, CUDA: grad_w_TK[t, k] = <grad_out_TH[t], y_NH[pair_row_P[t*K+k]]>.
//
// Legend: T tokens, K top_k, P = T*K pairs, N rows of y, H hidden size.
// One warp per pair: lanes take 16-byte column vectors of g and y, accumulate in
// fp32 (fp64 for double), then a fixed butterfly reduction -- deterministic, but
// summed in a different order than the sequential CPU loop (agree to rounding).
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "routing_weight_grad.h"
#include "rows.cuh"

namespace lrmoe {
namespace {

using namespace lrmoe::cuda;

template <typename scalar_t, int VEC>
__global__ void __launch_bounds__(kRowThreads)
routing_weight_grad_kernel(const scalar_t* __restrict__ g_TH, const scalar_t* __restrict__ y_NH,
                           const int32_t* __restrict__ pair_row_P, float* __restrict__ grad_w_P,
                           int64_t N, int64_t H, int64_t P, int64_t K) {
  using opmath_t = at::opmath_type<scalar_t>;
  using V = Vec<scalar_t, VEC>;
  const int lane = threadIdx.x % kWarp;
  const int64_t nvec = H / VEC;
  for (int64_t p = warp_row(); p < P; p += warp_row_stride()) {
    const int32_t r = pair_row_P[p];
    CUDA_KERNEL_ASSERT(r >= -1 && r < N && "routing_weight_grad: pair_row out of range");
    opmath_t acc = 0;
    if (r >= 0 && r < N) {  // warp-uniform branch
      const V* g = reinterpret_cast<const V*>(g_TH + (p / K) * H);
      const V* yr = reinterpret_cast<const V*>(y_NH + static_cast<int64_t>(r) * H);
      for (int64_t v = lane; v < nvec; v += kWarp) {
        const V a = g[v], b = yr[v];
#pragma unroll
        for (int j = 0; j < VEC; ++j)
          acc += static_cast<opmath_t>(a.v[j]) * static_cast<opmath_t>(b.v[j]);
      }
    }
    acc = warp_sum(acc);
    if (lane == 0) grad_w_P[p] = static_cast<float>(acc);
  }
}

at::Tensor routing_weight_grad_cuda(const at::Tensor& grad_out, const at::Tensor& y,
                                    const at::Tensor& pair_row, int64_t top_k) {
  check_routing_weight_grad_args(grad_out, y, pair_row, top_k);
  const c10::cuda::CUDAGuard guard(grad_out.device());
  const at::Tensor g_TH = grad_out.contiguous();
  const at::Tensor y_NH = y.contiguous();
  const at::Tensor pair_row_P = pair_row.contiguous();
  const int64_t N = y_NH.size(0), H = y_NH.size(1), P = pair_row_P.numel(), K = top_k;
  at::Tensor grad_w_TK = at::empty({P / K, K}, g_TH.options().dtype(at::kFloat));
  if (P == 0) return grad_w_TK;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, g_TH.scalar_type(),
                                  "lrmoe_routing_weight_grad_cuda", [&] {
    const scalar_t* gp = g_TH.const_data_ptr<scalar_t>();
    const scalar_t* yp = y_NH.const_data_ptr<scalar_t>();
    const int32_t* rows = pair_row_P.const_data_ptr<int32_t>();
    float* gw = grad_w_TK.data_ptr<float>();
    launch_vectorized<scalar_t>(H, {gp, yp}, [&](auto vec) {
      constexpr int VEC = decltype(vec)::value;
      routing_weight_grad_kernel<scalar_t, VEC><<<row_blocks(P), kRowThreads, 0, stream>>>(
          gp, yp, rows, gw, N, H, P, K);
    });
  });
  return grad_w_TK;
}

}  // namespace

TORCH_LIBRARY_IMPL(lrmoe, CUDA, m) { m.impl("routing_weight_grad", &routing_weight_grad_cuda); }

}  // namespace lrmoe
