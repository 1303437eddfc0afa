// combine: argument checks shared by the CPU and CUDA kernels.
//
// Legend: T tokens, K top_k, P = T*K pairs, N rows of y, H hidden size.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

#include "rows.h"

namespace lrmoe {

inline void check_combine_args(const at::Tensor& y_NH, const at::Tensor& pair_row_P,
                               const std::optional<at::Tensor>& weights_TK, int64_t top_k) {
  check_dim(y_NH, 2, "y");
  check_float_dtype(y_NH, "y");
  check_pair_row(pair_row_P, top_k);
  check_same_device(y_NH, "y", pair_row_P, "pair_row");
  if (weights_TK.has_value()) {
    const at::Tensor& w = *weights_TK;
    check_float_dtype(w, "weights");
    const int64_t T = pair_row_P.numel() / top_k;
    LRMOE_CHECK(w.dim() == 2 && w.size(0) == T && w.size(1) == top_k,
                "weights must have shape (T, K) = (", T, ", ", top_k, "), got ", w.sizes(),
                "; pass the routing weights of the pairs in pair_row");
    check_same_device(w, "weights", pair_row_P, "pair_row");
  }
}

}  // namespace lrmoe
