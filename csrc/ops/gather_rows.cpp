// gather_rows, CPU: compaction gather out_RC[r] = scale_R[r] * src_NC[index_R[r] / divisor];
// dispatch_rows, its scatter form: out_RC[slot_P[p]] = scale * src_TC[p / top_k].
//
// Legend: N source rows, C columns, R gathered rows.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <vector>

#include "gather_rows.h"

namespace lrmoe {
namespace {

at::Tensor gather_rows_cpu(const at::Tensor& src, const at::Tensor& index,
                           const std::optional<at::Tensor>& scale, int64_t divisor) {
  check_gather_rows_args(src, index, scale, divisor);
  const at::Tensor src_NC = src.contiguous();
  const at::Tensor index_R = index.contiguous();
  const int64_t N = src_NC.size(0), C = src_NC.size(1), R = index_R.size(0);
  const int32_t* idx = index_R.const_data_ptr<int32_t>();
  for (int64_t r = 0; r < R; ++r) {
    LRMOE_CHECK(idx[r] >= 0 && idx[r] / divisor < N, "index[", r, "] = ", idx[r],
                " maps to source row ", idx[r] / divisor, " (divisor ", divisor,
                ") outside [0, ", N, "); check index and divisor against src.shape[0]");
  }
  at::Tensor out_RC = at::empty({R, C}, src_NC.options());
  if (R == 0 || C == 0) return out_RC;
  const at::Tensor scale_R = scale.has_value() ? scale->contiguous() : at::Tensor();
  const float* sc = scale_R.defined() ? scale_R.const_data_ptr<float>() : nullptr;

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, src_NC.scalar_type(),
                                  "lrmoe_gather_rows_cpu", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const scalar_t* s = src_NC.const_data_ptr<scalar_t>();
    scalar_t* o = out_RC.data_ptr<scalar_t>();
    const int64_t grain = std::max<int64_t>(1, 32768 / C);
    at::parallel_for(0, R, grain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* in = s + static_cast<int64_t>(idx[r] / divisor) * C;
        scalar_t* out = o + r * C;
        if (sc == nullptr) {
          std::memcpy(out, in, C * sizeof(scalar_t));  // exact copy, no rounding
        } else {
          const opmath_t f = static_cast<opmath_t>(sc[r]);
          for (int64_t c = 0; c < C; ++c)
            out[c] = static_cast<scalar_t>(f * static_cast<opmath_t>(in[c]));
        }
      }
    });
  });
  return out_RC;
}

// The reference of the CUDA kernel: every slot in [-1, num_rows), each output row named
// by exactly one pair (the inverse of a gather index), else an error naming the slot.
at::Tensor dispatch_rows_cpu(const at::Tensor& src, const at::Tensor& slot,
                             const std::optional<at::Tensor>& scale, int64_t num_rows,
                             int64_t top_k) {
  check_dispatch_rows_args(src, slot, scale, num_rows, top_k);
  const at::Tensor src_TC = src.contiguous();
  const at::Tensor slot_P = slot.contiguous();
  const int64_t T = src_TC.size(0), C = src_TC.size(1), P = slot_P.size(0), R = num_rows;
  const int32_t* sl = slot_P.const_data_ptr<int32_t>();
  std::vector<int64_t> named_by(R, -1);
  for (int64_t p = 0; p < P; ++p) {
    const int64_t s = sl[p];
    LRMOE_CHECK(s >= -1 && s < R, "slot[", p, "] = ", s, " is outside [-1, num_rows = ", R,
                "); -1 marks a dropped pair");
    if (s < 0) continue;
    LRMOE_CHECK(named_by[s] < 0, "slot[", named_by[s], "] and slot[", p, "] both name row ", s,
                "; each output row must come from one pair (the inverse of a gather index)");
    named_by[s] = p;
  }
  for (int64_t s = 0; s < R; ++s)
    LRMOE_CHECK(named_by[s] >= 0, "no pair names output row ", s, " of num_rows = ", R,
                "; slot must name every row once (e.g. pair_kept from lrmoe.ops.select)");
  at::Tensor out_RC = at::empty({R, C}, src_TC.options());
  if (R == 0 || C == 0) return out_RC;
  const at::Tensor scale_R = scale.has_value() ? scale->contiguous() : at::Tensor();
  const float* sc = scale_R.defined() ? scale_R.const_data_ptr<float>() : nullptr;

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, src_TC.scalar_type(),
                                  "lrmoe_dispatch_rows_cpu", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const scalar_t* s = src_TC.const_data_ptr<scalar_t>();
    scalar_t* o = out_RC.data_ptr<scalar_t>();
    const int64_t grain = std::max<int64_t>(1, 32768 / (C * top_k));
    at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* in = s + t * C;
        for (int64_t k = 0; k < top_k; ++k) {
          const int64_t r = sl[t * top_k + k];
          if (r < 0) continue;
          scalar_t* out = o + r * C;
          if (sc == nullptr) {
            std::memcpy(out, in, C * sizeof(scalar_t));  // exact copy, as gather_rows
          } else {
            const opmath_t f = static_cast<opmath_t>(sc[r]);
            for (int64_t c = 0; c < C; ++c)
              out[c] = static_cast<scalar_t>(f * static_cast<opmath_t>(in[c]));
          }
        }
      }
    });
  });
  return out_RC;
}

}  // namespace

TORCH_LIBRARY_IMPL(lrmoe, CPU, m) {
  m.impl("gather_rows", &gather_rows_cpu);
  m.impl("dispatch_rows", &dispatch_rows_cpu);
}

}  // namespace lrmoe
