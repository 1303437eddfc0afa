// grouped_mm, CUDA: torch._grouped_mm (CUTLASS, device offsets, no host sync)
// where it applies, else the per-group at::mm loop of grouped_mm.cpp.
//
// Legend: E groups, offsets_E inclusive ends along the grouped dim.
//   2D x 3D: a_MK, b_EKN -> out_MN;  2D x 2D: a_MK, b_KN -> out_EMN.
//
// The fused kernel needs bf16 on sm90/sm100, TMA-friendly operands (16-byte
// aligned base, one unit stride, the other stride a multiple of 16 bytes) and
// per-group base pointers that stay 16-byte aligned for any offsets: groups
// must move along the non-unit-stride dim of a (and of b in 2D x 2D). Rows of a
// past offsets[-1] are left unspecified there (zeros in the loop).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>

#include "ops/common.h"
#include "ops/grouped_mm.h"

namespace lrmoe {
namespace {

// Mirrors at::native::check_valid_strides_and_return_transposed, as a test.
bool tma_friendly(const at::Tensor& m) {
  const int64_t align = 16 / static_cast<int64_t>(m.element_size());
  if (reinterpret_cast<uintptr_t>(m.data_ptr()) % 16 != 0) return false;
  if (m.dim() == 3 && m.stride(0) % align != 0) return false;
  const int64_t d = m.dim() - 1;
  const auto st = m.strides();
  const auto sz = m.sizes();
  if (st[d - 1] == 1 && st[d] >= std::max<int64_t>(1, sz[d - 1])) return st[d] % align == 0;
  if (st[d] == 1 && st[d - 1] >= std::max<int64_t>(1, sz[d])) return st[d - 1] % align == 0;
  return false;
}

bool use_fused(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offsets) {
  if (a.scalar_type() != at::kBFloat16) return false;
  const int major = at::cuda::getDeviceProperties(a.device().index())->major;
  if (major != 9 && major != 10) return false;
  if (a.numel() == 0 || b.numel() == 0 || offsets.size(0) == 0) return false;
  if (offsets.stride(0) != 1) return false;
  if (!tma_friendly(a) || !tma_friendly(b)) return false;
  if (b.dim() == 3) return a.stride(1) == 1;    // row groups: a row-major
  return a.stride(0) == 1 && b.stride(1) == 1;  // K groups: K is the outer dim of both
}

at::Tensor grouped_mm_cuda(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offsets) {
  check_grouped_mm_args(a, b, offsets);
  const c10::cuda::CUDAGuard guard(a.device());
  if (use_fused(a, b, offsets)) return at::_grouped_mm(a, b, offsets);
  return grouped_mm_loop(a, b, offsets);
}

}  // namespace

TORCH_LIBRARY_IMPL(lrmoe, CUDA, m) { m.impl("grouped_mm", &grouped_mm_cuda); }

}  // namespace lrmoe
