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
#include "ops/rows.cuh"
#include "ops/score.h"

namespace lrmoe {
namespace {

using namespace lrmoe::cuda;

// One warp per token (grid-stride); VEC-wide loads, one lane per vector.
template <typename scalar_t, int VEC>
__global__ void __launch_bounds__(kRowThreads)
token_norms_kernel(const scalar_t* __restrict__ g_TH, int64_t T, int64_t H, bool square,
                   float* __restrict__ gnorm_T) {
  using acc_t = at::opmath_type<scalar_t>;
  using V = Vec<scalar_t, VEC>;
  const int lane = threadIdx.x % kWarp;
  for (int64_t t = warp_row(); t < T; t += warp_row_stride()) {
    const V* row = reinterpret_cast<const V*>(g_TH + t * H);
    acc_t acc = 0;
    for (int64_t i = lane; i < H / VEC; i += kWarp) {
      const V pk = row[i];
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const acc_t v = static_cast<acc_t>(pk.v[j]);
        acc += square ? v * v : (v < 0 ? -v : v);
      }
    }
    acc = warp_sum(acc);
    if (lane == 0) gnorm_T[t] = static_cast<float>(acc);
  }
}

__global__ void score_rows_kernel(int metric, const int32_t* __restrict__ row_pair_P, int64_t P,
                                  int64_t K, const float* __restrict__ gnorm_T,
                                  const float* __restrict__ alpha_TK,
                                  const float* __restrict__ phi_sq_P, uint64_t seed,
                                  float* __restrict__ score_P) {
  const int64_t r = thread_index();
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
    const int64_t H = g_TH.size(1);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, g_TH.scalar_type(),
                                    "lrmoe_score_norms_cuda", [&] {
      const scalar_t* g = g_TH.const_data_ptr<scalar_t>();
      float* out = gnorm_T.data_ptr<float>();
      launch_vectorized<scalar_t>(H, {g}, [&](auto vec) {
        constexpr int VEC = decltype(vec)::value;
        token_norms_kernel<scalar_t, VEC><<<row_blocks(T), kRowThreads, 0, stream>>>(
            g, T, H, square, out);
      });
    });
    alpha_TK = weights.to(at::kFloat).contiguous();
    phi_sq_P = phi_sq.contiguous();
  }
  const int threads = 256;
  score_rows_kernel<<<blocks_for(P, threads), threads, 0, stream>>>(
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
