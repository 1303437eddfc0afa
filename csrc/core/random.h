// Counter-based uniform numbers shared by the CPU and CUDA paths, so the
// `random` metric and `importance` selection draw identical values on both.
// splitmix64 (Steele, Lea, Flood, "Fast splittable pseudorandom number
// generators", OOPSLA 2014), keyed by (seed, stream, index).
#pragma once

#include <cstdint>

#include "quota.h"  // LRMOE_HD

namespace lrmoe {
namespace core {

LRMOE_HD inline uint64_t splitmix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Streams keep the random metric and the importance offsets independent.
enum RandomStream : uint64_t { kScoreStream = 1, kImportanceStream = 2 };

// Uniform in [0, 1) with 24 random bits (exact in fp32).
LRMOE_HD inline float uniform01(uint64_t seed, uint64_t stream, uint64_t index) {
  const uint64_t h = splitmix64(splitmix64(seed ^ (stream << 56)) ^ index);
  return static_cast<float>(h >> 40) * (1.0f / 16777216.0f);
}

}  // namespace core
}  // namespace lrmoe
