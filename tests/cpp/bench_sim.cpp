// Speed benchmark of csrc/sim: steps x layers x every expert-parallel group of the
// cluster per policy (sim/cluster.h).
//
//   ./bench_sim [steps=1000] [layers=48] [gpus=1024] [threads=2] [experts=128] [slack=0]
//
// The GPUs form gpus / ep data-parallel copies of an EP group of ep = min(gpus, experts)
// ranks (nodes of 8); every group is simulated on its own loads (docs/simulation.md,
// "64-1024 GPUs"). Loads: the paper's micro-batch, 262,144 routed pairs per source rank
// (4 x 8192 tokens x top-8), Zipf-skewed per layer (exponent 1, hot experts at random
// ids per layer), 16 distinct draws of +-20 % noise; group g at step s takes draw
// (s + 2 g) mod 16, so the groups of one step see different loads. Costs: the Qwen3-30B-A3B figures of docs/journal/performance.md (one point per
// experts count, linear in rows) floored at the H200 roofline, NVLink 370 GB/s, network
// 50 GB/s per GPU through the hierarchical all-to-all of sim/a2a.h (top-8 dedup, 1 us per
// peer, 4 chunks). c = 0.3 and
// the balance target `slack` for lrmoe (0, the library's default,
// lrmoe.planner.DEFAULT_BALANCE_SLACK; negative: off). Prints wall seconds per policy
// and in all, the mean per-layer time (slowest group, mean group) and the mean step:
// the 48 layers plus the step terms of sim/step.h (cluster_steps: the expert and dense
// gradient all-reduces, Adam, SYMI's broadcast), for Qwen3-30B-A3B's 1.54e9 dense
// parameters (lrmoe/workload/shapes.py) with fp32 gradients and the H200's 4,800 GB/s.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <malloc.h>
#include <random>
#include <vector>

#include "planner/plan.h"
#include "sim/cluster.h"
#include "sim/sim.h"

using namespace lrmoe;

