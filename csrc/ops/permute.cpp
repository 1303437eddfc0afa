// permute, CPU: stable counting sort of routed pairs by expert.
//
// Legend: T tokens, K top_k, P = T*K pairs (pair id p = t*K + k), E experts.
// expert_ids_TK -> row_pair_P (pair of each sorted row), pair_row_P (its
// inverse), tokens_per_expert_E, offsets_E (inclusive ends).
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "permute.h"

namespace lrmoe {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> permute_cpu(
    const at::Tensor& expert_ids_TK, int64_t num_experts) {
  check_permute_args(expert_ids_TK, num_experts);
  const at::Tensor ids_P = expert_ids_TK.contiguous();
  const int64_t P = ids_P.numel(), E = num_experts;
  const auto i32 = ids_P.options().dtype(at::kInt);
  at::Tensor row_pair_P = at::empty({P}, i32);
  at::Tensor pair_row_P = at::empty({P}, i32);
  at::Tensor tokens_per_expert_E = at::zeros({E}, i32);
  at::Tensor offsets_E = at::empty({E}, i32);
  int32_t* n_E = tokens_per_expert_E.data_ptr<int32_t>();
  int32_t* offs_E = offsets_E.data_ptr<int32_t>();
  int32_t* row_pair = row_pair_P.data_ptr<int32_t>();
  int32_t* pair_row = pair_row_P.data_ptr<int32_t>();

  AT_DISPATCH_INDEX_TYPES(ids_P.scalar_type(), "lrmoe_permute_cpu", [&] {
    const index_t* ids = ids_P.const_data_ptr<index_t>();
    for (int64_t p = 0; p < P; ++p) {
      const int64_t e = ids[p];
      LRMOE_CHECK(e >= 0 && e < E, "expert_ids holds ", e, " at flat position ", p,
                  "; every id must lie in [0, num_experts = ", E, ")");
      ++n_E[e];
    }
    // cursor_E starts at each expert's first row; walking pairs in order keeps
    // rows of one expert in increasing pair id (stability).
    std::vector<int32_t> cursor_E(E);
    int32_t end = 0;
    for (int64_t e = 0; e < E; ++e) {
      cursor_E[e] = end;
      end += n_E[e];
      offs_E[e] = end;
    }
    for (int64_t p = 0; p < P; ++p) {
      const int32_t r = cursor_E[ids[p]]++;
      row_pair[r] = static_cast<int32_t>(p);
      pair_row[p] = r;
    }
  });
  return {row_pair_P, pair_row_P, tokens_per_expert_E, offsets_E};
}

}  // namespace

TORCH_LIBRARY_IMPL(lrmoe, CPU, m) { m.impl("permute", &permute_cpu); }

}  // namespace lrmoe
