// gather_rows, CUDA: out_RC[r] = scale_R[r] * src_NC[index_R[r] / divisor];
// dispatch_rows, its scatter form: out_RC[slot_P[p]] = scale * src_TC[p / top_k].
//
// Legend: N source rows, C columns, R gathered rows.
// One warp per output row (grid-stride over rows); 16-byte vector loads/stores
// when C * itemsize and both base pointers allow, scalar otherwise. The scale is
// applied in fp32 (fp64 for double), then rounded to src.dtype -- as on the CPU.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>

#include "gather_rows.h"
#include "rows.cuh"

namespace lrmoe {
namespace {

using namespace lrmoe::cuda;

template <typename scalar_t, int VEC>
__global__ void __launch_bounds__(kRowThreads)
gather_rows_kernel(const scalar_t* __restrict__ src_NC, const int32_t* __restrict__ index_R,
                   const float* __restrict__ scale_R, scalar_t* __restrict__ out_RC, int64_t N,
                   int64_t C, int64_t R, int64_t divisor) {
  using opmath_t = at::opmath_type<scalar_t>;
  using V = Vec<scalar_t, VEC>;
  const int lane = threadIdx.x % kWarp;
  const int64_t nvec = C / VEC;
  for (int64_t r = warp_row(); r < R; r += warp_row_stride()) {
    const int64_t i = index_R[r];
    const int64_t n = i / divisor;
    CUDA_KERNEL_ASSERT(i >= 0 && n < N && "gather_rows: index out of range");
    if (i < 0 || n >= N) continue;
    const V* in = reinterpret_cast<const V*>(src_NC + n * C);
    V* out = reinterpret_cast<V*>(out_RC + r * C);
    if (scale_R == nullptr) {
      for (int64_t v = lane; v < nvec; v += kWarp) out[v] = in[v];
    } else {
      const opmath_t f = static_cast<opmath_t>(scale_R[r]);
      for (int64_t v = lane; v < nvec; v += kWarp) {
        V x = in[v];
#pragma unroll
        for (int j = 0; j < VEC; ++j)
          x.v[j] = static_cast<scalar_t>(f * static_cast<opmath_t>(x.v[j]));
        out[v] = x;
      }
    }
  }
}

at::Tensor gather_rows_cuda(const at::Tensor& src, const at::Tensor& index,
                            const std::optional<at::Tensor>& scale, int64_t divisor) {
  check_gather_rows_args(src, index, scale, divisor);
  const c10::cuda::CUDAGuard guard(src.device());
  const at::Tensor src_NC = src.contiguous();
  const at::Tensor index_R = index.contiguous();
  const int64_t N = src_NC.size(0), C = src_NC.size(1), R = index_R.size(0);
  at::Tensor out_RC = at::empty({R, C}, src_NC.options());
  if (R == 0 || C == 0) return out_RC;
  const at::Tensor scale_R = scale.has_value() ? scale->contiguous() : at::Tensor();
  const float* sc = scale_R.defined() ? scale_R.const_data_ptr<float>() : nullptr;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, src_NC.scalar_type(),
                                  "lrmoe_gather_rows_cuda", [&] {
    const scalar_t* s = src_NC.const_data_ptr<scalar_t>();
    scalar_t* o = out_RC.data_ptr<scalar_t>();
    const int32_t* idx = index_R.const_data_ptr<int32_t>();
    launch_vectorized<scalar_t>(C, {s, o}, [&](auto vec) {
      constexpr int VEC = decltype(vec)::value;
      gather_rows_kernel<scalar_t, VEC><<<row_blocks(R), kRowThreads, 0, stream>>>(
          s, idx, sc, o, N, C, R, divisor);
    });
  });
  return out_RC;
}

// One warp per source row: each 16-byte chunk is loaded once and stored to the row's
// K slots (the slots and scales, read per chunk, are the same address for the whole
// warp: one broadcast from L1). Reads T*C values instead of R*C.
template <typename scalar_t, int VEC>
__global__ void __launch_bounds__(kRowThreads)
dispatch_rows_kernel(const scalar_t* __restrict__ src_TC, const int32_t* __restrict__ slot_P,
                     const float* __restrict__ scale_R, scalar_t* __restrict__ out_RC,
                     int64_t T, int64_t C, int64_t R, int64_t K) {
  using opmath_t = at::opmath_type<scalar_t>;
  using V = Vec<scalar_t, VEC>;
  const int lane = threadIdx.x % kWarp;
  const int64_t nvec = C / VEC;
  for (int64_t t = warp_row(); t < T; t += warp_row_stride()) {
    const V* in = reinterpret_cast<const V*>(src_TC + t * C);
    const int32_t* slots = slot_P + t * K;
    for (int64_t v = lane; v < nvec; v += kWarp) {
      const V x = in[v];
      for (int64_t k = 0; k < K; ++k) {
        const int64_t r = slots[k];
        if (r < 0 || r >= R) continue;  // dropped pair (or a bad slot: never out of bounds)
        V* out = reinterpret_cast<V*>(out_RC + r * C);
        if (scale_R == nullptr) {
          out[v] = x;
        } else {
          const opmath_t f = static_cast<opmath_t>(scale_R[r]);
          V y;
#pragma unroll
          for (int j = 0; j < VEC; ++j)
            y.v[j] = static_cast<scalar_t>(f * static_cast<opmath_t>(x.v[j]));
          out[v] = y;
        }
      }
    }
  }
}

at::Tensor dispatch_rows_cuda(const at::Tensor& src, const at::Tensor& slot,
                              const std::optional<at::Tensor>& scale, int64_t num_rows,
                              int64_t top_k) {
  check_dispatch_rows_args(src, slot, scale, num_rows, top_k);
  const c10::cuda::CUDAGuard guard(src.device());
  const at::Tensor src_TC = src.contiguous();
  const at::Tensor slot_P = slot.contiguous();
  const int64_t T = src_TC.size(0), C = src_TC.size(1), R = num_rows;
  at::Tensor out_RC = at::empty({R, C}, src_TC.options());
  if (R == 0 || C == 0 || T == 0) return out_RC;
  const at::Tensor scale_R = scale.has_value() ? scale->contiguous() : at::Tensor();
  const float* sc = scale_R.defined() ? scale_R.const_data_ptr<float>() : nullptr;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, src_TC.scalar_type(),
                                  "lrmoe_dispatch_rows_cuda", [&] {
    const scalar_t* s = src_TC.const_data_ptr<scalar_t>();
    scalar_t* o = out_RC.data_ptr<scalar_t>();
    const int32_t* sl = slot_P.const_data_ptr<int32_t>();
    launch_vectorized<scalar_t>(C, {s, o}, [&](auto vec) {
      constexpr int VEC = decltype(vec)::value;
      dispatch_rows_kernel<scalar_t, VEC><<<row_blocks(T), kRowThreads, 0, stream>>>(
          s, sl, sc, o, T, C, R, top_k);
    });
  });
  return out_RC;
}

}  // namespace

TORCH_LIBRARY_IMPL(lrmoe, CUDA, m) {
  m.impl("gather_rows", &gather_rows_cuda);
  m.impl("dispatch_rows", &dispatch_rows_cuda);
}

}  // namespace lrmoe
