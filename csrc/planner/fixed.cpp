// Megatron-LM fixed ownership: owner(e) = e / (E / W), no replicas, dropless, exact
// backward (Q_e = n_e; the recalibration rate is the lrmoe policy's).
//
// Memory per rank: E / W owned experts x (weights + grads + optimizer where it lives
// on the device), every routed row of them forward and backward.
#include "planner/common.h"
#include "planner/policies.h"

namespace lrmoe {
namespace planner {
namespace {

class FixedPolicy final : public Policy {
 public:
  PolicyKind kind() const override { return PolicyKind::kFixed; }
  const char* name() const override { return "fixed"; }

  Plan plan(const PlanInput& in) const override {
    detail::validate(in, kind());
    const std::vector<int64_t> n_E = detail::expert_loads(in);
    const MemoryModel& m = in.memory;
    const int64_t per_expert = m.expert_weight_bytes + m.expert_grad_bytes +
                               (m.optimizer_on_device ? m.expert_optimizer_bytes : 0);
    detail::RankBytes bytes;
    bytes.base_W.assign(static_cast<size_t>(in.num_ranks), per_expert * (in.num_experts / in.num_ranks));
    bytes.replica_W.assign(static_cast<size_t>(in.num_ranks), 0);
    return detail::assemble(in, kind(), detail::fixed_layout(in, n_E), n_E, bytes, false);
  }
};

}  // namespace

std::unique_ptr<Policy> make_fixed_policy() { return std::make_unique<FixedPolicy>(); }

}  // namespace planner
}  // namespace lrmoe
