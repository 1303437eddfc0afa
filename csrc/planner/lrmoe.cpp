// LRMoE: retention quotas and replicas planned jointly under the per-GPU budget.
// docs/planner.md, "lrmoe", states the rules; in short:
//
//   1. Q = the quota rule at c (core::compute_quotas, csrc/core/quota.h).
//   2. Owners as fixed ownership. A rank whose bytes (or retained rows, with
//      backward_row_capacity) exceed its limit first cuts demand on its hottest
//      experts: a water level over their quotas, no expert below
//      floor((1 - max_expert_cut) n_e) retained. At c = 0 nothing is cut (exact
//      training).
//   3. Only then replicas, for the hard limits first: for a rank still over, its
//      experts by retained rows descending move rows (forward and retained together, so saved activations
//      never move) to a replica on the rank with the most room that has a free slot
//      (replica_slots per rank) and no instance of the expert. A replica the retained
//      load does not need is never placed: replicas come only after the cut.
//   4. Capacity-aware routing (route.h) spreads each expert's Q_e over its instances
//      within every rank's remaining backward rows.
//   5. With `joint`, joint.h refines the result on one objective (max rank time of
//      forward + retained rows + replica traffic, c as a budget on the rows dropped).
//   With balance_slack >= 0 the steps 3-4 also aim at (1 + slack) x the mean retained
//   rows per rank, as if it were a row capacity (but missing it is not infeasible):
//   with the slots the hard limits left, the hot ranks' experts are replicated. The target never cuts demand (step 2 sees
//   only the budget and the row capacity): balance is bought with replicas, and c
//   alone decides how many pairs the backward drops (a first version cut for the
//   target too and kept 0.61-0.69 of the pairs at c = 0.3: experiments/sim_balance.py).
//
// Memory per rank: owners as fixed ownership, placed replicas x (weights + grads),
// forward rows x forward_row_bytes, retained rows x backward_row_bytes.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>

#include "planner/common.h"
#include "planner/joint.h"
#include "planner/policies.h"

namespace lrmoe {
namespace planner {
namespace {

constexpr int64_t kUnbounded = std::numeric_limits<int64_t>::max() / 4;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Lower the quotas of `experts` (hottest first) by `cut` rows in total, none below
// floor_E: the largest level L with sum max(floor, min(Q, L)) <= sum(Q) - cut, then
// the rows still owed back to the experts above L, most retained first. Returns the
// rows actually cut (less than `cut` when every expert is at its floor).
int64_t water_cut(const std::vector<int32_t>& experts, int64_t cut,
                  const std::vector<int64_t>& floor_E, std::vector<int64_t>* quota_E) {
  std::vector<int64_t>& Q = *quota_E;
  int64_t sum = 0, sum_floor = 0, top = 0;
  for (int32_t e : experts) {
    sum += Q[e];
    sum_floor += floor_E[e];
    top = std::max(top, Q[e]);
  }
  if (sum - sum_floor <= cut) {
    for (int32_t e : experts) Q[e] = floor_E[e];
    return sum - sum_floor;
  }
  const int64_t target = sum - cut;
  auto filled = [&](int64_t level) {
    int64_t f = 0;
    for (int32_t e : experts) f += std::max(floor_E[e], std::min(Q[e], level));
    return f;
  };
  int64_t lo = 0, hi = top;  // filled(top) = sum > target >= filled(0) = sum_floor
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (filled(mid) <= target) lo = mid; else hi = mid - 1;
  }
  int64_t owed = target - filled(lo);
  std::vector<int32_t> hot(experts);
  std::stable_sort(hot.begin(), hot.end(), [&](int32_t a, int32_t b) { return Q[a] > Q[b]; });
  for (int32_t e : hot) {
    const int64_t at = std::max(floor_E[e], std::min(Q[e], lo));
    // only experts cut to the level itself can take a row back (filled(lo + 1) - filled(lo)
    // of them exist, more than owed)
    const int64_t back = (owed > 0 && floor_E[e] <= lo && Q[e] > lo) ? 1 : 0;
    owed -= back;
    Q[e] = at + back;
  }
  return cut;
}

class LRMoEPolicy final : public Policy {
 public:
  PolicyKind kind() const override { return PolicyKind::kLRMoE; }
  const char* name() const override { return "lrmoe"; }

