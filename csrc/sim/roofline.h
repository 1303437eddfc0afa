// The roofline floor of the expert GEMMs (docs/simulation.md, "Cost model"): no grouped
// GEMM can run faster than its FLOPs at the chip's peak rate or its bytes at the HBM
// bandwidth, plus a launch overhead. The calibrated grid (sim.h GemmTable) is used
// inside its measured rows; beyond the largest measured rows a curve keeps that point's
// efficiency against the roofline, and every time is floored at the roofline.
//
// Legend: H hidden, I expert intermediate size, r rows of one expert. Times ms, FLOPs
// plain, bandwidths GB/s (1e9 bytes per second), peak TFLOP/s (1e12 FLOP per second).
#pragma once

#include <cstdint>
#include <vector>

namespace lrmoe {
namespace sim {

// The chip and the expert's size. peak_TFLOPs == 0 switches the roofline off (the toy
// cost models of tests/cpp/test_sim.cpp have no chip); the H200 constants and their
// source are in docs/simulation.md, "Cost model" (lrmoe/sim/simulate.py fills them).
struct Roofline {
  double peak_TFLOPs = 0;  // dense bf16 matrix rate
  double hbm_GBps = 0;     // device memory bandwidth
  double launch_us = 0;    // per grouped-GEMM pass of one rank (forward or backward)
  int64_t hidden = 0, inter = 0;  // H, I of one SwiGLU expert
  int64_t elem_bytes = 2;         // bytes per weight / activation element (bf16: 2)

  // True when the roofline is set (peak_TFLOPs > 0). Throws std::invalid_argument when
  // it is set with hbm_GBps <= 0, hidden or inter < 1, elem_bytes < 1 or launch_us < 0.
  bool enabled() const;
  // FLOPs of one expert on r rows: gate + up (2 H x 2I per row) and down (2 I x H):
  // 6 H I r forward; the backward's input and weight gradients twice that, 12 H I r.
  double flops(double rows, bool backward) const;
  // The fewest bytes one expert on r rows must move through HBM: its weights once
  // (3 H I elements) and, per row, its input and output (2 H elements) forward; the
  // backward reads the weights, writes their gradients (3 H I each) and per row reads
  // dy and x and writes dx (3 H elements). A lower bound: intermediate activations are
  // left out, so the floor never exceeds a real kernel's traffic.
  double bytes(double rows, bool backward) const;
  // max(flops / peak, bytes / hbm) of one expert on r rows, no launch (ms; 0 for r <= 0).
  double expert_ms(double rows, bool backward) const;
  // The floor of one rank running its instances' rows_I: the sum of expert_ms over
  // instances with rows > 0, plus one launch_us when any has rows (ms).
  double rank_ms(const std::vector<double>& rows_I, bool backward) const;
};

}  // namespace sim
}  // namespace lrmoe
