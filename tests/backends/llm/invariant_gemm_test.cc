// InvariantGemm: the product, and a row's bits whatever the rows around it,
// their number and the thread count, on shapes whose rows and outputs end in partial register
// tiles and whose sums end in partial lanes (in = 136, 600, 777, 1000).
#include "backends/llm/invariant_gemm.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

namespace hearth::llm {
namespace {

std::vector<float> Random(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& f : v) f = d(rng);
  return v;
}

TEST(InvariantGemm, ComputesTheProduct) {
  // Against double sums: within float rounding of sums of `in` terms.
  // On one thread and on three (the two larger products are split).
  for (const auto& [rows, out, in] :
       {std::tuple{3, 40, 30}, {70, 777, 777}, {1, 2000, 600}, {5, 2001, 600}}) {
    const std::vector<float> x = Random(size_t(rows) * in, 1), w = Random(size_t(out) * in, 2);
    const std::vector<float> y0 = Random(size_t(rows) * out, 3);
    for (const auto& [accumulate, threads] :
         {std::pair{false, 1}, {true, 1}, {false, 3}, {true, 3}}) {
      std::vector<float> y = y0;
      const InvariantGemm gemm(threads);
      gemm.Run(rows, out, in, x.data(), w.data(), y.data(), accumulate);
      for (int r = 0; r < rows; ++r) {
        for (int o = 0; o < out; ++o) {
          double want = accumulate ? y0[size_t(r) * out + o] : 0.0;
          for (int k = 0; k < in; ++k) {
            want += double(x[size_t(r) * in + k]) * w[size_t(o) * in + k];
          }
          ASSERT_NEAR(y[size_t(r) * out + o], want, 1e-6 * in)
              << rows << "x" << out << "x" << in << " accumulate " << accumulate << " on "
              << threads << " threads at " << r << ", " << o;
        }
      }
    }
  }
}

TEST(InvariantGemm, ARowsBitsAreItsOwn) {
  // One row (x0, with y0 when accumulating) among `rows` others, at its
  // first, middle and last place, on 1 to 3 threads (products of at least
  // kParallelMacs split by outputs): the bits it gets alone on one.
  struct Shape {
    int out, in;
  };
  for (const Shape s : {Shape{32, 32}, Shape{48, 32}, Shape{64, 48}, Shape{68, 136},
                        Shape{136, 600}, Shape{2000, 136}, Shape{777, 777}, Shape{1000, 1000}}) {
    const int most = 100;
    const std::vector<float> w = Random(size_t(s.out) * s.in, 4);
    const std::vector<float> xs = Random(size_t(most) * s.in, 5);
    const std::vector<float> ys = Random(size_t(most) * s.out, 6);
    for (bool accumulate : {false, true}) {
      std::vector<float> alone(ys.begin(), ys.begin() + s.out);
      {
        const InvariantGemm gemm(1);
        gemm.Run(1, s.out, s.in, xs.data(), w.data(), alone.data(), accumulate);
      }
      for (int threads : {1, 2, 3}) {
        const InvariantGemm gemm(threads);
        for (int rows : {1, 2, 5, 17, 19, 38, 64, 100}) {
          for (int place : {0, rows / 2, rows - 1}) {
            // Row `place` holds x0 (and y0); the others rows 1... of xs, rotated by place.
            std::vector<float> x(size_t(rows) * s.in), y(size_t(rows) * s.out);
            for (int r = 0; r < rows; ++r) {
              const int from = r == place ? 0 : 1 + (r + place) % (most - 1);
              std::memcpy(&x[size_t(r) * s.in], &xs[size_t(from) * s.in], s.in * sizeof(float));
              std::memcpy(&y[size_t(r) * s.out], &ys[size_t(from) * s.out], s.out * sizeof(float));
            }
            gemm.Run(rows, s.out, s.in, x.data(), w.data(), y.data(), accumulate);
            ASSERT_EQ(std::memcmp(&y[size_t(place) * s.out], alone.data(), s.out * sizeof(float)),
                      0)
                << s.out << "x" << s.in << (accumulate ? " accumulating" : "") << ": row " << place
                << " of " << rows << " on " << threads << " threads";
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace hearth::llm
