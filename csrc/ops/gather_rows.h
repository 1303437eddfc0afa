// gather_rows and dispatch_rows: argument checks shared by the CPU and CUDA kernels.
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

// dispatch_rows: out_RC[slot_P[p]] = scale_R[slot_P[p]] * src_TC[p / top_k] for every
// pair p with slot_P[p] >= 0 (the scatter form of gather_rows: each source row is read
// once and written to its K slots).
inline void check_dispatch_rows_args(const at::Tensor& src_TC, const at::Tensor& slot_P,
                                     const std::optional<at::Tensor>& scale_R,
                                     int64_t num_rows, int64_t top_k) {
  check_dim(src_TC, 2, "src");
  check_float_dtype(src_TC, "src");
  check_dim(slot_P, 1, "slot");
  check_int32(slot_P, "slot");
  check_same_device(src_TC, "src", slot_P, "slot");
  LRMOE_CHECK(top_k >= 1, "top_k must be >= 1, got ", top_k);
  LRMOE_CHECK(num_rows >= 0, "num_rows must be >= 0, got ", num_rows);
  LRMOE_CHECK(slot_P.size(0) == src_TC.size(0) * top_k, "slot has ", slot_P.size(0),
              " entries but src has ", src_TC.size(0), " rows and top_k = ", top_k,
              "; pass one slot per pair (T * top_k)");
  if (scale_R.has_value()) {
    const at::Tensor& s = *scale_R;
    check_dim(s, 1, "scale");
    LRMOE_CHECK(s.scalar_type() == at::kFloat, "scale must be float32, got ", s.scalar_type(),
                "; convert with .float()");
    LRMOE_CHECK(s.size(0) == num_rows, "scale has ", s.size(0), " entries but num_rows is ",
                num_rows, "; pass one factor per output row");
    check_same_device(s, "scale", slot_P, "slot");
  }
}

}  // namespace lrmoe
