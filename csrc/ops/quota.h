// Argument checks of the `quota` op, shared by quota.cpp (CPU) and quota.cu (CUDA).
//
// Legend: E experts, n_E routed pairs per expert (tokens_per_expert), c the
// recalibration rate, Q_E the retention quota.
#pragma once

#include <ATen/core/Tensor.h>

#include <cmath>
#include <string>

#include "core/quota.h"
#include "ops/common.h"

namespace lrmoe {

inline core::QuotaRule parse_quota_rule(const std::string& s) {
  if (s == "proportional") return core::QuotaRule::kProportional;
  if (s == "water_level") return core::QuotaRule::kWaterLevel;
  LRMOE_CHECK(false, "rule must be 'proportional' or 'water_level'; got '", s, "'");
  return core::QuotaRule::kProportional;
}

// c is a host scalar, so both devices validate it without a sync.
inline core::QuotaRule check_quota_args(const at::Tensor& n_E, double recalibration_rate,
                                        const std::string& rule) {
  check_dim(n_E, 1, "tokens_per_expert");
  check_int32(n_E, "tokens_per_expert");
  LRMOE_CHECK(std::isfinite(recalibration_rate) && recalibration_rate >= 0.0 &&
                  recalibration_rate < 1.0,
              "recalibration_rate must be in [0, 1), got ", format_double(recalibration_rate),
              " (0 keeps every pair; 0.3 drops 3 in 10 pairs from the expert backward)");
  return parse_quota_rule(rule);
}

}  // namespace lrmoe
