// select, CUDA: fill each expert's quota with its best rows and compact them,
// without a host sync (every size is known from P, E and num_retained).
//
// Legend: P rows (expert-sorted order), E experts, R retained rows, n_e / Q_e
// rows / quota of expert e, score_P, row_pair_P (pair id of each row),
// offsets_E (inclusive ends), kept_* (R) the compacted buffers, pair_kept_P.
//
// Pipeline (both selections):
//   1. qc_E = quota clamped to [0, n_e]; kept_offsets_E = inclusive scan (cub).
//   2. key_P = (expert << 32) | score_order_key(score) -- one stable radix sort
//      (cub) ranks each expert's rows by (score desc, row asc), NaN last, and
//      keeps experts contiguous, so sorted position j of expert e has rank
//      j - start_e.
// topk:       3. keep_P[row] = rank < Q_e; 4. exclusive scan of keep_P (in row
//             order) is each kept row's slot, ascending within and across experts.
// importance: 3. one warp per expert: water-filling over its sorted weights,
//             p_P in row order, canonical prefix sums C_P (core/selection.h);
//             4. one thread per kept slot k: systematic point u_e + k found by
//             binary search in C_P; 5. a max-scan over slots repairs rounding
//             glitches so exactly Q_e distinct rows are kept.
// R == P (c = 0: every quota is its expert's load): every row is kept, in row
// order, with scale 1 -- what both pipelines produce then -- written by one
// pass (keep_all_kernel) instead of the sort and the scans.
// Then retained_mass: per-block partial sums over a fixed grid-stride split
// (the grid depends on P and R only), then one block over the partials --
// a fixed reduction tree in double, spread over the GPU.
//
// Scores: NaN ranks below every number for topk and weighs 0 for importance,
// as do negatives; +inf weighs FLT_MAX; retained_mass propagates NaN.
// Integer scans and the sort are exact; all float sums run in a fixed order:
// results are deterministic and equal to the CPU kernel's. Inconsistent inputs
// (sum(quota) != num_retained, bad offsets), which only the CPU path can
// detect, give no out-of-bounds access: unfilled slots hold row 0 and scale 1.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cub/block/block_reduce.cuh>
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>

#include <climits>
#include <cstdint>

#include "core/random.h"
#include "core/selection.h"
#include "ops/common.h"
#include "ops/rows.cuh"
#include "ops/select.h"

