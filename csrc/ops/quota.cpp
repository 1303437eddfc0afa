// quota, CPU: per-expert retention quota Q_E from the routed load n_E.
//
// Legend: E experts, n_E tokens_per_expert (int32), c recalibration rate,
// Q_E quota (int32). The arithmetic is csrc/core/quota.h, shared with CUDA.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "core/quota.h"
#include "ops/quota.h"

namespace lrmoe {
namespace {

at::Tensor quota_cpu(const at::Tensor& tokens_per_expert, double recalibration_rate,
                     c10::string_view rule) {
  const core::QuotaRule r = check_quota_args(tokens_per_expert, recalibration_rate,
                                             std::string(rule));
  const at::Tensor n_E = tokens_per_expert.contiguous();
  const int64_t E = n_E.size(0);
  const int32_t* n = n_E.data_ptr<int32_t>();
  for (int64_t e = 0; e < E; ++e)
    LRMOE_CHECK(n[e] >= 0, "tokens_per_expert must be >= 0, got ", n[e], " at expert ", e);
  at::Tensor quota_E = at::empty({E}, n_E.options());
  core::compute_quotas(r, n, E, recalibration_rate, quota_E.data_ptr<int32_t>());
  return quota_E;
}

}  // namespace

TORCH_LIBRARY_IMPL(lrmoe, CPU, m) { m.impl("quota", &quota_cpu); }

}  // namespace lrmoe
