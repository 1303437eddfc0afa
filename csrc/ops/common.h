// Shared argument checks and helpers for the op implementations.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <type_traits>

namespace lrmoe {

// Error messages are built here, without std::ostream: on the lent GPU's torch 2.11
// image a number streamed into an ostream from this library crashed the process
// (SIGSEGV) while strings streamed fine. Numbers go through to_string/snprintf; an
// argument of any other type fails to compile, so nothing can slip back to an ostream.
namespace detail {

inline std::string format_double(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.17g", v);
  return buf;
}

inline void append(std::string& s, const char* v) { s += v; }
inline void append(std::string& s, char v) { s += v; }
inline void append(std::string& s, const std::string& v) { s += v; }
inline void append(std::string& s, std::string_view v) { s.append(v.data(), v.size()); }
inline void append(std::string& s, bool v) { s += v ? "true" : "false"; }
template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
inline void append(std::string& s, T v) { s += std::to_string(v); }
template <typename T, std::enable_if_t<std::is_floating_point_v<T>, int> = 0>
inline void append(std::string& s, T v) { s += format_double(static_cast<double>(v)); }
inline void append(std::string& s, c10::IntArrayRef v) {
  s += '[';
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  s += ']';
}
inline void append(std::string& s, c10::ScalarType v) { s += c10::toString(v); }
inline void append(std::string& s, const c10::Device& v) { s += v.str(); }

template <typename... Args>
std::string concat(const Args&... args) {
  std::string s;
  (append(s, args), ...);
  return s;
}

}  // namespace detail

using detail::format_double;

// Every check names the argument and the fix, as users see these messages.
#define LRMOE_CHECK(cond, ...) \
  TORCH_CHECK(cond, ::lrmoe::detail::concat("lrmoe: ", __VA_ARGS__))

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