namespace lrmoe {
namespace {

using namespace lrmoe::cuda;

constexpr unsigned kFullMask = 0xffffffffu;

// Rows [start, start + n) of expert e, clamped into [0, P] so bad offsets
// cannot send a kernel out of bounds.
__device__ __forceinline__ void expert_range(const int32_t* offsets_E, int64_t e, int64_t P,
                                             int64_t& start, int64_t& n) {
  int64_t s = e ? offsets_E[e - 1] : 0, end = offsets_E[e];
  s = s < 0 ? 0 : (s > P ? P : s);
  end = end < s ? s : (end > P ? P : end);
  start = s;
  n = end - s;
}

// First e with ends_E[e] > x (E if none): the expert owning row / slot x.
__device__ __forceinline__ int64_t owner(const int32_t* ends_E, int64_t E, int64_t x) {
  return core::first_above(ends_E, E, x);
}

__global__ void clamp_quota_kernel(const int32_t* __restrict__ offsets_E,
                                   const int32_t* __restrict__ quota_E, int64_t E, int64_t P,
                                   int32_t* __restrict__ qc_E) {
  const int64_t e = thread_index();
  if (e >= E) return;
  int64_t start, n;
  expert_range(offsets_E, e, P, start, n);
  const int64_t q = quota_E[e];
  qc_E[e] = static_cast<int32_t>(q < 0 ? 0 : (q > n ? n : q));
}

__global__ void sort_keys_kernel(const float* __restrict__ score_P,
                                 const int32_t* __restrict__ offsets_E, int64_t E, int64_t P,
                                 uint64_t* __restrict__ key_P, int32_t* __restrict__ row_P) {
  const int64_t r = thread_index();
  if (r >= P) return;
  const uint64_t e = static_cast<uint64_t>(owner(offsets_E, E, r));
  key_P[r] = (e << 32) | core::score_order_key(score_P[r]);
  row_P[r] = static_cast<int32_t>(r);
}

// ---------------------------------------------------------------- topk
__global__ void topk_flags_kernel(const uint64_t* __restrict__ sorted_key_P,
                                  const int32_t* __restrict__ sorted_row_P,
                                  const int32_t* __restrict__ offsets_E,
                                  const int32_t* __restrict__ qc_E, int64_t E, int64_t P,
                                  int32_t* __restrict__ keep_P) {
  const int64_t j = thread_index();
  if (j >= P) return;
  const int64_t e = static_cast<int64_t>(sorted_key_P[j] >> 32);
  int32_t flag = 0;
  if (e < E) {
    int64_t start, n;
    expert_range(offsets_E, e, P, start, n);
    const int64_t rank = j - start;
    flag = rank >= 0 && rank < qc_E[e];
  }
  keep_P[sorted_row_P[j]] = flag;
}

__global__ void topk_write_kernel(const int32_t* __restrict__ keep_P,
                                  const int32_t* __restrict__ slot_P,
                                  const int32_t* __restrict__ row_pair_P, int64_t P, int64_t R,
                                  int32_t* __restrict__ kept_rows_R,
                                  int32_t* __restrict__ kept_pair_R,
                                  int32_t* __restrict__ pair_kept_P) {
  const int64_t r = thread_index();
  if (r >= P || !keep_P[r]) return;
  const int64_t slot = slot_P[r];
  if (slot >= R) return;
  const int32_t pair = row_pair_P[r];
  kept_rows_R[slot] = static_cast<int32_t>(r);
  kept_pair_R[slot] = pair;
  if (pair >= 0 && pair < P) pair_kept_P[pair] = static_cast<int32_t>(slot);
}

// ---------------------------------------------------------------- importance
__device__ __forceinline__ int64_t warp_min(int64_t v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const int64_t other = __shfl_xor_sync(kFullMask, v, o);
    v = other < v ? other : v;
  }
  return v;
}

// base_l = ((0 + t_0) + t_1) + ... + t_{l-1}: the canonical chunk base.
__device__ __forceinline__ double chunk_base(double total, int lane) {
  double base = 0.0;
#pragma unroll
  for (int l = 0; l < core::kScanLanes; ++l) {
    const double t = __shfl_sync(kFullMask, total, l);
    if (l < lane) base += t;
  }
  return base;
}

// One warp per expert (lane l owns canonical chunk l). p_P and C_P are
// written by some lanes and read by others after __syncwarp: no __restrict__.
__global__ void importance_probs_kernel(const float* __restrict__ score_P,
                                        const int32_t* __restrict__ sorted_row_P,
                                        const int32_t* __restrict__ offsets_E,
                                        const int32_t* __restrict__ qc_E, int64_t E, int64_t P,
                                        double* p_P, double* C_P) {
  const int64_t e = thread_index() / kWarp;
  const int lane = threadIdx.x & 31;
  if (e >= E) return;  // warp-uniform
  int64_t start, n;
  expert_range(offsets_E, e, P, start, n);
  const int64_t Q = qc_E[e];
  if (n == 0 || Q == 0) return;  // no slot of this expert reads p or C
  const int32_t* srow = sorted_row_P + start;
  auto w = [&](int64_t j) { return core::importance_weight(score_P[srow[j]]); };

  int cnt = 0;
  for (int64_t j = lane; j < n; j += 32) cnt += w(j) > 0.0;
  const int64_t npos = warp_sum(cnt);

  const int64_t cl = core::scan_chunk_len(n);
  const int64_t lo = min(n, lane * cl), hi = min(n, lo + cl);
  core::ImportancePlan plan = core::zero_weight_plan(n, npos, Q);
  if (npos > Q) {
    double total = 0.0;
    for (int64_t i = lo; i < hi; ++i) total += w(n - 1 - i);
    const double base = chunk_base(total, lane);
    int64_t cand = INT64_MAX;
    double cand_T = 0.0, local = 0.0;
    for (int64_t i = lo; i < hi; ++i) {  // m = n - 1 - i descends
      const double x = w(n - 1 - i);
      local += x;
      const double T = base + local;
      const int64_t m = n - 1 - i;
      if (m < Q && (m == Q - 1 || core::water_level_feasible(x, m, Q, T))) { cand = m; cand_T = T; }
    }
    const int64_t m_star = warp_min(cand);
    const unsigned owner_mask = __ballot_sync(kFullMask, cand == m_star);
    cand_T = __shfl_sync(kFullMask, cand_T, __ffs(owner_mask) - 1);
    plan = core::water_plan(m_star, Q, cand_T);
  }
  for (int64_t j = lane; j < n; j += 32)
    p_P[srow[j]] = core::inclusion_probability(plan, j, w(j));
  __syncwarp();

  double total = 0.0;
  for (int64_t i = lo; i < hi; ++i) total += p_P[start + i];
  const double base = chunk_base(total, lane);
  double local = 0.0;
  for (int64_t i = lo; i < hi; ++i) {
    local += p_P[start + i];
    C_P[start + i] = base + local;
  }
}

// Slot s of expert e (k = s - kept_start_e): (e << 32) | (d_k + 2^31), so one
// global max-scan gives the per-expert prefix maximum of d_k.
__global__ void importance_points_kernel(const double* __restrict__ C_P,
                                         const int32_t* __restrict__ offsets_E,
                                         const int32_t* __restrict__ kept_offsets_E,
                                         int64_t E, int64_t P, int64_t R, uint64_t seed,
                                         uint64_t* __restrict__ point_R) {
  const int64_t s = thread_index();
  if (s >= R) return;
  const int64_t e = owner(kept_offsets_E, E, s);
  if (e >= E) { point_R[s] = (static_cast<uint64_t>(E) << 32) | 0x80000000ull; return; }
  const int64_t k = s - (e ? kept_offsets_E[e - 1] : 0);
  int64_t start, n;
  expert_range(offsets_E, e, P, start, n);
  const double u = core::uniform01(seed, core::kImportanceStream, static_cast<uint64_t>(e));
  const int64_t d = core::sample_point(C_P + start, n, u, k);
  point_R[s] = (static_cast<uint64_t>(e) << 32) | static_cast<uint64_t>(d + (int64_t(1) << 31));
}

struct MaxOp {
  __device__ __forceinline__ uint64_t operator()(uint64_t a, uint64_t b) const { return a > b ? a : b; }
};

__global__ void importance_write_kernel(const uint64_t* __restrict__ point_max_R,
                                        const double* __restrict__ p_P,
                                        const int32_t* __restrict__ offsets_E,
                                        const int32_t* __restrict__ kept_offsets_E,
                                        const int32_t* __restrict__ qc_E,
                                        const int32_t* __restrict__ row_pair_P, int64_t E,
                                        int64_t P, int64_t R, int32_t* __restrict__ kept_rows_R,
                                        int32_t* __restrict__ kept_pair_R,
                                        int32_t* __restrict__ pair_kept_P,
                                        float* __restrict__ kept_scale_R) {
  const int64_t s = thread_index();
  if (s >= R) return;
  const int64_t e = owner(kept_offsets_E, E, s);
  if (e >= E) return;  // inconsistent quota sum: slot stays row 0, scale 1
  const int64_t k = s - (e ? kept_offsets_E[e - 1] : 0);
  int64_t start, n;
  expert_range(offsets_E, e, P, start, n);
  const int64_t d_max = static_cast<int64_t>(point_max_R[s] & 0xffffffffull) - (int64_t(1) << 31);
  const int64_t row = start + core::sample_row(d_max, n, qc_E[e], k);
  const int32_t pair = row_pair_P[row];
  kept_rows_R[s] = static_cast<int32_t>(row);
  kept_pair_R[s] = pair;
  kept_scale_R[s] = core::inverse_probability(p_P[row]);
  if (pair >= 0 && pair < P) pair_kept_P[pair] = static_cast<int32_t>(s);
}

// ---------------------------------------------------------------- keep all (R == P)
__global__ void keep_all_kernel(const int32_t* __restrict__ row_pair_P, int64_t P,
                                int32_t* __restrict__ kept_rows_R,
                                int32_t* __restrict__ kept_pair_R,
                                int32_t* __restrict__ pair_kept_P) {
  const int64_t r = thread_index();
  if (r >= P) return;
  const int32_t pair = row_pair_P[r];
  kept_rows_R[r] = static_cast<int32_t>(r);
  kept_pair_R[r] = pair;
  if (pair >= 0 && pair < P) pair_kept_P[pair] = static_cast<int32_t>(r);
}

// ---------------------------------------------------------------- retained mass
// One block of 1024 threads read P scores and R gathered ones at the latency of
// one SM (tens of us at P = 262144); kMassBlocks blocks of partial sums instead.
constexpr int kMassThreads = 256;
constexpr int kMassBlocks = 256;  // the final block reduces one partial per thread
constexpr int64_t kMassPerThread = 8;

// Blocks of the partial pass: enough for ~kMassPerThread items per thread.
inline int mass_blocks(int64_t P, int64_t R) {
  const int64_t n = P > R ? P : R;
  const int64_t b = (n + kMassThreads * kMassPerThread - 1) / (kMassThreads * kMassPerThread);
  return static_cast<int>(b < 1 ? 1 : (b > kMassBlocks ? kMassBlocks : b));
}

__global__ void __launch_bounds__(kMassThreads)
retained_mass_partial_kernel(const float* __restrict__ score_P, int64_t P,
                             const int32_t* __restrict__ kept_rows_R, int64_t R,
                             double* __restrict__ partial_2B) {
  using Reduce = cub::BlockReduce<double, kMassThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kMassThreads;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kMassThreads + threadIdx.x;
  double total = 0.0, kept = 0.0;
  for (int64_t r = first; r < P; r += stride) total += score_P[r];
  for (int64_t s = first; s < R; s += stride) {
    const int32_t row = kept_rows_R[s];
    if (row >= 0 && row < P) kept += score_P[row];
  }
  total = Reduce(tmp).Sum(total);
  __syncthreads();
  kept = Reduce(tmp).Sum(kept);
  if (threadIdx.x == 0) {
    partial_2B[blockIdx.x] = total;
    partial_2B[gridDim.x + blockIdx.x] = kept;
  }
}

__global__ void __launch_bounds__(kMassThreads)
retained_mass_final_kernel(const double* __restrict__ partial_2B, int blocks,
                           float* __restrict__ mass) {
  using Reduce = cub::BlockReduce<double, kMassThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  const int b = threadIdx.x;
  double total = b < blocks ? partial_2B[b] : 0.0;
  double kept = b < blocks ? partial_2B[blocks + b] : 0.0;
  total = Reduce(tmp).Sum(total);
  __syncthreads();
  kept = Reduce(tmp).Sum(kept);
  if (threadIdx.x == 0) *mass = total == 0.0 ? 1.0f : static_cast<float>(kept / total);
}

// ---------------------------------------------------------------- host side
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> select_cuda(
    const at::Tensor& score, const at::Tensor& row_pair, const at::Tensor& offsets,
    const at::Tensor& quota, int64_t num_retained, c10::string_view selection_name, int64_t seed) {
  const Selection selection = parse_selection(std::string(selection_name));
  check_select_args(score, row_pair, offsets, quota, num_retained);
  const c10::cuda::CUDAGuard guard(score.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const at::Tensor score_P = score.contiguous(), row_pair_P = row_pair.contiguous();
  const at::Tensor offsets_E = offsets.contiguous(), quota_E = quota.contiguous();
  const int64_t P = score_P.size(0), E = offsets_E.size(0), R = num_retained;
  const auto i32 = row_pair_P.options();

  at::Tensor kept_rows = at::zeros({R}, i32), kept_pair = at::zeros({R}, i32);
  at::Tensor pair_kept = at::full({P}, -1, i32), kept_offsets = at::empty({E}, i32);
  at::Tensor kept_scale = at::ones({R}, score_P.options());
  at::Tensor retained_mass = at::empty({}, score_P.options());
  const int T = 256;
  if (E > 0) {
    at::Tensor qc_E = at::empty({E}, i32);
    clamp_quota_kernel<<<blocks_for(E, T), T, 0, stream>>>(offsets_E.data_ptr<int32_t>(),
                                                           quota_E.data_ptr<int32_t>(), E, P,
                                                           qc_E.data_ptr<int32_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const int32_t* qc = qc_E.data_ptr<int32_t>();
    int32_t* ko = kept_offsets.data_ptr<int32_t>();
    with_cub_temp(score_P, [&](void* tmp, size_t& bytes) {
      return cub::DeviceScan::InclusiveSum(tmp, bytes, qc, ko, static_cast<int>(E), stream);
    });

    if (P > 0 && R == P) {
      keep_all_kernel<<<blocks_for(P, T), T, 0, stream>>>(
          row_pair_P.data_ptr<int32_t>(), P, kept_rows.data_ptr<int32_t>(),
          kept_pair.data_ptr<int32_t>(), pair_kept.data_ptr<int32_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    } else if (P > 0) {
      at::Tensor key_P = at::empty({P}, score_P.options().dtype(at::kLong));
      at::Tensor sorted_key_P = at::empty({P}, key_P.options());
      at::Tensor row_P = at::empty({P}, i32), sorted_row_P = at::empty({P}, i32);
      auto* key = reinterpret_cast<uint64_t*>(key_P.data_ptr<int64_t>());
      auto* sorted_key = reinterpret_cast<uint64_t*>(sorted_key_P.data_ptr<int64_t>());
      sort_keys_kernel<<<blocks_for(P, T), T, 0, stream>>>(score_P.data_ptr<float>(),
                                                           offsets_E.data_ptr<int32_t>(), E, P,
                                                           key, row_P.data_ptr<int32_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      int expert_bits = 0;  // enough for ids 0..E (E = rows past the last offset)
      while ((int64_t(1) << expert_bits) <= E) ++expert_bits;
      const int32_t* row_in = row_P.data_ptr<int32_t>();
      int32_t* sorted_row = sorted_row_P.data_ptr<int32_t>();
      with_cub_temp(score_P, [&](void* tmp, size_t& bytes) {
        return cub::DeviceRadixSort::SortPairs(tmp, bytes, key, sorted_key, row_in, sorted_row,
                                               static_cast<int>(P), 0, 32 + expert_bits, stream);
      });

      if (selection == Selection::kTopk) {
        at::Tensor keep_P = at::empty({P}, i32), slot_P = at::empty({P}, i32);
        topk_flags_kernel<<<blocks_for(P, T), T, 0, stream>>>(
            sorted_key, sorted_row, offsets_E.data_ptr<int32_t>(), qc, E, P,
            keep_P.data_ptr<int32_t>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        const int32_t* keep = keep_P.data_ptr<int32_t>();
        int32_t* slot = slot_P.data_ptr<int32_t>();
        with_cub_temp(score_P, [&](void* tmp, size_t& bytes) {
          return cub::DeviceScan::ExclusiveSum(tmp, bytes, keep, slot, static_cast<int>(P), stream);
        });
        topk_write_kernel<<<blocks_for(P, T), T, 0, stream>>>(
            keep, slot, row_pair_P.data_ptr<int32_t>(), P, R, kept_rows.data_ptr<int32_t>(),
            kept_pair.data_ptr<int32_t>(), pair_kept.data_ptr<int32_t>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      } else if (R > 0) {
        at::Tensor p_P = at::empty({P}, score_P.options().dtype(at::kDouble));
        at::Tensor C_P = at::empty({P}, p_P.options());
        const int warps_per_block = 4;
        importance_probs_kernel<<<blocks_for(E, warps_per_block), warps_per_block * 32, 0, stream>>>(
            score_P.data_ptr<float>(), sorted_row, offsets_E.data_ptr<int32_t>(), qc, E, P,
            p_P.data_ptr<double>(), C_P.data_ptr<double>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        at::Tensor point_R = at::empty({R}, key_P.options()), point_max_R = at::empty({R}, key_P.options());
        auto* point = reinterpret_cast<uint64_t*>(point_R.data_ptr<int64_t>());
        auto* point_max = reinterpret_cast<uint64_t*>(point_max_R.data_ptr<int64_t>());
        importance_points_kernel<<<blocks_for(R, T), T, 0, stream>>>(
            C_P.data_ptr<double>(), offsets_E.data_ptr<int32_t>(), ko, E, P, R,
            static_cast<uint64_t>(seed), point);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        with_cub_temp(score_P, [&](void* tmp, size_t& bytes) {
          return cub::DeviceScan::InclusiveScan(tmp, bytes, point, point_max, MaxOp{},
                                                static_cast<int>(R), stream);
        });
        importance_write_kernel<<<blocks_for(R, T), T, 0, stream>>>(
            point_max, p_P.data_ptr<double>(), offsets_E.data_ptr<int32_t>(), ko, qc,
            row_pair_P.data_ptr<int32_t>(), E, P, R, kept_rows.data_ptr<int32_t>(),
            kept_pair.data_ptr<int32_t>(), pair_kept.data_ptr<int32_t>(),
            kept_scale.data_ptr<float>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
    }
  }
  const int mass_grid = mass_blocks(P, R);
  at::Tensor partial_2B = at::empty({2 * mass_grid}, score_P.options().dtype(at::kDouble));
  retained_mass_partial_kernel<<<mass_grid, kMassThreads, 0, stream>>>(
      score_P.data_ptr<float>(), P, kept_rows.data_ptr<int32_t>(), R,
      partial_2B.data_ptr<double>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  retained_mass_final_kernel<<<1, kMassThreads, 0, stream>>>(
      partial_2B.data_ptr<double>(), mass_grid, retained_mass.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {kept_rows, kept_pair, pair_kept, kept_offsets, kept_scale, retained_mass};
}

}  // namespace

TORCH_LIBRARY_IMPL(lrmoe, CUDA, m) { m.impl("select", &select_cuda); }

}  // namespace lrmoe
