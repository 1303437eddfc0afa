// The `grouped_mm` op (torch._grouped_mm semantics): argument checks and the
// per-expert at::mm loop, shared by grouped_mm.cpp (CPU, where the loop is
// defined) and grouped_mm.cu (CUDA, which uses it off the fused path).
//
// Legend: E groups (experts), offsets_E inclusive ends along the grouped dim.
//   2D x 3D: a_MK, b_EKN, groups of rows of a        -> out_MN
//   2D x 2D: a_MK, b_KN,  groups along K (the tokens) -> out_EMN
#pragma once

#include <ATen/core/Tensor.h>

#include "ops/common.h"

namespace lrmoe {

inline void check_grouped_mm_args(const at::Tensor& a, const at::Tensor& b,
                                  const at::Tensor& offsets) {
  check_dim(a, 2, "a");
  LRMOE_CHECK(b.dim() == 2 || b.dim() == 3, "b must be 3-D (E, K, N) for groups of rows or 2-D "
              "(K, N) for groups along K, got shape ", b.sizes());
  check_dim(offsets, 1, "offsets");
  check_int32(offsets, "offsets");
  const auto dt = a.scalar_type();
  LRMOE_CHECK(dt == at::kBFloat16 || dt == at::kHalf || dt == at::kFloat || dt == at::kDouble,
              "a must be bfloat16, float16, float32 or float64, got ", dt);
  LRMOE_CHECK(b.scalar_type() == dt, "b must have the dtype of a (", dt, "), got ", b.scalar_type());
  check_same_device(a, "a", b, "b");
  check_same_device(a, "a", offsets, "offsets");
  if (b.dim() == 3) {
    LRMOE_CHECK(b.size(1) == a.size(1), "b must be (E, K, N) with K = a.size(1) = ", a.size(1),
                ", got shape ", b.sizes());
    LRMOE_CHECK(offsets.size(0) == b.size(0), "offsets must have one entry per group (b.size(0) = ",
                b.size(0), "), got ", offsets.size(0));
  } else {
    LRMOE_CHECK(b.size(0) == a.size(1), "b must be (K, N) with K = a.size(1) = ", a.size(1),
                ", got shape ", b.sizes());
  }
}

// Output with the layout torch._grouped_mm allocates: last dim padded to a
// 16-byte stride, contiguous otherwise.
at::Tensor grouped_mm_output(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offsets);

// out = per group at::mm into the output above (reads offsets on the host:
// a device sync on CUDA); validates offsets. Rows of a past offsets[-1]
// (2D x 3D) get zeros, as do empty groups (2D x 2D).
at::Tensor grouped_mm_loop(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offsets);

}  // namespace lrmoe
