// The Python module lrmoe._C. Loading it runs the static initialisers of csrc/ops that
// register the torch ops (csrc/ops/registration.cpp); the module itself holds
// rate_fraction and the plain C++ programs bound as structs and functions:
// lrmoe._C.planner (csrc/python/planner_bindings.cpp) and lrmoe._C.sim
// (csrc/python/sim_bindings.cpp).
#include <pybind11/pybind11.h>

#include <utility>

#include "core/quota.h"
#include "python/bindings.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "lrmoe's compiled extension: the torch ops (torch.ops.lrmoe), rate_fraction, "
            "and the planner (lrmoe._C.planner) and simulator (lrmoe._C.sim)";
  // The recalibration rate as the exact fraction p/q that every quota uses
  // (core::rate_fraction), so Python sizes the backward buffers, R = (q - p) * P / q,
  // with the same arithmetic as the C++ quotas and in plain ints torch.compile traces.
  m.def(
      "rate_fraction",
      [](double rate) {
        if (!(rate >= 0.0 && rate < 1.0))
          throw py::value_error("rate_fraction: recalibration_rate must be in [0, 1)");
        const auto f = lrmoe::core::rate_fraction(rate);
        return std::make_pair(static_cast<long long>(f.p), static_cast<long long>(f.q));
      },
      py::arg("recalibration_rate"),
      "rate_fraction(recalibration_rate) -> (p, q), the exact fraction used for c");
  lrmoe::python::bind_planner(m.def_submodule(
      "planner", "The placement planner (csrc/planner): PlanInput -> plan() -> Plan"));
  lrmoe::python::bind_sim(m.def_submodule(
      "sim", "The cluster simulator (csrc/sim): SimConfig, simulate_trace, LayerResult"));
}
