// source_shares, CUDA: one thread per (source, expert) runs the same
// core::source_share as the CPU path (O(W) per thread); no host sync.
//
// Legend: W source ranks, E experts, counts_WE (int32) routed pairs of each source
// per expert, quota_E (int32) global quotas, shares_WE (int32) output. Value checks
// (counts >= 0, 0 <= Q_e <= N_e) would need a sync; the CPU path does them.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "core/quota.h"
#include "ops/rows.cuh"
#include "ops/source_shares.h"

namespace lrmoe {
namespace {

using namespace lrmoe::cuda;

__global__ void source_shares_kernel(const int32_t* __restrict__ counts_WE,
                                     const int32_t* __restrict__ quota_E, int64_t W, int64_t E,
                                     int32_t* __restrict__ shares_WE) {
  const int64_t i = thread_index();
  if (i >= W * E) return;
  const int64_t s = i / E, e = i % E;
  shares_WE[i] = static_cast<int32_t>(core::source_share(s, e, counts_WE, W, E, quota_E[e]));
}

at::Tensor source_shares_cuda(const at::Tensor& counts, const at::Tensor& quota) {
  check_source_shares_args(counts, quota);
  const c10::cuda::CUDAGuard guard(counts.device());
  const at::Tensor counts_WE = counts.contiguous();
  const at::Tensor quota_E = quota.contiguous();
  const int64_t W = counts_WE.size(0), E = counts_WE.size(1);
  at::Tensor shares_WE = at::empty({W, E}, counts_WE.options());
  if (W * E == 0) return shares_WE;
  const int threads = 128;
  source_shares_kernel<<<blocks_for(W * E, threads), threads, 0,
                         at::cuda::getCurrentCUDAStream()>>>(
      counts_WE.data_ptr<int32_t>(), quota_E.data_ptr<int32_t>(), W, E,
      shares_WE.data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return shares_WE;
}

}  // namespace

TORCH_LIBRARY_IMPL(lrmoe, CUDA, m) { m.impl("source_shares", &source_shares_cuda); }

}  // namespace lrmoe
