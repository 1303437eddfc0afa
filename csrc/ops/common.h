// Shared argument checks and helpers for the op implementations.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstdio>
#include <string>

namespace lrmoe {

// Every check names the argument and the fix, as users see these messages.
#define LRMOE_CHECK(cond, ...) TORCH_CHECK(cond, "lrmoe: ", __VA_ARGS__)

// Doubles go into messages through snprintf, never through an ostream: streaming a
// double from this library crashed (SIGSEGV) under the lent GPU's torch 2.11 image,
// while integers and strings streamed fine.
inline std::string format_double(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.17g", v);
  return buf;
}

inline void check_dim(const at::Tensor& t, int64_t dim, const char* name) {
  LRMOE_CHECK(t.dim() == dim, name, " must be ", dim, "-D, got shape ", t.sizes());
}

inline void check_int32(const at::Tensor& t, const char* name) {
  LRMOE_CHECK(t.scalar_type() == at::kInt, name, " must be int32, got ", t.scalar_type(),
              "; convert with .to(torch.int32)");
}

inline void check_same_device(const at::Tensor& a, const char* an, const at::Tensor& b,
                              const char* bn) {
  LRMOE_CHECK(a.device() == b.device(), an, " is on ", a.device(), " but ", bn, " is on ",
              b.device(), "; move both to one device");
}

inline void check_floating(const at::Tensor& t, const char* name) {
  LRMOE_CHECK(t.is_floating_point(), name, " must be a floating-point tensor, got ",
              t.scalar_type());
}

// The four dtypes every float kernel is dispatched for; anything else (float8,
// complex) gets a message naming the argument instead of a dispatch error.
inline void check_float_dtype(const at::Tensor& t, const char* name) {
  const auto st = t.scalar_type();
  LRMOE_CHECK(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf || st == at::kDouble,
              name, " must be float32, bfloat16, float16 or float64, got ", st,
              "; convert with .to(torch.bfloat16) or .float()");
}

enum class Metric : int { kLrm = 0, kGradSq = 1, kGradAbs = 2, kRandom = 3 };

inline Metric parse_metric(const std::string& s) {
  if (s == "lrm") return Metric::kLrm;
  if (s == "grad_sq") return Metric::kGradSq;
  if (s == "grad_abs") return Metric::kGradAbs;
  if (s == "random") return Metric::kRandom;
  LRMOE_CHECK(false, "metric must be one of lrm, grad_sq, grad_abs, random; got '", s, "'");
  return Metric::kLrm;
}

enum class Selection : int { kTopk = 0, kImportance = 1 };

inline Selection parse_selection(const std::string& s) {
  if (s == "topk") return Selection::kTopk;
  if (s == "importance") return Selection::kImportance;
  LRMOE_CHECK(false, "selection must be 'topk' or 'importance'; got '", s, "'");
  return Selection::kTopk;
}

}  // namespace lrmoe
