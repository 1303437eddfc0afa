// Shared argument checks for the row-movement ops (gather_rows, combine,
// routing_weight_grad, swiglu): light headers only, used by .cpp and .cu alike.
//
// Legend: N rows of a row-major activation buffer, C/H columns.
#pragma once

#include <ATen/core/Tensor.h>

#include "common.h"

namespace lrmoe {

// pair_row (P,) int32 and top_k must describe P = T * K pairs.
inline void check_pair_row(const at::Tensor& pair_row_P, int64_t top_k) {
  check_dim(pair_row_P, 1, "pair_row");
  check_int32(pair_row_P, "pair_row");
  LRMOE_CHECK(top_k >= 1, "top_k must be >= 1, got ", top_k);
  LRMOE_CHECK(pair_row_P.numel() % top_k == 0, "top_k (", top_k,
              ") must divide pair_row.numel() (", pair_row_P.numel(),
              "); pass the flattened (T, K) pair_row from permute and its K");
}

// The values of a contiguous pair_row (host memory: CPU kernels only): each a
// row of y in [0, N), or -1 for a dropped pair.
inline void check_pair_row_values(const int32_t* pair_row_P, int64_t P, int64_t N) {
  for (int64_t p = 0; p < P; ++p) {
    LRMOE_CHECK(pair_row_P[p] >= -1 && pair_row_P[p] < N, "pair_row[", p, "] = ", pair_row_P[p],
                " is outside [-1, ", N, "); rows index y (N = y.shape[0]), -1 marks a dropped pair");
  }
}

}  // namespace lrmoe
