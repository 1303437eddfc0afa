// routing_weight_grad: argument checks shared by the CPU and CUDA kernels.
//
// Legend: T tokens, K top_k, P = T*K pairs, N rows of y, H hidden size.
#pragma once

#include <ATen/core/Tensor.h>

#include "rows.h"

namespace lrmoe {

inline void check_routing_weight_grad_args(const at::Tensor& grad_out_TH, const at::Tensor& y_NH,
                                           const at::Tensor& pair_row_P, int64_t top_k) {
  check_dim(grad_out_TH, 2, "grad_out");
  check_float_dtype(grad_out_TH, "grad_out");
  check_dim(y_NH, 2, "y");
  LRMOE_CHECK(y_NH.scalar_type() == grad_out_TH.scalar_type(), "y has dtype ",
              y_NH.scalar_type(), " but grad_out has ", grad_out_TH.scalar_type(),
              "; cast y to grad_out's dtype");
  check_pair_row(pair_row_P, top_k);
  LRMOE_CHECK(y_NH.size(1) == grad_out_TH.size(1), "y has ", y_NH.size(1),
              " columns but grad_out has ", grad_out_TH.size(1), "; both must be (*, H)");
  const int64_t T = pair_row_P.numel() / top_k;
  LRMOE_CHECK(grad_out_TH.size(0) == T, "grad_out has ", grad_out_TH.size(0),
              " rows but pair_row holds T = ", T, " tokens of top_k = ", top_k);
  check_same_device(grad_out_TH, "grad_out", y_NH, "y");
  check_same_device(grad_out_TH, "grad_out", pair_row_P, "pair_row");
}

}  // namespace lrmoe
