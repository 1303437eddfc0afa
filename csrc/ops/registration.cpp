// The lrmoe operator library: one schema per op. Implementations register
// themselves per dispatch key in csrc/ops/<op>.cpp (CPU) and <op>.cu (CUDA);
// fake (meta) kernels for torch.compile live in lrmoe/ops.py. The planner and the
// simulator are no ops: csrc/python binds them as programs (lrmoe._C.planner, lrmoe._C.sim),
// and csrc/python/module.cpp is the module whose loading runs these registrations.
//
// Legend used by every op: T tokens, K top_k, P = T*K routed pairs, E experts,
// H hidden size, I expert intermediate size, R retained pairs.
// "row" = position in the expert-sorted (permuted) order; "pair" = t*K + k.
#include <torch/library.h>

TORCH_LIBRARY(lrmoe, m) {
  // expert_ids (T, K) int32/int64 -> row_pair (P) int32, pair_row (P) int32,
  // tokens_per_expert (E) int32, offsets (E) int32 (inclusive ends).
  m.def("permute(Tensor expert_ids, int num_experts) -> (Tensor, Tensor, Tensor, Tensor)");
  // out[r] = scale[r] * src[index[r] / divisor]; src (N, C), index (R) int32.
  m.def("gather_rows(Tensor src, Tensor index, Tensor? scale, int divisor) -> Tensor");
  // its scatter form: out[slot[p]] = scale[slot[p]] * src[p / top_k] for slot[p] >= 0;
  // src (T, C), slot (T*top_k) int32, out (num_rows, C).
  m.def("dispatch_rows(Tensor src, Tensor slot, Tensor? scale, int num_rows, int top_k) -> Tensor");
  // out[t] = sum_k w[t,k] * y[pair_row[t*K+k]] (row -1 skipped), fp32 accumulation.
  m.def("combine(Tensor y, Tensor pair_row, Tensor? weights, int top_k) -> Tensor");
  // grad_weights[t,k] = <grad_out[t], y[pair_row[t*K+k]]> in fp32 (row -1 gives 0).
  m.def("routing_weight_grad(Tensor grad_out, Tensor y, Tensor pair_row, int top_k) -> Tensor");
  // per-row backward priority, fp32: metric in {lrm, grad_sq, grad_abs, random}.
  m.def("score(Tensor grad_out, Tensor weights, Tensor phi_sq, Tensor row_pair, str metric, int seed) -> Tensor");
  // retention quota per expert (E) int32; rule in {proportional, water_level}.
  m.def("quota(Tensor tokens_per_expert, float recalibration_rate, str rule) -> Tensor");
  // expert parallelism: split quota (E) int32 over the source ranks of counts (W, E)
  // int32 by largest remainder -> shares (W, E) int32, sum_s shares[s, e] == quota[e].
  m.def("source_shares(Tensor counts, Tensor quota) -> Tensor");
  // -> kept_rows (R), kept_pair (R), pair_kept (P, -1 = dropped), kept_offsets (E),
  //    kept_scale (R) fp32, retained_mass () fp32; selection in {topk, importance}.
  m.def("select(Tensor score, Tensor row_pair, Tensor offsets, Tensor quota, int num_retained, "
        "str selection, int seed) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  // h (M, 2I) = [gate | up] -> phi (N, I) = silu(gate) * up, phi_sq (N) fp32, of rows
  // index (N) int32 of h (the compaction fused into the read), or of all rows (N = M).
  m.def("swiglu(Tensor h, Tensor? index=None) -> (Tensor, Tensor)");
  // grad_phi (N, I), h (M, 2I), index as in swiglu -> grad_h (N, 2I).
  m.def("swiglu_backward(Tensor grad_phi, Tensor h, Tensor? index=None) -> Tensor");
  // torch._grouped_mm semantics (2D x 3D, 2D x 2D with offsets on K); a per-expert
  // loop where the fused kernel does not apply.
  m.def("grouped_mm(Tensor a, Tensor b, Tensor offsets) -> Tensor");
}