int main(int argc, char** argv) {
  // keep freed memory in the process: every plan allocates a few 128-256 KiB arrays
  // (W x I cells), which glibc otherwise maps and unmaps per layer, and the kernel
  // zeroes the fresh pages (clear_page_rep was 10-12 % of a perf profile). A process
  // that embeds the simulator gets the same with MALLOC_MMAP_THRESHOLD_ /
  // MALLOC_TRIM_THRESHOLD_ in its environment (glibc mallopt(3)); results do not change
  mallopt(M_MMAP_THRESHOLD, 64 << 20);
  mallopt(M_TRIM_THRESHOLD, 512 << 20);
  const int64_t steps = argc > 1 ? std::atoll(argv[1]) : 1000;
  const int64_t layers = argc > 2 ? std::atoll(argv[2]) : 48;
  const int gpus = argc > 3 ? std::atoi(argv[3]) : 1024;
  const int threads = argc > 4 ? std::atoi(argv[4]) : 2;
  const int E = argc > 5 ? std::atoi(argv[5]) : 128;
  const double slack = argc > 6 ? std::atof(argv[6]) : 0.0;
  const int W = std::min(gpus, E);
  const int64_t groups = std::max(1, gpus / W);
  const int64_t distinct = 16, pairs = 4 * 8192 * 8;
  const size_t cell = static_cast<size_t>(W) * E;
  std::mt19937_64 rng(1);
  std::vector<std::vector<double>> pop(static_cast<size_t>(layers), std::vector<double>(E));
  for (auto& p : pop) {
    for (int e = 0; e < E; ++e) p[e] = 1.0 / (e + 1.0);
    std::shuffle(p.begin(), p.end(), rng);
    double t = 0;
    for (double v : p) t += v;
    for (double& v : p) v /= t;
  }
  std::uniform_real_distribution<double> noise(0.8, 1.2);
  std::vector<int64_t> pool(static_cast<size_t>(distinct * layers) * cell);
  for (int64_t s = 0; s < distinct; ++s)
    for (int64_t l = 0; l < layers; ++l)
      for (int w = 0; w < W; ++w)
        for (int e = 0; e < E; ++e)
          pool[((s * layers + l) * W + w) * E + e] =
              static_cast<int64_t>(pairs * pop[l][e] * noise(rng));

  planner::PlanInput base;
  base.num_ranks = W;
  base.num_experts = E;
  const int64_t H = 2048, I = 768, GiB = int64_t(1) << 30;
  base.memory = {3 * H * I * 2, 3 * H * I * 4, 3 * H * I * 12, false,
                 2 * H + 4 * I + 2 * H, 6 * H + 12 * I, 80 * GiB, 64 * GiB};
  sim::SimConfig cfg;
  // 32k tokens, 128 experts: forward GEMMs 4.03 ms, backward 8.35 ms (docs/journal/performance.md)
  for (double k : {1.0, 16.0, 128.0})
    for (double r : {256.0, 2048.0})
      cfg.cost.gemm.push_back({k, r, 4.03 * k / 128 * r / 2048, 8.35 * k / 128 * r / 2048});
  cfg.cost.per_row = {0, 0.53 / 262144, 0.34 / 262144, 0,
                      0, 0.04 / 262144, 0.14 / 262144, 0, 1.02 / 262144, 0.33 / 262144};
  cfg.cost.h2d_GBps = 50;
  cfg.link = {8, 370, 10, 50, 20, 2100};
  // the all-to-all of sim/a2a.h: deduplicated over the top-8, 1 us per peer, 4 chunks
  cfg.link.per_peer_us = 1;
  cfg.link.chunks = 4;
  cfg.top_k = 8;
  // the H200 roofline of one Qwen3 expert (docs/simulation.md, "Cost model")
  cfg.cost.roofline.peak_TFLOPs = 989;
  cfg.cost.roofline.hbm_GBps = 4800;
  cfg.cost.roofline.launch_us = 10;
  cfg.cost.roofline.hidden = H;
  cfg.cost.roofline.inter = I;
  cfg.hidden = H;

  // steps per call; each cell's loads are read in place from the pool (sim.h CellLoads):
  // no per-chunk copy of 100 MB while the threads wait, one thread start per 50 steps
  const int64_t chunk = 50;
  const int64_t per_step = groups * layers;  // (group, layer) cells of one step
  // the step terms (sim/step.h), once per step, after the chunk's layers
  sim::StepModel step;
  step.dp_size = static_cast<int32_t>(groups);
  step.dense_params = 1541093376.0;  // Qwen3-30B-A3B: attention, norms, routers, embeddings
  step.dense_grad_bytes = 4 * step.dense_params;  // fp32, as expert_grad_bytes
  step.expert_params = 3.0 * H * I;
  step.hbm_GBps = 4800;
  double total = 0;
  std::printf("%-8s %6s %6s %5s %4s %6s %9s %12s %12s %9s %9s %9s %8s %8s %9s\n", "policy",
              "steps", "layers", "gpus", "ep", "groups", "seconds", "max_fb_ms", "mean_fb_ms",
              "feasible", "moe_ms", "allred_ms", "adam_ms", "bcast_ms", "step_ms");
  for (const char* policy : {"fixed", "ultraep", "symi", "lrmoe"}) {
    planner::PlanInput in = base;
    in.recalibration_rate = std::string(policy) == "lrmoe" ? 0.3 : 0.0;
    in.balance_slack = slack;
    const auto t0 = std::chrono::steady_clock::now();
    double sum_ms = 0, sum_mean = 0;
    int64_t ok = 0, n = 0;
    double st_moe = 0, st_ar = 0, st_opt = 0, st_bc = 0;
    int64_t st_ok = 0;
    for (int64_t s0 = 0; s0 < steps; s0 += chunk) {
      const int64_t ns = std::min(chunk, steps - s0);
      // cell j = (s x groups + g) x layers + l of this chunk: group g at step s0 + s
      // takes draw (s0 + s + 2 g) mod 16; j < 0 is the step before the chunk
      const sim::CellLoads at = [&](int64_t j) -> const int64_t* {
        const int64_t s = j >= 0 ? j / per_step : -1;
        if (s0 + s < 0) return nullptr;
        const int64_t g = ((j % per_step) + per_step) % per_step / layers, l = ((j % layers) + layers) % layers;
        const int64_t draw = (s0 + s + 2 * g) % distinct;
        return pool.data() + static_cast<size_t>(draw * layers + l) * cell;
      };
      const auto out = sim::simulate_cluster(policy, in, at, ns, groups, layers, cfg, threads);
      for (const auto& r : out) {
        ++n;
        if (r.feasible) { ++ok; sum_ms += r.time_ms; sum_mean += r.mean_group_ms; }
      }
      for (const auto& st : sim::cluster_steps(out, ns, layers, W,
                                               static_cast<double>(in.memory.expert_grad_bytes),
                                               cfg.link, step)) {
        if (!st.feasible) continue;
        ++st_ok;
        st_moe += st.moe_ms;
        st_ar += st.terms.expert_allreduce_ms + st.terms.dense_allreduce_ms;
        st_opt += st.terms.optimizer_ms;
        st_bc += st.terms.broadcast_ms;
      }
    }
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    total += sec;
    const double k = st_ok ? 1.0 / static_cast<double>(st_ok) : NAN;
    std::printf("%-8s %6lld %6lld %5d %4d %6lld %9.2f %12.3f %12.3f %5lld/%lld %9.1f %9.1f %8.1f "
                "%8.2f %9.1f\n", policy,
                (long long)steps, (long long)layers, gpus, W, (long long)groups, sec,
                ok ? sum_ms / ok : NAN, ok ? sum_mean / ok : NAN, (long long)ok, (long long)n,
                st_moe * k, st_ar * k, st_opt * k, st_bc * k, (st_moe + st_ar + st_opt + st_bc) * k);
  }
  std::printf("total %.2f s (%d threads)\n", total, threads);
  return 0;
}
