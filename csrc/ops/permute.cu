// permute, CUDA: stable counting sort of routed pairs by expert, no host sync.
//
// Legend: T tokens, K top_k, P = T*K pairs (pair id p = t*K + k), E experts,
// B tiles of kTile consecutive pairs (one thread block each).
//
// 1. rank:    each block sorts its tile by the key (expert << 11 | local index),
//             which is unique, so the result is deterministic without relying on
//             sort stability; it writes the local rank of each pair among the
//             tile's pairs of the same expert, and counts_EB[e, b].
// 2. scan:    exclusive sum over counts_EB in (expert-major, tile-minor) order
//             gives base_EB[e, b] = first row of tile b's pairs of expert e.
// 3. offsets: tokens_per_expert_E and offsets_E (inclusive ends) from base/counts.
// 4. scatter: row = base_EB[e, b] + rank; pair_row_P[p] = row, row_pair_P[row] = p.
// Rows of expert e are therefore in increasing pair id, exactly as on the CPU.
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cub/block/block_radix_sort.cuh>
#include <cub/device/device_scan.cuh>

#include <tuple>

#include "permute.h"
#include "rows.cuh"

namespace lrmoe {
namespace {

constexpr int kThreads = 256;
constexpr int kItems = 8;
constexpr int kLogTile = 11;
constexpr int kTile = kThreads * kItems;  // 2048 = 1 << kLogTile
static_assert(kTile == (1 << kLogTile), "tile size must match its bit width");

template <typename index_t>
__global__ void __launch_bounds__(kThreads)
permute_rank_kernel(const index_t* __restrict__ ids_P, int64_t P, int64_t E, int num_tiles,
                    int end_bit, int32_t* __restrict__ rank_P, int32_t* __restrict__ counts_EB) {
  using Sort = cub::BlockRadixSort<uint32_t, kThreads, kItems>;
  __shared__ union {
    typename Sort::TempStorage sort;
    uint32_t expert[kTile];
  } smem;
  const int64_t tile_base = static_cast<int64_t>(blockIdx.x) * kTile;
  uint32_t keys[kItems];
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    const int local = threadIdx.x * kItems + j;
    const int64_t p = tile_base + local;
    uint32_t e = static_cast<uint32_t>(E);  // padding / invalid ids sort last
    if (p < P) {
      const int64_t v = static_cast<int64_t>(ids_P[p]);
      CUDA_KERNEL_ASSERT(v >= 0 && v < E && "expert_ids out of [0, num_experts)");
      if (v >= 0 && v < E) e = static_cast<uint32_t>(v);
    }
    keys[j] = (e << kLogTile) | static_cast<uint32_t>(local);
  }
  Sort(smem.sort).Sort(keys, 0, end_bit);  // blocked arrangement: position = tid*kItems + j
  __syncthreads();
#pragma unroll
  for (int j = 0; j < kItems; ++j) smem.expert[threadIdx.x * kItems + j] = keys[j] >> kLogTile;
  __syncthreads();
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    const int pos = threadIdx.x * kItems + j;
    const uint32_t e = keys[j] >> kLogTile;
    if (e >= static_cast<uint32_t>(E)) continue;
    int lo = 0, hi = pos;  // first position of expert e in the sorted tile
    while (lo < hi) {
      const int mid = (lo + hi) >> 1;
      if (smem.expert[mid] < e) lo = mid + 1; else hi = mid;
    }
    rank_P[tile_base + (keys[j] & (kTile - 1))] = pos - lo;
    if (pos == kTile - 1 || smem.expert[pos + 1] != e)
      counts_EB[static_cast<int64_t>(e) * num_tiles + blockIdx.x] = pos - lo + 1;
  }
}

__global__ void permute_offsets_kernel(const int32_t* __restrict__ counts_EB,
                                       const int32_t* __restrict__ base_EB, int64_t E,
                                       int num_tiles, int32_t* __restrict__ tokens_per_expert_E,
                                       int32_t* __restrict__ offsets_E) {
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < E;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t last = e * num_tiles + num_tiles - 1;
    const int32_t end = base_EB[last] + counts_EB[last];
    offsets_E[e] = end;
    tokens_per_expert_E[e] = end - base_EB[e * num_tiles];
  }
}

