// Device helpers shared by the row-movement CUDA kernels: 16-byte vectors,
// warp reductions, launch geometry. Included only from .cu files.
#pragma once

#include <c10/macros/Macros.h>

#include <cstdint>
#include <initializer_list>

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

// Fixed butterfly: the same lanes combine in the same order every run.
template <typename T>
__device__ __forceinline__ T warp_sum(T x) {
#pragma unroll
  for (int off = kWarp / 2; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

inline unsigned row_blocks(int64_t rows) {
  int64_t b = (rows + kRowWarps - 1) / kRowWarps;
  if (b > kMaxRowBlocks) b = kMaxRowBlocks;
  return static_cast<unsigned>(b < 1 ? 1 : b);
}

}  // namespace cuda
}  // namespace lrmoe
