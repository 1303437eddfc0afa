// gather_rows, CPU: compaction gather out_RC[r] = scale_R[r] * src_NC[index_R[r] / divisor].
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

}  // namespace

TORCH_LIBRARY_IMPL(lrmoe, CPU, m) { m.impl("gather_rows", &gather_rows_cpu); }

}  // namespace lrmoe
