// Argument checks of the `score` op, shared by score.cpp (CPU) and score.cu (CUDA).
//
// Legend: T tokens, K top_k, P = T*K routed pairs, H hidden size;
// grad_out g_TH, weights alpha_TK, phi_sq_P and row_pair_P in row order.
#pragma once

#include <ATen/core/Tensor.h>

#include "ops/common.h"

namespace lrmoe {

inline void check_score_args(const at::Tensor& grad_out_TH, const at::Tensor& weights_TK,
                             const at::Tensor& phi_sq_P, const at::Tensor& row_pair_P) {
  check_dim(grad_out_TH, 2, "grad_out");
  check_dim(weights_TK, 2, "weights");
  check_dim(phi_sq_P, 1, "phi_sq");
  check_dim(row_pair_P, 1, "row_pair");
  check_float_dtype(grad_out_TH, "grad_out");  // dispatched: the four float dtypes only
  check_floating(weights_TK, "weights");
  LRMOE_CHECK(phi_sq_P.scalar_type() == at::kFloat, "phi_sq must be float32, got ",
              phi_sq_P.scalar_type(), "; it is the fp32 by-product of swiglu");
  check_int32(row_pair_P, "row_pair");
  check_same_device(grad_out_TH, "grad_out", weights_TK, "weights");
  check_same_device(grad_out_TH, "grad_out", phi_sq_P, "phi_sq");
  check_same_device(grad_out_TH, "grad_out", row_pair_P, "row_pair");
  const int64_t T = grad_out_TH.size(0), K = weights_TK.size(1);
  LRMOE_CHECK(weights_TK.size(0) == T, "weights must be (T, K) with T = grad_out.size(0) = ", T,
              ", got shape ", weights_TK.sizes());
  LRMOE_CHECK(row_pair_P.size(0) == T * K, "row_pair must have T*K = ", T * K,
              " entries (one per routed pair), got ", row_pair_P.size(0));
  LRMOE_CHECK(phi_sq_P.size(0) == T * K, "phi_sq must have T*K = ", T * K,
              " entries (one per row), got ", phi_sq_P.size(0));
}

}  // namespace lrmoe
