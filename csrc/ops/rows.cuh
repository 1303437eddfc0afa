// Helpers shared by the CUDA ops: 16-byte vectors, warp reductions, launch
// geometry and checks, cub temporary storage. Included only from .cu files.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/macros/Macros.h>

#include <cstdint>
#include <initializer_list>
#include <type_traits>

namespace lrmoe {
namespace cuda {

constexpr int kWarp = 32;
constexpr int kRowThreads = 256;               // 8 warps per block, one warp per row
constexpr int kRowWarps = kRowThreads / kWarp;
constexpr int64_t kMaxRowBlocks = 1 << 20;     // grid-stride beyond this

// VEC scalars moved as one aligned load/store (16 bytes when VEC = 16 / sizeof(T)).
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Vec {
  T v[VEC];
};

// Elements per 16-byte vector when every row of width `cols` starting at each
// pointer stays 16-byte aligned; 1 (scalar path) otherwise.
template <typename T>
inline int vec_width(int64_t cols, std::initializer_list<const void*> ptrs) {
  constexpr int kVec = 16 / sizeof(T);
  if (cols % kVec != 0) return 1;
  for (const void* p : ptrs)
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return 1;
  return kVec;
}

// Calls launch(std::integral_constant<int, VEC>{}) with the widest VEC that
// vec_width allows (only two instantiations per kernel), then checks the launch.
template <typename T, typename Launch>
inline void launch_vectorized(int64_t cols, std::initializer_list<const void*> ptrs,
                              Launch&& launch) {
  constexpr int kVec = 16 / sizeof(T);
  if (vec_width<T>(cols, ptrs) == kVec) {
    launch(std::integral_constant<int, kVec>{});
  } else {
    launch(std::integral_constant<int, 1>{});
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// cub's two-phase calls, call(temp, bytes) -> cudaError_t, with temporary
// storage from the caching allocator on the device of `like`.
template <typename F>
inline void with_cub_temp(const at::Tensor& like, F&& call) {
  size_t bytes = 0;
  C10_CUDA_CHECK(call(nullptr, bytes));
  at::Tensor tmp = at::empty({static_cast<int64_t>(bytes)}, like.options().dtype(at::kByte));
  C10_CUDA_CHECK(call(tmp.data_ptr(), bytes));
}

// Fixed butterfly: the same lanes combine in the same order every run.
template <typename T>
__device__ __forceinline__ T warp_sum(T x) {
#pragma unroll
  for (int off = kWarp / 2; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

// Blocks of `per_block` items that cover n (at least one), for one-item-per-thread kernels.
inline unsigned blocks_for(int64_t n, int64_t per_block) {
  const int64_t b = (n + per_block - 1) / per_block;
  return static_cast<unsigned>(b < 1 ? 1 : b);
}

// The same, capped at kMaxRowBlocks: only for grid-stride kernels.
inline unsigned grid_stride_blocks(int64_t n, int64_t per_block) {
  const unsigned b = blocks_for(n, per_block);
  return b > kMaxRowBlocks ? static_cast<unsigned>(kMaxRowBlocks) : b;
}

// One warp per row, grid-stride: for (int64_t r = warp_row(); r < rows; r += warp_row_stride()).
inline unsigned row_blocks(int64_t rows) { return grid_stride_blocks(rows, kRowWarps); }

__device__ __forceinline__ int64_t warp_row() {
  return static_cast<int64_t>(blockIdx.x) * kRowWarps + threadIdx.x / kWarp;
}

__device__ __forceinline__ int64_t warp_row_stride() {
  return static_cast<int64_t>(gridDim.x) * kRowWarps;
}

// Global thread index of a one-item-per-thread launch.
__device__ __forceinline__ int64_t thread_index() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}

}  // namespace cuda
}  // namespace lrmoe
