// Argument checks of the `source_shares` op, shared by source_shares.cpp (CPU) and
// source_shares.cu (CUDA).
//
// Legend: W source ranks, E experts, counts_WE routed pairs of each source rank per
// expert, quota_E global per-expert quota Q_E.
#pragma once

#include <ATen/core/Tensor.h>

#include "ops/common.h"

namespace lrmoe {

// Shape, dtype and device checks only: value checks (counts >= 0, Q_e <= N_e) would
// need a host sync on the device, so the CPU path does them itself.
inline void check_source_shares_args(const at::Tensor& counts_WE, const at::Tensor& quota_E) {
  check_dim(counts_WE, 2, "counts");
  check_dim(quota_E, 1, "quota");
  check_int32(counts_WE, "counts");
  check_int32(quota_E, "quota");
  LRMOE_CHECK(quota_E.size(0) == counts_WE.size(1), "quota must have one entry per expert (",
              counts_WE.size(1), " = counts.shape[1]), got ", quota_E.size(0),
              "; pass the (E,) global quotas of the (W, E) counts");
  check_same_device(counts_WE, "counts", quota_E, "quota");
}

}  // namespace lrmoe
