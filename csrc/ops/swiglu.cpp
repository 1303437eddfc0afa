// swiglu / swiglu_backward, CPU.
//
// Legend: N rows produced (index.numel(), or all M rows of h), I expert
// intermediate size; h_N2I = [gate | up] (read through index when given),
// phi_NI = silu(gate) * up (fp32 math, rounded to h.dtype), phi_sq_N = sum of
// squares of the ROUNDED phi (the LRM's ||phi_u||^2 of what W_down really sees),
// grad_h_N2I = [d gate | d up].
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>

#include "swiglu.h"

namespace lrmoe {
namespace {

std::tuple<at::Tensor, at::Tensor> swiglu_cpu(const at::Tensor& h,
                                              const std::optional<at::Tensor>& index) {
  const int64_t N = check_swiglu_args(h, index);
  check_swiglu_index_values(index, h.size(0));
  const at::Tensor h_N2I = h.contiguous();
  const at::Tensor idx_N = index.has_value() ? index->contiguous() : at::Tensor();
  const int32_t* ip = index.has_value() ? idx_N.const_data_ptr<int32_t>() : nullptr;
  const int64_t I = h_N2I.size(1) / 2;
  at::Tensor phi_NI = at::empty({N, I}, h_N2I.options());
  at::Tensor phi_sq_N = at::empty({N}, h_N2I.options().dtype(at::kFloat));
  if (N == 0) return {phi_NI, phi_sq_N};
  float* sq = phi_sq_N.data_ptr<float>();

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, h_N2I.scalar_type(),
                                  "lrmoe_swiglu_cpu", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const scalar_t* hp = h_N2I.const_data_ptr<scalar_t>();
    scalar_t* pp = phi_NI.data_ptr<scalar_t>();
    const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(I, 1));
    at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        const scalar_t* gate = hp + (ip ? ip[n] : n) * 2 * I;
        const scalar_t* up = gate + I;
        scalar_t* phi = pp + n * I;
        opmath_t acc = 0;
        for (int64_t i = 0; i < I; ++i) {
          const scalar_t stored = static_cast<scalar_t>(
              swiglu_phi(static_cast<opmath_t>(gate[i]), static_cast<opmath_t>(up[i])));
          phi[i] = stored;
          const opmath_t x = static_cast<opmath_t>(stored);
          acc += x * x;
        }
        sq[n] = static_cast<float>(acc);
      }
    });
  });
  return {phi_NI, phi_sq_N};
}

at::Tensor swiglu_backward_cpu(const at::Tensor& grad_phi, const at::Tensor& h,
                               const std::optional<at::Tensor>& index) {
  const int64_t N = check_swiglu_backward_args(grad_phi, h, index);
  check_swiglu_index_values(index, h.size(0));
  const at::Tensor h_N2I = h.contiguous();
  const at::Tensor dphi_NI = grad_phi.contiguous();
  const at::Tensor idx_N = index.has_value() ? index->contiguous() : at::Tensor();
  const int32_t* ip = index.has_value() ? idx_N.const_data_ptr<int32_t>() : nullptr;
  const int64_t I = h_N2I.size(1) / 2;
  at::Tensor grad_h_N2I = at::empty({N, 2 * I}, h_N2I.options());
  if (N == 0 || I == 0) return grad_h_N2I;

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, h_N2I.scalar_type(),
                                  "lrmoe_swiglu_backward_cpu", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const scalar_t* hp = h_N2I.const_data_ptr<scalar_t>();
    const scalar_t* dp = dphi_NI.const_data_ptr<scalar_t>();
    scalar_t* op = grad_h_N2I.data_ptr<scalar_t>();
    const int64_t grain = std::max<int64_t>(1, 16384 / I);
    at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        const scalar_t* gate = hp + (ip ? ip[n] : n) * 2 * I;
        const scalar_t* up = gate + I;
        const scalar_t* dphi = dp + n * I;
        scalar_t* dgate = op + n * 2 * I;
        scalar_t* dup = dgate + I;
        for (int64_t i = 0; i < I; ++i) {
          opmath_t dg, du;
          swiglu_grad(static_cast<opmath_t>(dphi[i]), static_cast<opmath_t>(gate[i]),
                      static_cast<opmath_t>(up[i]), dg, du);
          dgate[i] = static_cast<scalar_t>(dg);
          dup[i] = static_cast<scalar_t>(du);
        }
      }
    });
  });
  return grad_h_N2I;
}

}  // namespace

TORCH_LIBRARY_IMPL(lrmoe, CPU, m) {
  m.impl("swiglu", &swiglu_cpu);
  m.impl("swiglu_backward", &swiglu_backward_cpu);
}

}  // namespace lrmoe
