// Argument checks of the `select` op, shared by select.cpp (CPU) and select.cu (CUDA).
//
// Legend: P rows, E experts, R retained rows; score_P and row_pair_P in row
// order, offsets_E inclusive ends of each expert's rows, quota_E retention quota.
#pragma once

#include <ATen/core/Tensor.h>

#include "ops/common.h"

namespace lrmoe {

inline void check_select_args(const at::Tensor& score_P, const at::Tensor& row_pair_P,
                              const at::Tensor& offsets_E, const at::Tensor& quota_E,
                              int64_t num_retained) {
  check_dim(score_P, 1, "score");
  check_dim(row_pair_P, 1, "row_pair");
  check_dim(offsets_E, 1, "offsets");
  check_dim(quota_E, 1, "quota");
  LRMOE_CHECK(score_P.scalar_type() == at::kFloat, "score must be float32, got ",
              score_P.scalar_type(), "; pass the output of lrmoe.ops.score");
  check_int32(row_pair_P, "row_pair");
  check_int32(offsets_E, "offsets");
  check_int32(quota_E, "quota");
  check_same_device(score_P, "score", row_pair_P, "row_pair");
  check_same_device(score_P, "score", offsets_E, "offsets");
  check_same_device(score_P, "score", quota_E, "quota");
  const int64_t P = score_P.size(0);
  LRMOE_CHECK(row_pair_P.size(0) == P, "row_pair must have one entry per score (", P, "), got ",
              row_pair_P.size(0));
  LRMOE_CHECK(quota_E.size(0) == offsets_E.size(0), "quota must have one entry per expert (",
              offsets_E.size(0), " = offsets.numel()), got ", quota_E.size(0));
  LRMOE_CHECK(offsets_E.size(0) >= 1 || P == 0, "offsets must have E >= 1 entries when there are rows");
  LRMOE_CHECK(P < (int64_t(1) << 31), "select supports fewer than 2**31 rows, got ", P);
  LRMOE_CHECK(num_retained >= 0 && num_retained <= P, "num_retained must be in [0, ", P,
              "] (floor((1 - c) * P)), got ", num_retained);
}

}  // namespace lrmoe
