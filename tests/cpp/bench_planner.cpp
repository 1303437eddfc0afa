// Plan-time benchmark of csrc/planner: median wall time of make_plan() per policy.
//
//   ./bench_planner [runs]      (default 2000 runs per case)
//
// Loads: the paper's micro-batch, 262,144 routed pairs per source rank (4 x 8192
// tokens x top-8), Zipf-skewed over the experts with max/mean about 4, every source
// rank drawing the same skew with its own noise. Model bytes: Qwen3-30B-A3B expert
// (H 2048, I 768), 80 GiB budget, 64 GiB resident, c = 0.3, lrmoe with a 5 % balance
// target (docs/planner.md). Prints the median, the 90th percentile and the fastest run:
// on a shared machine the fastest is the least disturbed.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "planner/plan.h"

using namespace lrmoe::planner;

namespace {

PlanInput paper_input(int W, int E, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<double> p(E);
  for (int e = 0; e < E; ++e) p[e] = 1.0 / std::pow(e + 1.0, 1.0);
  std::shuffle(p.begin(), p.end(), rng);
  double total = 0;
  for (double v : p) total += v;
  PlanInput in;
  in.num_ranks = W;
  in.num_experts = E;
  in.load_WE.assign(static_cast<size_t>(W) * E, 0);
  const int64_t pairs = 4 * 8192 * 8;
  for (int s = 0; s < W; ++s)
    for (int e = 0; e < E; ++e)
      in.load_WE[static_cast<size_t>(s) * E + e] = static_cast<int64_t>(
          pairs * p[e] / total * std::uniform_real_distribution<double>(0.8, 1.2)(rng));
  in.recalibration_rate = 0.3;
  in.balance_slack = 0.05;  // lrmoe balances too, as `lrmoe plan` does by default
  const int64_t H = 2048, I = 768, GiB = int64_t(1) << 30;
  in.memory.expert_weight_bytes = 3 * H * I * 2;
  in.memory.expert_grad_bytes = 3 * H * I * 4;
  in.memory.expert_optimizer_bytes = 3 * H * I * 12;
  in.memory.forward_row_bytes = 2 * H + 4 * I + 2 * H;
  in.memory.backward_row_bytes = 3 * 2 * H + 2 * 4 * I + 2 * I;
  in.memory.budget_bytes = 80 * GiB;
  in.memory.resident_bytes = 64 * GiB;
  return in;
}

}  // namespace

int main(int argc, char** argv) {
  const int runs = argc > 1 ? std::atoi(argv[1]) : 2000;
  std::printf("%-8s %5s %4s %10s %10s %10s %9s\n", "policy", "E", "W", "median_us", "p90_us",
              "min_us", "replicas");
  for (auto [E, W] : std::vector<std::pair<int, int>>{{128, 8}, {256, 64}}) {
    const PlanInput in = paper_input(W, E, 1);
    for (const char* policy : {"fixed", "ultraep", "symi", "lrmoe"}) {
      const auto pol = make_policy(policy);
      std::vector<double> us(static_cast<size_t>(runs));
      int replicas = 0;
      for (int k = 0; k < runs; ++k) {
        const auto t0 = std::chrono::steady_clock::now();
        const Plan p = pol->plan(in);
        const auto t1 = std::chrono::steady_clock::now();
        us[k] = std::chrono::duration<double, std::micro>(t1 - t0).count();
        replicas = p.replicas;
      }
      std::sort(us.begin(), us.end());
      std::printf("%-8s %5d %4d %10.1f %10.1f %10.1f %9d\n", policy, E, W, us[runs / 2],
                  us[runs * 9 / 10], us[0], replicas);
    }
  }
  return 0;
}
