// combine, CUDA: out_TH[t] = sum_k w_TK[t,k] * y_NH[pair_row_P[t*K+k]], row -1 skipped.
//
// Legend: T tokens, K top_k, P = T*K pairs, N rows of y, H hidden size.
// One warp per token, each lane owning 16-byte column vectors; k runs in order
// with an fp32 (fp64 for double) accumulator. No atomics: each output element
// has one writer. Products and sums use explicitly rounded intrinsics
// (__fmul_rn/__fadd_rn) so nvcc cannot contract them into FMAs: the result is
// bit-identical to the CPU kernel.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>

#include "combine.h"
#include "rows.cuh"

namespace lrmoe {
namespace {

using namespace lrmoe::cuda;

__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }

template <typename scalar_t, int VEC>
__global__ void __launch_bounds__(kRowThreads)
combine_kernel(const scalar_t* __restrict__ y_NH, const int32_t* __restrict__ pair_row_P,
               const float* __restrict__ w_TK, scalar_t* __restrict__ out_TH, int64_t N,
               int64_t H, int64_t T, int64_t K) {
  using opmath_t = at::opmath_type<scalar_t>;
  using V = Vec<scalar_t, VEC>;
  const int lane = threadIdx.x % kWarp;
  const int64_t nvec = H / VEC;
  for (int64_t t = warp_row(); t < T; t += warp_row_stride()) {
    for (int64_t v = lane; v < nvec; v += kWarp) {
      opmath_t acc[VEC];
#pragma unroll
      for (int j = 0; j < VEC; ++j) acc[j] = opmath_t(0);
      for (int64_t k = 0; k < K; ++k) {
        const int32_t r = pair_row_P[t * K + k];
        CUDA_KERNEL_ASSERT(r >= -1 && r < N && "combine: pair_row out of range");
        if (r < 0 || r >= N) continue;
        const opmath_t wk = w_TK ? static_cast<opmath_t>(w_TK[t * K + k]) : opmath_t(1);
        const V x = reinterpret_cast<const V*>(y_NH + static_cast<int64_t>(r) * H)[v];
#pragma unroll
        for (int j = 0; j < VEC; ++j)
          acc[j] = add_rn(acc[j], mul_rn(wk, static_cast<opmath_t>(x.v[j])));
      }
      V o;
#pragma unroll
      for (int j = 0; j < VEC; ++j) o.v[j] = static_cast<scalar_t>(acc[j]);
      reinterpret_cast<V*>(out_TH + t * H)[v] = o;
    }
  }
}

at::Tensor combine_cuda(const at::Tensor& y, const at::Tensor& pair_row,
                        const std::optional<at::Tensor>& weights, int64_t top_k) {
  check_combine_args(y, pair_row, weights, top_k);
  const c10::cuda::CUDAGuard guard(y.device());
  const at::Tensor y_NH = y.contiguous();
  const at::Tensor pair_row_P = pair_row.contiguous();
  const int64_t N = y_NH.size(0), H = y_NH.size(1), P = pair_row_P.numel(), K = top_k;
  const int64_t T = P / K;
  at::Tensor out_TH = at::empty({T, H}, y_NH.options());
  if (T == 0 || H == 0) return out_TH;
  const at::Tensor w_TK =
      weights.has_value() ? weights->to(at::kFloat).contiguous() : at::Tensor();
  const float* w = w_TK.defined() ? w_TK.const_data_ptr<float>() : nullptr;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y_NH.scalar_type(),
                                  "lrmoe_combine_cuda", [&] {
    const scalar_t* yp = y_NH.const_data_ptr<scalar_t>();
    scalar_t* op = out_TH.data_ptr<scalar_t>();
    const int32_t* rows = pair_row_P.const_data_ptr<int32_t>();
    launch_vectorized<scalar_t>(H, {yp, op}, [&](auto vec) {
      constexpr int VEC = decltype(vec)::value;
      combine_kernel<scalar_t, VEC><<<row_blocks(T), kRowThreads, 0, stream>>>(
          yp, rows, w, op, N, H, T, K);
    });
  });
  return out_TH;
}

}  // namespace

TORCH_LIBRARY_IMPL(lrmoe, CUDA, m) { m.impl("combine", &combine_cuda); }

}  // namespace lrmoe