template <typename index_t>
__global__ void permute_scatter_kernel(const index_t* __restrict__ ids_P, int64_t P, int64_t E,
                                       int num_tiles, const int32_t* __restrict__ rank_P,
                                       const int32_t* __restrict__ base_EB,
                                       int32_t* __restrict__ row_pair_P,
                                       int32_t* __restrict__ pair_row_P) {
  for (int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; p < P;
       p += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t e = static_cast<int64_t>(ids_P[p]);
    if (e < 0 || e >= E) {  // already asserted in the rank kernel
      pair_row_P[p] = -1;
      continue;
    }
    const int32_t row = base_EB[e * num_tiles + (p >> kLogTile)] + rank_P[p];
    pair_row_P[p] = row;
    row_pair_P[row] = static_cast<int32_t>(p);
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> permute_cuda(
    const at::Tensor& expert_ids_TK, int64_t num_experts) {
  check_permute_args(expert_ids_TK, num_experts);
  const c10::cuda::CUDAGuard guard(expert_ids_TK.device());
  const at::Tensor ids_P = expert_ids_TK.contiguous();
  const int64_t P = ids_P.numel(), E = num_experts;
  const auto i32 = ids_P.options().dtype(at::kInt);
  at::Tensor row_pair_P = at::empty({P}, i32);
  at::Tensor pair_row_P = at::empty({P}, i32);
  if (P == 0) return {row_pair_P, pair_row_P, at::zeros({E}, i32), at::zeros({E}, i32)};
  at::Tensor tokens_per_expert_E = at::empty({E}, i32);
  at::Tensor offsets_E = at::empty({E}, i32);

  const int num_tiles = static_cast<int>((P + kTile - 1) / kTile);
  const int64_t EB = E * num_tiles;
  LRMOE_CHECK(EB < std::numeric_limits<int32_t>::max(), "permute: num_experts (", E,
              ") times tiles (", num_tiles, ") must be < 2**31; split the batch");
  int end_bit = kLogTile;  // bits for local index + bits for ids up to E (padding)
  for (int64_t v = E; v > 0; v >>= 1) ++end_bit;

  at::Tensor counts_EB = at::zeros({EB}, i32);
  at::Tensor base_EB = at::empty({EB}, i32);
  at::Tensor rank_P = at::empty({P}, i32);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  AT_DISPATCH_INDEX_TYPES(ids_P.scalar_type(), "lrmoe_permute_cuda", [&] {
    const index_t* ids = ids_P.const_data_ptr<index_t>();
    permute_rank_kernel<index_t><<<num_tiles, kThreads, 0, stream>>>(
        ids, P, E, num_tiles, end_bit, rank_P.data_ptr<int32_t>(), counts_EB.data_ptr<int32_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();

    cuda::with_cub_temp(ids_P, [&](void* tmp, size_t& bytes) {
      return cub::DeviceScan::ExclusiveSum(tmp, bytes, counts_EB.data_ptr<int32_t>(),
                                           base_EB.data_ptr<int32_t>(), static_cast<int>(EB),
                                           stream);
    });

    permute_offsets_kernel<<<cuda::grid_stride_blocks(E, 256), 256, 0, stream>>>(
        counts_EB.data_ptr<int32_t>(), base_EB.data_ptr<int32_t>(), E, num_tiles,
        tokens_per_expert_E.data_ptr<int32_t>(), offsets_E.data_ptr<int32_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();

    permute_scatter_kernel<index_t><<<cuda::grid_stride_blocks(P, 256), 256, 0, stream>>>(
        ids, P, E, num_tiles, rank_P.data_ptr<int32_t>(), base_EB.data_ptr<int32_t>(),
        row_pair_P.data_ptr<int32_t>(), pair_row_P.data_ptr<int32_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {row_pair_P, pair_row_P, tokens_per_expert_E, offsets_E};
}

}  // namespace

TORCH_LIBRARY_IMPL(lrmoe, CUDA, m) { m.impl("permute", &permute_cuda); }

}  // namespace lrmoe
