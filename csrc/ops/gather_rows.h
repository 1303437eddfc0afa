// gather_rows: argument checks shared by the CPU and CUDA kernels.
//
// Legend: N source rows, C columns, R gathered rows.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

#include "rows.h"

namespace lrmoe {

inline void check_gather_rows_args(const at::Tensor& src_NC, const at::Tensor& index_R,
                                   const std::optional<at::Tensor>& scale_R, int64_t divisor) {
  check_dim(src_NC, 2, "src");
  check_float_dtype(src_NC, "src");
  check_dim(index_R, 1, "index");
  check_int32(index_R, "index");
  check_same_device(src_NC, "src", index_R, "index");
  LRMOE_CHECK(divisor >= 1, "divisor must be >= 1, got ", divisor,
              "; pass top_k to map pair ids to token ids, or 1 for a plain gather");
  if (scale_R.has_value()) {
    const at::Tensor& s = *scale_R;
    check_dim(s, 1, "scale");
    LRMOE_CHECK(s.scalar_type() == at::kFloat, "scale must be float32, got ", s.scalar_type(),
                "; convert with .float()");
    LRMOE_CHECK(s.size(0) == index_R.size(0), "scale has ", s.size(0),
                " entries but index has ", index_R.size(0), "; pass one factor per gathered row");
    check_same_device(s, "scale", index_R, "index");
  }
}

}  // namespace lrmoe
