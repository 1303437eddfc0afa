// swiglu / swiglu_backward: argument checks and the scalar math shared by the
// CPU and CUDA kernels (one definition of the formulas for both devices).
//
// Legend: N rows (routed pairs in row order), I expert intermediate size;
// h_N2I = [gate | up], phi_NI = silu(gate) * up, phi_sq_N = ||phi||^2.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/macros/Macros.h>

#include <cmath>
#include <optional>

#include "rows.h"

namespace lrmoe {

// Returns N, the rows produced: index.numel() when an index selects rows of h
// (values in [0, M); checked on the CPU only, the CUDA kernels assert), else M.
inline int64_t check_swiglu_args(const at::Tensor& h_M2I,
                                 const std::optional<at::Tensor>& index_N) {
  check_dim(h_M2I, 2, "h");
  check_float_dtype(h_M2I, "h");
  LRMOE_CHECK(h_M2I.size(1) % 2 == 0, "h must be (M, 2I) = [gate | up], got an odd width ",
              h_M2I.size(1), "; pass the gate_up projection output");
  if (!index_N.has_value()) return h_M2I.size(0);
  check_dim(*index_N, 1, "index");
  check_int32(*index_N, "index");
  check_same_device(*index_N, "index", h_M2I, "h");
  return index_N->size(0);
}

inline int64_t check_swiglu_backward_args(const at::Tensor& grad_phi_NI, const at::Tensor& h_M2I,
                                          const std::optional<at::Tensor>& index_N) {
  const int64_t N = check_swiglu_args(h_M2I, index_N);
  check_dim(grad_phi_NI, 2, "grad_phi");
  LRMOE_CHECK(grad_phi_NI.scalar_type() == h_M2I.scalar_type(), "grad_phi has dtype ",
              grad_phi_NI.scalar_type(), " but h has ", h_M2I.scalar_type(),
              "; cast grad_phi to h's dtype");
  LRMOE_CHECK(grad_phi_NI.size(0) == N && 2 * grad_phi_NI.size(1) == h_M2I.size(1),
              "grad_phi must have shape (N, I) = (", N, ", ", h_M2I.size(1) / 2,
              ") for h of shape ", h_M2I.sizes(), " and ", N, " selected rows, got ",
              grad_phi_NI.sizes());
  check_same_device(grad_phi_NI, "grad_phi", h_M2I, "h");
  return N;
}

// CPU: every index value must name a row of h.
inline void check_swiglu_index_values(const std::optional<at::Tensor>& index_N, int64_t M) {
  if (!index_N.has_value()) return;
  const at::Tensor idx = index_N->contiguous();
  const int32_t* p = idx.const_data_ptr<int32_t>();
  for (int64_t n = 0; n < idx.numel(); ++n)
    LRMOE_CHECK(p[n] >= 0 && p[n] < M, "index[", n, "] = ", p[n], " is outside [0, ", M,
                ") (rows of h)");
}

// sigma(g) in the accumulation type; exp overflow for very negative g gives 0, not NaN.
C10_HOST_DEVICE inline float swiglu_sigmoid(float g) { return 1.0f / (1.0f + ::expf(-g)); }
C10_HOST_DEVICE inline double swiglu_sigmoid(double g) { return 1.0 / (1.0 + ::exp(-g)); }

// phi = silu(g) * u
template <typename T>
C10_HOST_DEVICE inline T swiglu_phi(T g, T u) {
  return g * swiglu_sigmoid(g) * u;
}

// d gate = dphi * u * s * (1 + g (1 - s)); d up = dphi * silu(g)
template <typename T>
C10_HOST_DEVICE inline void swiglu_grad(T dphi, T g, T u, T& dgate, T& dup) {
  const T s = swiglu_sigmoid(g);
  dgate = dphi * u * s * (T(1) + g * (T(1) - s));
  dup = dphi * g * s;
}

}  // namespace lrmoe
