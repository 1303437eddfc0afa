// score, CUDA: backward priority of every routed pair, in row order, fp32.
//
// Legend: T tokens, K top_k, P = T*K rows, H hidden size. g_TH = grad_out,
// alpha_TK = routing weights, phi_sq_P = ||phi||^2 per row, row_pair_P = pair
// id t*K + k of each row; gnorm_T = ||g_t||^2 or ||g_t||_1 per token.
//
// Two kernels: one warp per token reduces g_t once (16-byte loads when H and
// the base pointer allow), then one thread per row combines it with alpha and
// phi_sq. Fixed shuffle trees, no atomics: deterministic. An out-of-range
// row_pair entry (unchecked here, checked on the CPU) gives a NaN score.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>

#include "core/random.h"
#include "ops/common.h"
#include "ops/score.h"

namespace lrmoe {
namespace {

constexpr int kWarpsPerBlock = 8;

template <typename acc_t>
__device__ __forceinline__ acc_t warp_sum(acc_t v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <typename scalar_t, int VEC>
__global__ void token_norms_kernel(const scalar_t* __restrict__ g_TH, int64_t T, int64_t H,
                                   bool square, float* __restrict__ gnorm_T) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t t = blockIdx.x * static_cast<int64_t>(kWarpsPerBlock) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (t >= T) return;
  const scalar_t* row = g_TH + t * H;
  acc_t acc = 0;
  if constexpr (VEC > 1) {
    struct alignas(16) Pack { scalar_t v[VEC]; };
    const Pack* packs = reinterpret_cast<const Pack*>(row);
    for (int64_t i = lane; i < H / VEC; i += 32) {
      const Pack pk = packs[i];
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const acc_t v = static_cast<acc_t>(pk.v[j]);
        acc += square ? v * v : (v < 0 ? -v : v);
      }
    }
  } else {
    for (int64_t h = lane; h < H; h += 32) {
      const acc_t v = static_cast<acc_t>(row[h]);
      acc += square ? v * v : (v < 0 ? -v : v);
    }
  }
  acc = warp_sum(acc);
  if (lane == 0) gnorm_T[t] = static_cast<float>(acc);
}

__global__ void score_rows_kernel(int metric, const int32_t* __restrict__ row_pair_P, int64_t P,
                                  int64_t K, const float* __restrict__ gnorm_T,
                                  const float* __restrict__ alpha_TK,
                                  const float* __restrict__ phi_sq_P, uint64_t seed,
                                  float* __restrict__ score_P) {
  const int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (r >= P) return;
  const int64_t pair = row_pair_P[r];
  if (pair < 0 || pair >= P) { score_P[r] = __int_as_float(0x7fc00000); return; }
  if (metric == static_cast<int>(Metric::kRandom)) {
    score_P[r] = core::uniform01(seed, core::kScoreStream, static_cast<uint64_t>(pair));
  } else if (metric == static_cast<int>(Metric::kLrm)) {
    const float a = alpha_TK[pair];
    // explicit roundings: same product order as the CPU path
    score_P[r] = __fmul_rn(__fmul_rn(__fmul_rn(a, a), gnorm_T[pair / K]), phi_sq_P[r]);
  } else {
    score_P[r] = gnorm_T[pair / K];
  }
}

template <typename scalar_t>
void launch_token_norms(const at::Tensor& g_TH, bool square, at::Tensor& gnorm_T,
                        cudaStream_t stream) {
  const int64_t T = g_TH.size(0), H = g_TH.size(1);
  constexpr int VEC = 16 / sizeof(scalar_t);
  const bool vec_ok = H % VEC == 0 && reinterpret_cast<uintptr_t>(g_TH.data_ptr()) % 16 == 0;
  const int64_t blocks = (T + kWarpsPerBlock - 1) / kWarpsPerBlock;
  const scalar_t* g = g_TH.data_ptr<scalar_t>();
  float* out = gnorm_T.data_ptr<float>();
  if (vec_ok) {
    token_norms_kernel<scalar_t, VEC><<<blocks, kWarpsPerBlock * 32, 0, stream>>>(g, T, H, square, out);
  } else {
    token_norms_kernel<scalar_t, 1><<<blocks, kWarpsPerBlock * 32, 0, stream>>>(g, T, H, square, out);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor score_cuda(const at::Tensor& grad_out, const at::Tensor& weights, const at::Tensor& phi_sq,
                      const at::Tensor& row_pair, c10::string_view metric_name, int64_t seed) {
  const Metric metric = parse_metric(std::string(metric_name));
  check_score_args(grad_out, weights, phi_sq, row_pair);
  const c10::cuda::CUDAGuard guard(grad_out.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t T = grad_out.size(0), K = weights.size(1), P = row_pair.size(0);
  at::Tensor score_P = at::empty({P}, phi_sq.options());
  if (P == 0) return score_P;
  const at::Tensor row_pair_P = row_pair.contiguous();

  at::Tensor gnorm_T, alpha_TK, phi_sq_P;
  if (metric != Metric::kRandom) {
    const at::Tensor g_TH = grad_out.contiguous();
    gnorm_T = at::empty({T}, phi_sq.options());
    const bool square = metric != Metric::kGradAbs;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, g_TH.scalar_type(), "lrmoe_score_norms_cuda", [&] {
      launch_token_norms<scalar_t>(g_TH, square, gnorm_T, stream);
    });
    alpha_TK = weights.to(at::kFloat).contiguous();
    phi_sq_P = phi_sq.contiguous();
  }
  const int threads = 256;
  const int64_t blocks = (P + threads - 1) / threads;
  score_rows_kernel<<<blocks, threads, 0, stream>>>(
      static_cast<int>(metric), row_pair_P.data_ptr<int32_t>(), P, K,
      gnorm_T.defined() ? gnorm_T.data_ptr<float>() : nullptr,
      alpha_TK.defined() ? alpha_TK.data_ptr<float>() : nullptr,
      phi_sq_P.defined() ? phi_sq_P.data_ptr<float>() : nullptr, static_cast<uint64_t>(seed),
      score_P.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return score_P;
}

}  // namespace

TORCH_LIBRARY_IMPL(lrmoe, CUDA, m) { m.impl("score", &score_cuda); }

}  // namespace lrmoe
