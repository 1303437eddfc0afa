// swiglu / swiglu_backward, CUDA.
//
// Legend: N rows produced (index.numel(), or all M rows of h), I expert
// intermediate size; h_N2I = [gate | up] (read through index when given),
// phi_NI = silu(gate) * up (fp32 math, rounded to h.dtype), phi_sq_N = sum of
// squares of the rounded phi, grad_h_N2I = [d gate | d up].
// One warp per row; lanes take 16-byte vectors of the gate and up halves (both
// aligned when I * itemsize is a multiple of 16), scalar otherwise. phi_sq is a
// fixed butterfly reduction: deterministic, order differs from the CPU loop.
// The formulas are the ones in swiglu.h, shared with the CPU kernel.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>

#include "rows.cuh"
#include "swiglu.h"

namespace lrmoe {
namespace {

using namespace lrmoe::cuda;

// Row n's gate half in h (row index[n] when an index is given, else row n); the up
// half starts I / VEC vectors later.
template <typename V, typename scalar_t>
__device__ __forceinline__ const V* gate_row(const scalar_t* __restrict__ h_M2I,
                                             const int32_t* __restrict__ index_N, int64_t M,
                                             int64_t n, int64_t I) {
  const int64_t src = index_N ? static_cast<int64_t>(index_N[n]) : n;
  CUDA_KERNEL_ASSERT(src >= 0 && src < M && "swiglu: index outside the rows of h");
  return reinterpret_cast<const V*>(h_M2I + src * 2 * I);
}

template <typename scalar_t, int VEC>
__global__ void __launch_bounds__(kRowThreads)
swiglu_kernel(const scalar_t* __restrict__ h_M2I, const int32_t* __restrict__ index_N,
              int64_t M, scalar_t* __restrict__ phi_NI, float* __restrict__ phi_sq_N,
              int64_t N, int64_t I) {
  using opmath_t = at::opmath_type<scalar_t>;
  using V = Vec<scalar_t, VEC>;
  const int lane = threadIdx.x % kWarp;
  const int64_t nvec = I / VEC;
  for (int64_t n = warp_row(); n < N; n += warp_row_stride()) {
    const V* gate = gate_row<V>(h_M2I, index_N, M, n, I);
    const V* up = gate + nvec;
    V* phi = reinterpret_cast<V*>(phi_NI + n * I);
    opmath_t acc = 0;
    for (int64_t v = lane; v < nvec; v += kWarp) {
      const V g = gate[v], u = up[v];
      V o;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        o.v[j] = static_cast<scalar_t>(
            swiglu_phi(static_cast<opmath_t>(g.v[j]), static_cast<opmath_t>(u.v[j])));
        const opmath_t x = static_cast<opmath_t>(o.v[j]);
        acc += x * x;
      }
      phi[v] = o;
    }
    acc = warp_sum(acc);
    if (lane == 0) phi_sq_N[n] = static_cast<float>(acc);
  }
}

template <typename scalar_t, int VEC>
__global__ void __launch_bounds__(kRowThreads)
swiglu_backward_kernel(const scalar_t* __restrict__ dphi_NI, const scalar_t* __restrict__ h_M2I,
                       const int32_t* __restrict__ index_N, int64_t M,
                       scalar_t* __restrict__ grad_h_N2I, int64_t N, int64_t I) {
  using opmath_t = at::opmath_type<scalar_t>;
  using V = Vec<scalar_t, VEC>;
  const int lane = threadIdx.x % kWarp;
  const int64_t nvec = I / VEC;
  for (int64_t n = warp_row(); n < N; n += warp_row_stride()) {
    const V* gate = gate_row<V>(h_M2I, index_N, M, n, I);
    const V* up = gate + nvec;
    const V* dphi = reinterpret_cast<const V*>(dphi_NI + n * I);
    V* dgate = reinterpret_cast<V*>(grad_h_N2I + n * 2 * I);
    V* dup = reinterpret_cast<V*>(grad_h_N2I + n * 2 * I + I);
    for (int64_t v = lane; v < nvec; v += kWarp) {
      const V g = gate[v], u = up[v], d = dphi[v];
      V dg, du;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        opmath_t a, b;
        swiglu_grad(static_cast<opmath_t>(d.v[j]), static_cast<opmath_t>(g.v[j]),
                    static_cast<opmath_t>(u.v[j]), a, b);
        dg.v[j] = static_cast<scalar_t>(a);
        du.v[j] = static_cast<scalar_t>(b);
      }
      dgate[v] = dg;
      dup[v] = du;
    }
  }
}

