// All retention quotas of one layer at once, on the host, in O(E log E).
//
// The rules are those of csrc/core/quota.h (proportional by largest remainder,
// water_level), whose per-expert form costs O(E) per expert so that one GPU thread
// computes one expert: all E of them on the host is O(E^2) (about 70 us at E = 128),
// more than the whole plan-time budget. Here the same integer arithmetic (the exact
// fraction core::rate_fraction, the total core::retained_total) ranks the experts by
// one sort instead; tests/cpp/test_planner.cpp checks that every quota equals
// core::expert_quota.
//
// Legend: E experts, n_E routed pairs per expert, Q_E quotas, c recalibration rate.
#pragma once

#include <cstdint>

#include "core/quota.h"

namespace lrmoe {
namespace planner {

// Q_E for loads n_E (each in [0, 2^31)); sum(Q) = floor((1 - c) sum(n)).
void all_quotas(core::QuotaRule rule, const int64_t* n_E, int64_t E, double recalibration_rate,
                int64_t* quota_E);

}  // namespace planner
}  // namespace lrmoe
