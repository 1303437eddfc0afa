// quota, CUDA: one thread per expert runs the same csrc/core/quota.h code as
// the CPU path (O(E) per thread), so quotas never leave the device.
//
// Legend: E experts, n_E tokens_per_expert (int32), c recalibration rate,
// Q_E quota (int32). Negative loads cannot be checked without a sync; they are
// read as 0 here (the CPU path rejects them).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "core/quota.h"
#include "ops/quota.h"
#include "ops/rows.cuh"

namespace lrmoe {
namespace {

using namespace lrmoe::cuda;

__global__ void clamp_loads_kernel(const int32_t* __restrict__ n_E, int64_t E,
                                   int32_t* __restrict__ out_E) {
  const int64_t e = thread_index();
  if (e < E) out_E[e] = n_E[e] > 0 ? n_E[e] : 0;
}

__global__ void quota_kernel(core::QuotaRule rule, const int32_t* __restrict__ n_E, int64_t E,
                             double recalibration_rate, int32_t* __restrict__ quota_E) {
  const int64_t e = thread_index();
  if (e < E) quota_E[e] = static_cast<int32_t>(core::expert_quota(rule, e, n_E, E, recalibration_rate));
}

at::Tensor quota_cuda(const at::Tensor& tokens_per_expert, double recalibration_rate,
                      c10::string_view rule) {
  const core::QuotaRule r = check_quota_args(tokens_per_expert, recalibration_rate,
                                             std::string(rule));
  const c10::cuda::CUDAGuard guard(tokens_per_expert.device());
  const int64_t E = tokens_per_expert.size(0);
  at::Tensor quota_E = at::empty({E}, tokens_per_expert.options());
  if (E == 0) return quota_E;
  at::Tensor n_E = at::empty({E}, tokens_per_expert.options());
  const at::Tensor src_E = tokens_per_expert.contiguous();
  auto stream = at::cuda::getCurrentCUDAStream();
  const int threads = 128;
  const unsigned blocks = blocks_for(E, threads);
  clamp_loads_kernel<<<blocks, threads, 0, stream>>>(src_E.data_ptr<int32_t>(), E,
                                                     n_E.data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  quota_kernel<<<blocks, threads, 0, stream>>>(r, n_E.data_ptr<int32_t>(), E,
                                               recalibration_rate, quota_E.data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return quota_E;
}

}  // namespace

TORCH_LIBRARY_IMPL(lrmoe, CUDA, m) { m.impl("quota", &quota_cuda); }

}  // namespace lrmoe
