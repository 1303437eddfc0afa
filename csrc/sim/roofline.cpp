// The roofline floor of the expert GEMMs (roofline.h; docs/simulation.md, "Cost model").
#include "sim/roofline.h"

#include <algorithm>
#include <stdexcept>

namespace lrmoe {
namespace sim {

bool Roofline::enabled() const {
  if (!(peak_TFLOPs > 0)) return false;
  if (!(hbm_GBps > 0))
    throw std::invalid_argument("roofline: hbm_GBps must be > 0 when peak_TFLOPs is set");
  if (hidden < 1 || inter < 1)
    throw std::invalid_argument("roofline: hidden and inter must be >= 1 (the expert's H, I)");
  if (elem_bytes < 1) throw std::invalid_argument("roofline: elem_bytes must be >= 1");
  if (launch_us < 0) throw std::invalid_argument("roofline: launch_us must be >= 0");
  return true;
}

double Roofline::flops(double rows, bool backward) const {
  const double hi = static_cast<double>(hidden) * static_cast<double>(inter);
  return (backward ? 12.0 : 6.0) * hi * rows;
}

double Roofline::bytes(double rows, bool backward) const {
  const double e = static_cast<double>(elem_bytes);
  const double w = 3.0 * static_cast<double>(hidden) * static_cast<double>(inter) * e;
  const double row = static_cast<double>(hidden) * e;
  return backward ? 2.0 * w + 3.0 * row * rows : w + 2.0 * row * rows;
}

double Roofline::expert_ms(double rows, bool backward) const {
  if (rows <= 0) return 0.0;
  // TFLOP/s = 1e9 FLOP per ms; GB/s = 1e6 bytes per ms
  return std::max(flops(rows, backward) / (peak_TFLOPs * 1e9),
                  bytes(rows, backward) / (hbm_GBps * 1e6));
}

double Roofline::rank_ms(const std::vector<double>& rows_I, bool backward) const {
  double t = 0.0;
  bool any = false;
  for (double r : rows_I) {
    if (r <= 0) continue;
    any = true;
    t += expert_ms(r, backward);
  }
  return any ? t + launch_us * 1e-3 : 0.0;
}

}  // namespace sim
}  // namespace lrmoe
