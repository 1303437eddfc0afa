// permute: argument checks shared by the CPU and CUDA kernels.
//
// Legend: T tokens, K top_k, P = T*K pairs, E experts.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <limits>

#include "common.h"

namespace lrmoe {

inline void check_permute_args(const at::Tensor& expert_ids_TK, int64_t num_experts) {
  check_dim(expert_ids_TK, 2, "expert_ids");
  const auto st = expert_ids_TK.scalar_type();
  LRMOE_CHECK(st == at::kInt || st == at::kLong, "expert_ids must be int32 or int64, got ", st,
              "; convert with .to(torch.int32)");
  LRMOE_CHECK(num_experts >= 1, "num_experts must be >= 1, got ", num_experts);
  LRMOE_CHECK(num_experts < (int64_t{1} << 20), "num_experts must be < 2**20, got ",
              num_experts);
  LRMOE_CHECK(expert_ids_TK.numel() < std::numeric_limits<int32_t>::max(),
              "expert_ids has ", expert_ids_TK.numel(),
              " pairs; P = T * K must be < 2**31 (int32 rows); split the batch");
}

}  // namespace lrmoe