  Plan plan(const PlanInput& in) const override {
    detail::validate(in, kind());
    const int32_t W = in.num_ranks, E = in.num_experts, per = E / W;
    const int32_t G = detail::node_size(in);  // node(r) = r / G
    const MemoryModel& m = in.memory;
    const std::vector<int64_t> n_E = detail::expert_loads(in);
    std::vector<int64_t> Q(static_cast<size_t>(E));
    core::compute_quotas(in.quota_rule, n_E.data(), E, in.recalibration_rate, Q.data());
    std::vector<int64_t> floor_E(Q);
    if (in.recalibration_rate > 0.0) {
      // core::retained_total(n_e, max_expert_cut) with the fraction found once
      const core::RateFraction cut = core::rate_fraction(in.max_expert_cut);
      for (int32_t e = 0; e < E; ++e)
        floor_E[e] = std::min(Q[e], n_E[e] > 0 ? (cut.q - cut.p) * n_E[e] / cut.q : 0);
    }

    const int64_t copy = m.expert_weight_bytes + m.expert_grad_bytes;
    const int64_t base = (copy + (m.optimizer_on_device ? m.expert_optimizer_bytes : 0)) * per;
    const int64_t limit = m.budget_bytes - m.resident_bytes;
    const int64_t fb = m.forward_row_bytes, bb = m.backward_row_bytes;
    const int64_t hard_rows = in.backward_row_capacity > 0 ? in.backward_row_capacity : kUnbounded;
    int64_t cap_rows = hard_rows;  // with the balance target below: steps 3-4 only
    int64_t target_rows = 0;  // the balance target, if any (planned for like a capacity)
    if (in.balance_slack >= 0.0) {
      int64_t kept = 0;
      for (int64_t q : Q) kept += q;
      target_rows = std::max<int64_t>(
          1, static_cast<int64_t>(std::ceil((1.0 + in.balance_slack) * static_cast<double>(kept) / W)));
      cap_rows = std::min(cap_rows, target_rows);
    }
    std::vector<int64_t> fwd_W(static_cast<size_t>(W), 0), bwd_W(static_cast<size_t>(W), 0);
    std::vector<int32_t> reps_W(static_cast<size_t>(W), 0);
    auto over_bytes = [&](int32_t r) {
      return base + reps_W[r] * copy + fwd_W[r] * fb + bwd_W[r] * bb - limit;
    };
    // retained rows rank r must shed to fit `cap` retained rows and, where shedding a
    // row frees bytes_per_row > 0 bytes, its memory limit
    auto rows_to_shed = [&](int32_t r, int64_t bytes_per_row, int64_t cap) {
      int64_t need = std::max<int64_t>(0, bwd_W[r] - cap);
      const int64_t over = over_bytes(r);
      if (over > 0 && bytes_per_row > 0) need = std::max(need, ceil_div(over, bytes_per_row));
      return need;
    };

    // 2. cut the hottest experts of every over-committed rank (rank r owns experts
    // r * per ... r * per + per - 1)
    for (int32_t e = 0; e < E; ++e) {
      const int32_t r = detail::fixed_owner(e, E, W);
      fwd_W[r] += n_E[e];
      bwd_W[r] += Q[e];
    }
    std::vector<int32_t> owned(static_cast<size_t>(per));
    auto owned_by = [&](int32_t r) {
      std::iota(owned.begin(), owned.end(), r * per);
      return owned;
    };
    for (int32_t r = 0; r < W; ++r) {
      const int64_t need = rows_to_shed(r, bb, hard_rows);
      if (need > 0) bwd_W[r] -= water_cut(owned_by(r), std::min(need, bwd_W[r]), floor_E, &Q);
    }

    // 3. replicas for ranks still over
    std::vector<detail::Replica> replicas;
    // held_EW[e * W + j]: rank j holds an instance of e (a flat table: the balance target
    // places many replicas, and scanning the list for every candidate rank made the
    // planner quadratic in them; tests/cpp/bench_sim.cpp)
    std::vector<uint8_t> held_EW(static_cast<size_t>(E) * W, 0);
    for (int32_t e = 0; e < E; ++e)
      held_EW[static_cast<size_t>(e) * W + detail::fixed_owner(e, E, W)] = 1;
    auto holds = [&](int32_t e, int32_t j) {
      return held_EW[static_cast<size_t>(e) * W + j] != 0;
    };
    // A replica takes forward rows (detail::Replica::rows; detail::assemble then splits
    // the expert's quota over its instances in proportion to their forward rows), so a
    // moved forward row of expert e carries Q_e / n_e retained rows with it. The forward
    // is exact: at c > 0 an expert has n_e - Q_e forward rows beyond its retained ones,
    // which must be able to move too (counting moves in retained rows left them at the
    // owner, and a hot expert's forward alone could then exceed the budget where ultraep
    // fits: docs/simulation.md, "Speed").
    std::vector<int64_t> owner_fwd(n_E);  // forward rows left at the owner
    auto retained_of = [&](int32_t e, int64_t f) {  // ~ f * Q_e / n_e, rounded to nearest
      return n_E[e] > 0 ? static_cast<int64_t>(std::llround(static_cast<double>(f) *
                                                            static_cast<double>(Q[e]) /
                                                            static_cast<double>(n_E[e])))
                        : 0;
    };
    // Replicas for the ranks over `cap` retained rows (or their memory), most over first.
    // Run twice: for the hard limits (budget, row capacity) first, then, with the slots
    // left, for the balance target -- chasing the target first could spend a rank's last
    // slot on balance and leave a rank over its budget where every baseline fits
    // (tests/cpp/test_planner.cpp, "FeasibleWheneverUltraEPIs").
    bool slots_bind = false;
    auto place_replicas = [&](int64_t cap) {
      std::vector<int32_t> ranks(static_cast<size_t>(W));
      std::iota(ranks.begin(), ranks.end(), 0);
      std::stable_sort(ranks.begin(), ranks.end(), [&](int32_t a, int32_t b) {
        return rows_to_shed(a, fb + bb, cap) > rows_to_shed(b, fb + bb, cap);
      });
      for (int32_t r : ranks) {
        if (rows_to_shed(r, fb + bb, cap) == 0) continue;
        std::vector<int32_t> hot = owned_by(r);
        std::stable_sort(hot.begin(), hot.end(), [&](int32_t a, int32_t b) { return Q[a] > Q[b]; });
        for (int32_t e : hot) {
          if (n_E[e] == 0) continue;
          // bytes one moved forward row takes along, and its retained share
          const double share = static_cast<double>(Q[e]) / static_cast<double>(n_E[e]);
          const double row_bytes = static_cast<double>(fb) + static_cast<double>(bb) * share;
          auto fwd_rows_for = [&](int64_t bytes, int64_t bwd_rows, bool up) {
            // forward rows whose bytes reach `bytes` and whose retained rows reach bwd_rows
            // (up: the fewest that do; else the most that stay within them)
            double f = row_bytes > 0 ? static_cast<double>(bytes) / row_bytes : 0.0;
            if (share > 0) {
              const double g = static_cast<double>(bwd_rows) / share;
              f = up ? std::max(f, g) : std::min(f, g);
            }
            return static_cast<int64_t>(up ? std::ceil(f) : std::floor(f));
          };
          while (owner_fwd[e] > 0) {
            const int64_t over = std::max<int64_t>(0, over_bytes(r));
            const int64_t over_rows = std::max<int64_t>(0, bwd_W[r] - cap);
            if (over == 0 && over_rows == 0) break;
            const int64_t need = fwd_rows_for(over, over_rows, true);
            if (need <= 0) break;  // nothing this expert's rows can shed (no retained share)
            // the rank with the most room, on r's node if one there can take rows
            // (replicas inside the NVLink domain first: PlanInput::gpus_per_node)
            int32_t t = -1, t_far = -1;
            int64_t t_rows = 0, t_far_rows = 0;
            bool slot_short = false;
            for (int32_t j = 0; j < W; ++j) {
              if (j == r) continue;
              if (holds(e, j)) continue;
              // forward rows j can take with a new replica: bytes left after the copy,
              // and its row capacity for their retained share
              const int64_t left = -over_bytes(j) - copy;
              if (left <= 0) continue;
              const int64_t room = std::max<int64_t>(0, cap - bwd_W[j]);
              const int64_t rows = fwd_rows_for(left, room, false);
              if (rows <= 0) continue;
              if (reps_W[j] >= in.replica_slots) { slot_short = true; continue; }
              if (j / G != r / G) {
                if (rows > t_far_rows) { t_far = j; t_far_rows = rows; }
              } else if (rows > t_rows) {
                t = j; t_rows = rows;
              }
            }
            if (t < 0) { t = t_far; t_rows = t_far_rows; }
            if (t < 0) {
              // only a hard limit missed makes slots the binding constraint
              slots_bind = slots_bind || (slot_short && cap == hard_rows);
              break;
            }
            const int64_t q = std::min({need, owner_fwd[e], t_rows});
            const int64_t qb = retained_of(e, q);
            replicas.push_back({e, t, q});
            held_EW[static_cast<size_t>(e) * W + t] = 1;
            owner_fwd[e] -= q;
            reps_W[t] += 1;
            fwd_W[t] += q; bwd_W[t] += qb;
            fwd_W[r] -= q; bwd_W[r] -= qb;
          }
        }
      }
    };
    place_replicas(hard_rows);
    if (cap_rows < hard_rows) place_replicas(cap_rows);

    detail::RankBytes bytes;
    bytes.base_W.assign(static_cast<size_t>(W), base);
    bytes.replica_W.resize(static_cast<size_t>(W));
    for (int32_t r = 0; r < W; ++r) bytes.replica_W[r] = reps_W[r] * copy;
    Plan p = detail::assemble(in, kind(), detail::fixed_layout(in, n_E, replicas), Q, bytes,
                              true, target_rows);
    // 5. (joint) one objective over cuts and replicas from this start (joint.h)
    if (in.joint) p = detail::joint_refine(in, p, floor_E);
    if (!p.feasible) {  // why lrmoe could not fix it (built only here: formatting is slow)
      if (slots_bind)
        p.reason += "; replica_slots: ranks with room had no free slot (replica_slots=" +
                    std::to_string(in.replica_slots) + "); more slots would help";
      else if (in.recalibration_rate == 0.0)
        p.reason += "; c = 0 is exact (no demand cut): a recalibration rate c > 0 lets lrmoe "
                    "cut demand";
      else
        p.reason += "; every expert of the rank is at its cut floor (max_expert_cut=" +
                    std::to_string(in.max_expert_cut) + ") and no rank has room for a replica";
    }
    if (!p.feasible && slots_bind && p.binding == Binding::kMemory) p.binding = Binding::kReplicaSlots;
    return p;
  }
};

}  // namespace

std::unique_ptr<Policy> make_lrmoe_policy() { return std::make_unique<LRMoEPolicy>(); }

}  // namespace planner
}  // namespace lrmoe