std::tuple<at::Tensor, at::Tensor> swiglu_cuda(const at::Tensor& h,
                                               const std::optional<at::Tensor>& index) {
  const int64_t N = check_swiglu_args(h, index);
  const c10::cuda::CUDAGuard guard(h.device());
  const at::Tensor h_N2I = h.contiguous();
  const at::Tensor idx_N = index.has_value() ? index->contiguous() : at::Tensor();
  const int32_t* ip = index.has_value() ? idx_N.const_data_ptr<int32_t>() : nullptr;
  const int64_t M = h_N2I.size(0), I = h_N2I.size(1) / 2;
  at::Tensor phi_NI = at::empty({N, I}, h_N2I.options());
  at::Tensor phi_sq_N = at::empty({N}, h_N2I.options().dtype(at::kFloat));
  if (N == 0) return {phi_NI, phi_sq_N};
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, h_N2I.scalar_type(),
                                  "lrmoe_swiglu_cuda", [&] {
    const scalar_t* hp = h_N2I.const_data_ptr<scalar_t>();
    scalar_t* pp = phi_NI.data_ptr<scalar_t>();
    float* sq = phi_sq_N.data_ptr<float>();
    launch_vectorized<scalar_t>(I, {hp, pp}, [&](auto vec) {
      constexpr int VEC = decltype(vec)::value;
      swiglu_kernel<scalar_t, VEC><<<row_blocks(N), kRowThreads, 0, stream>>>(hp, ip, M, pp, sq,
                                                                              N, I);
    });
  });
  return {phi_NI, phi_sq_N};
}

at::Tensor swiglu_backward_cuda(const at::Tensor& grad_phi, const at::Tensor& h,
                                const std::optional<at::Tensor>& index) {
  const int64_t N = check_swiglu_backward_args(grad_phi, h, index);
  const c10::cuda::CUDAGuard guard(h.device());
  const at::Tensor h_N2I = h.contiguous();
  const at::Tensor dphi_NI = grad_phi.contiguous();
  const at::Tensor idx_N = index.has_value() ? index->contiguous() : at::Tensor();
  const int32_t* ip = index.has_value() ? idx_N.const_data_ptr<int32_t>() : nullptr;
  const int64_t M = h_N2I.size(0), I = h_N2I.size(1) / 2;
  at::Tensor grad_h_N2I = at::empty({N, 2 * I}, h_N2I.options());
  if (N == 0 || I == 0) return grad_h_N2I;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, h_N2I.scalar_type(),
                                  "lrmoe_swiglu_backward_cuda", [&] {
    const scalar_t* hp = h_N2I.const_data_ptr<scalar_t>();
    const scalar_t* dp = dphi_NI.const_data_ptr<scalar_t>();
    scalar_t* op = grad_h_N2I.data_ptr<scalar_t>();
    launch_vectorized<scalar_t>(I, {hp, dp, op}, [&](auto vec) {
      constexpr int VEC = decltype(vec)::value;
      swiglu_backward_kernel<scalar_t, VEC><<<row_blocks(N), kRowThreads, 0, stream>>>(
          dp, hp, ip, M, op, N, I);
    });
  });
  return grad_h_N2I;
}

}  // namespace

TORCH_LIBRARY_IMPL(lrmoe, CUDA, m) {
  m.impl("swiglu", &swiglu_cuda);
  m.impl("swiglu_backward", &swiglu_backward_cuda);
}

}  // namespace lrmoe
