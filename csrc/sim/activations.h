// Activation memory of the whole model at the peak of a training step, for batch
// pressure (sim.h simulate_pressure; docs/simulation.md, "Memory and feasibility").
//
// The planner (planner/plan.h MemoryModel) charges one MoE layer's experts and token
// buffers against budget - resident, with a fixed resident. Here the bytes every OTHER
// layer saves for its backward are added to the resident, so that the resident grows
// with the micro-batch's tokens per GPU and with the number of layers held.
//
// Where the peak is: the backward of the last layer (the first one backpropagated), when
// every layer's saved activations are still live. The planned layer is taken to be that
// layer: its MoE buffers are the plan's forward / backward token buffers, so they are not
// counted here again (the planner's own layer is the worst case over layers).
//
// Plain C++17, no torch; tests/cpp/test_activations.cpp checks it on hand-computed byte
// counts. Bytes are plain bytes, tokens per GPU per micro-batch.
#pragma once

#include <cstdint>
#include <vector>

namespace lrmoe {
namespace sim {

// What each layer keeps on the GPU between its forward and its backward.
enum class ActivationMode : int {
  kLayer = 0,      // the old model: no activations beyond the planned MoE layer's buffers
  kKeep = 1,       // every layer keeps all its saved activations
  kRecompute = 2,  // full recompute: every layer keeps only its input; one layer's
                   // activations are live again during its recomputed forward
  kOffload = 3,    // as kKeep, but the saved MoE gate/up rows live on the host (the
                   // planned layer as SimConfig::offload); the dense part stays on the GPU
};

// Per-token and per-row byte sizes of one layer (bytes), and how many layers are held.
struct ActivationModel {
  ActivationMode mode = ActivationMode::kLayer;
  // layers whose activations are held on one GPU, the planned layer included (the
  // model's layers; fewer for a pipeline stage)
  int32_t layers = 0;
  int32_t top_k = 1;  // K: routed rows per token
  // saved for backward per token per layer outside the MoE experts (attention, norms,
  // router); lrmoe/sim/simulate.py activation_model gives the formula and its source
  int64_t dense_token_bytes = 0;
  // saved per routed row per layer by the experts on the GPU (the planner's
  // forward_row_bytes: dispatched x, gate/up, expert output)
  int64_t moe_row_bytes = 0;
  // of moe_row_bytes, what offload moves to the host (the gate/up rows, 4 I in bf16)
  int64_t offload_row_bytes = 0;
  // a layer's input per token (H x elem_bytes), what recompute keeps of every layer
  int64_t input_token_bytes = 0;
};

// The activation bytes on one GPU, by part, for the layers other than the planned one
// (and, under recompute, the recomputed layer's dense part).
struct ActivationBytes {
  int64_t dense = 0;   // attention + norms
  int64_t moe = 0;     // saved expert rows of the other layers
  int64_t inputs = 0;  // recompute: the other layers' inputs
  int64_t total() const { return dense + moe + inputs; }
};

// Throws std::invalid_argument naming the field and the fix: layers < 1 or top_k < 1
// (when mode is not kLayer), a negative size, or offload_row_bytes > moe_row_bytes.
void validate_activations(const ActivationModel& m);

// Bytes on one GPU of `tokens` tokens per GPU (N = layers, T = tokens, K = top_k):
//   kLayer:     0
//   kKeep:      dense = N T dense_token_bytes,  moe = (N - 1) T K moe_row_bytes
//   kOffload:   dense as kKeep,                 moe = (N - 1) T K (moe_row_bytes - offload_row_bytes)
//   kRecompute: dense = T dense_token_bytes (the layer being recomputed),
//               inputs = (N - 1) T input_token_bytes
// The other layers' expert rows per GPU are their mean, T K (a layer's hottest rank is
// charged only for the planned layer, in the plan). Throws std::invalid_argument for
// tokens < 0, what validate_activations throws, or std::overflow_error past int64.
ActivationBytes activation_bytes(const ActivationModel& m, int64_t tokens);

// Tokens per GPU of a W x E load matrix: the largest source rank's ceil(sum_e L[s][e] / K)
// (each GPU routes its own tokens, K rows each). Throws std::invalid_argument for W or E
// < 1, K < 1, or load_WE.size() != W x E.
int64_t tokens_per_gpu(const std::vector<int64_t>& load_WE, int32_t W, int32_t E, int32_t K);

// "layer", "keep", "recompute", "offload" -> the mode; throws std::invalid_argument else.
ActivationMode activation_mode(const char* name);

}  // namespace sim
}  // namespace lrmoe
