// source_shares, CPU: split each expert's global quota over the source ranks of
// expert parallelism (largest remainder).
//
// Legend: W source ranks, E experts, counts_WE (int32) routed pairs of each source
// per expert, N_E = sum_s counts_WE[s], quota_E (int32) global quotas, shares_WE
// (int32) output. The arithmetic is core::source_share, shared with CUDA.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "core/quota.h"
#include "ops/source_shares.h"

namespace lrmoe {
namespace {

at::Tensor source_shares_cpu(const at::Tensor& counts, const at::Tensor& quota) {
  check_source_shares_args(counts, quota);
  const at::Tensor counts_WE = counts.contiguous();
  const at::Tensor quota_E = quota.contiguous();
  const int64_t W = counts_WE.size(0), E = counts_WE.size(1);
  const int32_t* n = counts_WE.data_ptr<int32_t>();
  const int32_t* q = quota_E.data_ptr<int32_t>();
  for (int64_t s = 0; s < W; ++s)
    for (int64_t e = 0; e < E; ++e)
      LRMOE_CHECK(n[s * E + e] >= 0, "counts must be >= 0, got ", n[s * E + e], " at [", s,
                  ", ", e, "]");
  for (int64_t e = 0; e < E; ++e) {
    int64_t total = 0;
    for (int64_t s = 0; s < W; ++s) total += n[s * E + e];
    LRMOE_CHECK(q[e] >= 0 && q[e] <= total, "quota[", e, "] must be in [0, ", total,
                "] (the expert's total count, counts[:, ", e, "].sum()), got ", q[e]);
  }
  at::Tensor shares_WE = at::empty({W, E}, counts_WE.options());
  int32_t* out = shares_WE.data_ptr<int32_t>();
  for (int64_t s = 0; s < W; ++s)
    for (int64_t e = 0; e < E; ++e)
      out[s * E + e] = static_cast<int32_t>(core::source_share(s, e, n, W, E, q[e]));
  return shares_WE;
}

}  // namespace

TORCH_LIBRARY_IMPL(lrmoe, CPU, m) { m.impl("source_shares", &source_shares_cpu); }

}  // namespace lrmoe
