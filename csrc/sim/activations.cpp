// Activation memory of the whole model at the peak of a step (activations.h gives the
// formulas; docs/simulation.md, "Memory and feasibility").
#include "sim/activations.h"

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>

namespace lrmoe {
namespace sim {
namespace {

// a x b x c (all >= 0), or std::overflow_error naming `what`.
int64_t product(int64_t a, int64_t b, int64_t c, const char* what) {
  const long double p = static_cast<long double>(a) * b * c;
  if (p > static_cast<long double>(std::numeric_limits<int64_t>::max()))
    throw std::overflow_error(std::string("activation bytes of ") + what +
                              " exceed int64; lower the tokens or the layers");
  return a * b * c;
}

}  // namespace

void validate_activations(const ActivationModel& m) {
  const int mode = static_cast<int>(m.mode);
  if (mode < 0 || mode > 3)
    throw std::invalid_argument("ActivationModel.mode must be layer, keep, recompute or offload");
  if (m.mode == ActivationMode::kLayer) return;
  if (m.layers < 1)
    throw std::invalid_argument("ActivationModel.layers (--layers-resident) must be >= 1, got " +
                                std::to_string(m.layers) + "; give the model's layer count");
  if (m.top_k < 1)
    throw std::invalid_argument("ActivationModel.top_k must be >= 1, got " +
                                std::to_string(m.top_k) + "; give the model's experts per token");
  const std::pair<const char*, int64_t> sizes[] = {
      {"dense_token_bytes", m.dense_token_bytes}, {"moe_row_bytes", m.moe_row_bytes},
      {"offload_row_bytes", m.offload_row_bytes}, {"input_token_bytes", m.input_token_bytes}};
  for (const auto& [name, v] : sizes)
    if (v < 0)
      throw std::invalid_argument(std::string("ActivationModel.") + name + " must be >= 0, got " +
                                  std::to_string(v));
  if (m.offload_row_bytes > m.moe_row_bytes)
    throw std::invalid_argument("ActivationModel.offload_row_bytes (" +
                                std::to_string(m.offload_row_bytes) +
                                ") must be <= moe_row_bytes (" + std::to_string(m.moe_row_bytes) +
                                "): offload moves part of the saved rows");
}

ActivationBytes activation_bytes(const ActivationModel& m, int64_t tokens) {
  validate_activations(m);
  if (tokens < 0)
    throw std::invalid_argument("tokens per GPU must be >= 0, got " + std::to_string(tokens));
  ActivationBytes b;
  if (m.mode == ActivationMode::kLayer || tokens == 0) return b;
  const int64_t others = m.layers - 1;  // the planned layer's MoE rows are in the plan
  switch (m.mode) {
    case ActivationMode::kKeep:
    case ActivationMode::kOffload: {
      const int64_t row = m.mode == ActivationMode::kKeep ? m.moe_row_bytes
                                                          : m.moe_row_bytes - m.offload_row_bytes;
      b.dense = product(m.layers, tokens, m.dense_token_bytes, "the dense part");
      b.moe = product(others, tokens * static_cast<int64_t>(m.top_k), row, "the MoE part");
      break;
    }
    case ActivationMode::kRecompute:
      b.dense = product(1, tokens, m.dense_token_bytes, "the recomputed layer");
      b.inputs = product(others, tokens, m.input_token_bytes, "the layer inputs");
      break;
    case ActivationMode::kLayer:
      break;
  }
  if (b.dense > std::numeric_limits<int64_t>::max() - b.moe - b.inputs)
    throw std::overflow_error("activation bytes exceed int64; lower the tokens or the layers");
  return b;
}

int64_t tokens_per_gpu(const std::vector<int64_t>& load_WE, int32_t W, int32_t E, int32_t K) {
  if (W < 1 || E < 1 || K < 1)
    throw std::invalid_argument("tokens_per_gpu: W, E and K must be >= 1, got " +
                                std::to_string(W) + ", " + std::to_string(E) + ", " +
                                std::to_string(K));
  if (load_WE.size() != static_cast<size_t>(W) * static_cast<size_t>(E))
    throw std::invalid_argument("tokens_per_gpu: load_WE has " + std::to_string(load_WE.size()) +
                                " entries, W x E = " + std::to_string(int64_t{W} * E));
  int64_t most = 0;
  for (int32_t s = 0; s < W; ++s) {
    int64_t pairs = 0;
    for (int32_t e = 0; e < E; ++e) pairs += load_WE[static_cast<size_t>(s) * E + e];
    most = std::max(most, (pairs + K - 1) / K);
  }
  return most;
}

ActivationMode activation_mode(const char* name) {
  const std::string n = name ? name : "";
  if (n == "layer") return ActivationMode::kLayer;
  if (n == "keep") return ActivationMode::kKeep;
  if (n == "recompute") return ActivationMode::kRecompute;
  if (n == "offload") return ActivationMode::kOffload;
  throw std::invalid_argument("activation mode must be layer, keep, recompute or offload, got '" +
                              n + "'");
}

}  // namespace sim
}  // namespace lrmoe
