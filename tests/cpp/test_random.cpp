// GoogleTests for csrc/core/random.h (counter-based uniform01 on splitmix64).
//
// Known values: Vigna's splitmix64.c test vector, and outputs of an independent
// Python big-integer implementation (pasted below). Statistical checks use fixed
// seeds, so they are deterministic; their bounds are stated with the
// probability that a true uniform source would fail them.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "core/random.h"

namespace {

using lrmoe::core::kImportanceStream;
using lrmoe::core::kScoreStream;
using lrmoe::core::splitmix64;
using lrmoe::core::uniform01;

TEST(Splitmix64, PublishedVector) {
  // splitmix64.c (Vigna) seeded with x = 1234567: the first next() is
  // 6457827717110365317; our splitmix64(z) is that step applied to state z.
  EXPECT_EQ(splitmix64(1234567ull), 6457827717110365317ull);
  EXPECT_EQ(splitmix64(0ull), 16294208416658607535ull);  // Python big-int reference
}

TEST(Uniform01, MatchesIndependentPythonReference) {
  // h = sm(sm(seed ^ (stream << 56)) ^ index); u = (h >> 40) / 2^24, in Python ints.
  struct Row { uint64_t seed, stream, index; uint32_t u24; };
  const Row rows[] = {
      {0, 1, 0, 5876826},
      {0, 1, 1, 5254746},
      {42, 2, 7, 15895576},
      {12345, 1, 1000000, 11505746},
      {~0ull, 2, 1ull << 40, 12554451},
  };
  for (const Row& r : rows)
    EXPECT_EQ(uniform01(r.seed, r.stream, r.index), static_cast<float>(r.u24) / 16777216.0f)
        << r.seed << "," << r.stream << "," << r.index;
}

TEST(Uniform01, InHalfOpenUnitIntervalOn24BitGrid) {
  const uint64_t edge[] = {0, 1, 2, (1ull << 32) - 1, 1ull << 63, ~0ull};
  for (uint64_t seed : edge) {
    for (uint64_t index : edge) {
      const float u = uniform01(seed, kScoreStream, index);
      EXPECT_GE(u, 0.0f);
      EXPECT_LT(u, 1.0f);
    }
  }
  for (uint64_t i = 0; i < 1000000; ++i) {
    const float u = uniform01(7, kImportanceStream, i);
    ASSERT_GE(u, 0.0f) << i;
    ASSERT_LT(u, 1.0f) << i;
    const float scaled = u * 16777216.0f;  // exact: u has 24 random bits
    ASSERT_EQ(scaled, std::floor(scaled)) << i;
  }
}

TEST(Uniform01, Deterministic) {
  for (uint64_t i = 0; i < 1000; ++i) {
    const float a = uniform01(123, kScoreStream, i * 7919);
    const float b = uniform01(123, kScoreStream, i * 7919);
    ASSERT_EQ(a, b);
  }
}

TEST(Uniform01, SeedsStreamsAndIndicesDiffer) {
  // Equal 24-bit values by chance: 2^-24 per index, so ~2.4e-4 expected over
  // 4096 indices; more than 2 would be a failure of independence.
  int same_seed = 0, same_stream = 0, same_neighbour = 0;
  for (uint64_t i = 0; i < 4096; ++i) {
    same_seed += uniform01(0, kScoreStream, i) == uniform01(1, kScoreStream, i);
    same_stream += uniform01(5, kScoreStream, i) == uniform01(5, kImportanceStream, i);
    same_neighbour += uniform01(5, kScoreStream, i) == uniform01(5, kScoreStream, i + 1);
  }
  EXPECT_LE(same_seed, 2);
  EXPECT_LE(same_stream, 2);
  EXPECT_LE(same_neighbour, 2);
}

struct Stream {
  uint64_t seed, stream;
};

const Stream kStreams[] = {{0, kScoreStream}, {42, kImportanceStream}, {(1ull << 63) + 5, kScoreStream}};

TEST(Uniform01, MeanNearHalf) {
  // n = 1e5 draws of U[0,1): the mean has sd sqrt(1/12 / n) = 9.13e-4; the bound
  // 0.0046 is 5 sd (false failure ~6e-7).
  const int n = 100000;
  for (const Stream& s : kStreams) {
    double total = 0.0;
    for (int i = 0; i < n; ++i) total += uniform01(s.seed, s.stream, i);
    EXPECT_NEAR(total / n, 0.5, 0.0046) << "seed " << s.seed;
  }
}

TEST(Uniform01, ChiSquareOverHundredBuckets) {
  // 1e5 draws into 100 equal buckets, 1000 expected each; chi^2 has 99 degrees of
  // freedom (mean 99, sd 14.1). Wilson-Hilferty: P(chi^2 > 160) ~ 1e-4 and
  // P(chi^2 < 50) ~ 1e-5. The lower bound catches sequences that are too even
  // (e.g. an index / n counter instead of a hash).
  const int n = 100000, buckets = 100;
  for (const Stream& s : kStreams) {
    std::vector<int> count(buckets, 0);
    for (int i = 0; i < n; ++i) {
      const int b = static_cast<int>(uniform01(s.seed, s.stream, i) * buckets);
      ASSERT_GE(b, 0);
      ASSERT_LT(b, buckets);
      ++count[b];
    }
    const double expected = static_cast<double>(n) / buckets;
    double chi2 = 0.0;
    for (int c : count) chi2 += (c - expected) * (c - expected) / expected;
    EXPECT_LT(chi2, 160.0) << "seed " << s.seed;
    EXPECT_GT(chi2, 50.0) << "seed " << s.seed;
  }
}

TEST(Uniform01, NeighbouringIndicesUncorrelated) {
  // Lag-1 correlation of 1e5 draws: sd 1/sqrt(n) = 3.2e-3; bound 5 sd.
  const int n = 100000;
  std::vector<double> u(n);
  for (int i = 0; i < n; ++i) u[i] = uniform01(9, kScoreStream, i);
  double mean = 0.0;
  for (double v : u) mean += v;
  mean /= n;
  double cov = 0.0, var = 0.0;
  for (int i = 0; i < n; ++i) {
    var += (u[i] - mean) * (u[i] - mean);
    if (i + 1 < n) cov += (u[i] - mean) * (u[i + 1] - mean);
  }
  EXPECT_LT(std::fabs(cov / var), 5.0 / std::sqrt(static_cast<double>(n)));
}

}  // namespace
