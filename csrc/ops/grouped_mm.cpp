// grouped_mm, CPU (and the loop every device falls back to): one at::mm per
// group, torch._grouped_mm semantics and output layout.
//
// Legend: E groups, offsets_E inclusive ends along the grouped dim.
//   2D x 3D: a_MK, b_EKN -> out_MN  (out[rows of e] = a[rows of e] @ b[e])
//   2D x 2D: a_MK, b_KN  -> out_EMN (out[e] = a[:, K of e] @ b[K of e])
#include <ATen/ATen.h>
#include <c10/util/strides.h>
#include <torch/library.h>

#include "ops/common.h"
#include "ops/grouped_mm.h"

namespace lrmoe {

at::Tensor grouped_mm_output(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offsets) {
  c10::SmallVector<int64_t, 3> size;
  if (b.dim() == 3) size = {a.size(0), b.size(2)};
  else size = {offsets.size(0), a.size(0), b.size(1)};
  const int64_t align = 16 / static_cast<int64_t>(c10::elementSize(a.scalar_type()));
  auto padded = size;
  padded.back() = (size.back() + align - 1) / align * align;
  const auto strides = c10::contiguous_strides(padded);
  return at::empty_strided(size, strides, a.options());
}

at::Tensor grouped_mm_loop(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offsets) {
  check_grouped_mm_args(a, b, offsets);
  const bool rows = b.dim() == 3;  // 2D x 3D: groups of rows of a
  const int64_t E = offsets.size(0), G = rows ? a.size(0) : a.size(1);
  const at::Tensor offs_E = offsets.to(at::kCPU).contiguous();
  const int32_t* off = offs_E.data_ptr<int32_t>();
  int64_t prev = 0;
  for (int64_t e = 0; e < E; ++e) {
    LRMOE_CHECK(off[e] >= prev && off[e] <= G, "offsets must be non-decreasing inclusive ends in [0, ",
                G, "] (", rows ? "rows of a" : "columns of a", "); offsets[", e, "] = ", off[e],
                " after ", prev);
    prev = off[e];
  }
  at::Tensor out = grouped_mm_output(a, b, offsets);
  int64_t start = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t end = off[e];
    if (rows) {
      if (end > start) {
        at::Tensor out_e = out.slice(0, start, end);
        at::mm_out(out_e, a.slice(0, start, end), b[e]);
      }
    } else {
      at::Tensor out_e = out[e];
      if (end > start) at::mm_out(out_e, a.slice(1, start, end), b.slice(0, start, end));
      else out_e.zero_();
    }
    start = end;
  }
  if (rows && start < a.size(0)) out.slice(0, start, a.size(0)).zero_();
  return out;
}

namespace {

at::Tensor grouped_mm_cpu(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offsets) {
  return grouped_mm_loop(a, b, offsets);
}

}  // namespace

TORCH_LIBRARY_IMPL(lrmoe, CPU, m) { m.impl("grouped_mm", &grouped_mm_cpu); }

}  // namespace lrmoe
