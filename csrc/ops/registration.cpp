// The lrmoe operator library: one schema per op. Implementations register
// themselves per dispatch key in csrc/ops/<op>.cpp (CPU) and <op>.cu (CUDA);
// fake (meta) kernels for torch.compile live in lrmoe/ops.py.
//
// Legend used by every op: T tokens, K top_k, P = T*K routed pairs, E experts,
// H hidden size, I expert intermediate size, R retained pairs.
// "row" = position in the expert-sorted (permuted) order; "pair" = t*K + k.
#include <Python.h>
#include <torch/library.h>

#include "core/quota.h"

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
  // placement planner (csrc/planner), host only: load (W, E) int -> instance_offsets (E+1),
  // instance_rank (I), forward (I, W), retained (I, W), quota (E), rows (3, W) [fixed,
  // forward, backward], memory (W, 4) [base, replicas, forward, backward] bytes, status (6)
  // [feasible, binding, binding_rank, shortfall, limit_bytes, replicas], reason; all int64.
  // memory_bytes = [weight, grad, optimizer, forward_row, backward_row, budget, resident].
  m.def("plan(Tensor load, str policy, int[] memory_bytes, bool optimizer_on_device, "
        "float recalibration_rate, str quota_rule, int replica_slots, int symi_slots, "
        "Tensor? previous_load, float max_expert_cut, int backward_row_capacity, "
        "int min_replica_rows, float balance_slack) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, "
        "Tensor, str)");
  // cluster simulator (csrc/sim), host only: load (S, L, W, E) int -> fields (S*L, 31)
  // float64 (columns: lrmoe/sim.py FIELDS), sent bytes (S*L, 5, W) int64 (empty unless
  // sizes[3]), the first infeasible plan's reason. gemm (G, 4) float64 calibrated points;
  // per_row 12 ms-per-row costs (lrmoe/sim.py PER_ROW); link [gpus_per_node, intra GB/s, intra us, inter GB/s,
  // inter us, self-copy GB/s]; sizes [hidden, elem_bytes, offload_row_bytes, per_rank_bytes];
  // multiplier > 0: batch pressure (up to max_micro micro-batches per layer).
  m.def("sim(Tensor load, str policy, int[] memory_bytes, bool optimizer_on_device, "
        "float recalibration_rate, str quota_rule, int replica_slots, int symi_slots, "
        "float max_expert_cut, int backward_row_capacity, int min_replica_rows, "
        "float balance_slack, Tensor gemm, float[] per_row, float[] link, int[] sizes, "
        "bool offload, float h2d_GBps, int threads, Tensor? previous_load, float multiplier, "
        "int max_micro) -> (Tensor, Tensor, str)");
}

// The recalibration rate as the exact fraction p/q that every quota uses
// (core::rate_fraction), so Python sizes the backward buffers, R = (q - p) * P / q,
// with the same arithmetic as the C++ quotas and in plain ints torch.compile traces.
static PyObject* py_rate_fraction(PyObject*, PyObject* args) {
  double rate = 0.0;
  if (!PyArg_ParseTuple(args, "d", &rate)) return nullptr;
  if (!(rate >= 0.0 && rate < 1.0)) {
    PyErr_SetString(PyExc_ValueError, "rate_fraction: recalibration_rate must be in [0, 1)");
    return nullptr;
  }
  const auto f = lrmoe::core::rate_fraction(rate);
  return Py_BuildValue("(LL)", static_cast<long long>(f.p), static_cast<long long>(f.q));
}

static PyMethodDef methods[] = {
    {"rate_fraction", py_rate_fraction, METH_VARARGS,
     "rate_fraction(recalibration_rate) -> (p, q), the exact fraction used for c"},
    {nullptr, nullptr, 0, nullptr}};

// `import lrmoe._C` loads this library, whose static initialisers register the ops.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, methods};
  return PyModule_Create(&module_def);
}
