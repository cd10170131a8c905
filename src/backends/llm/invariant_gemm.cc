// InvariantGemm: dot products over `in` in one fixed order per output, in
// register tiles of rows x outputs (invariant_gemm.h says why).
#include "backends/llm/invariant_gemm.h"

#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

namespace hearth::llm {
namespace {

// Eight floats; where the target lacks 256-bit vectors the compiler uses
// two 128-bit ones, lane for lane the same arithmetic.
using V8 = float __attribute__((vector_size(32)));
constexpr int64_t kLanes = 8;

// (By reference, not by value: no vector crosses a call, whatever the target.)
__attribute__((always_inline)) inline void Load(V8& v, const float* p) {
  std::memcpy(&v, p, sizeof v);
}
// The last n < 8 elements, the lanes past them zero.
__attribute__((always_inline)) inline void LoadTail(V8& v, const float* p, int64_t n) {
  v = V8{};
  std::memcpy(&v, p, static_cast<size_t>(n) * sizeof(float));
}
// The lanes in one fixed tree.
__attribute__((always_inline)) inline float Sum(const V8& v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

// y[r, o] (+)= x[r, :] . w[o, :] for R rows and O outputs. Lane j of an
// accumulator sums the products at k = j, j + 8, ... in k's order (the
// tail's missing lanes add products of zeros), then Sum: every (r, o) gets
// the same operations whatever tile it is computed in.
template <int R, int O>
__attribute__((always_inline)) inline void Tile(const float* x, const float* w, int64_t in,
                                                float* y, int64_t out, bool accumulate) {
  V8 acc[R][O] = {};
  const int64_t full = in / kLanes * kLanes;
  for (int64_t k = 0; k < full; k += kLanes) {
    V8 xv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) Load(xv[r], x + r * in + k);
#pragma GCC unroll 8
    for (int o = 0; o < O; ++o) {
      V8 wv;
      Load(wv, w + o * in + k);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r][o] += xv[r] * wv;
    }
  }
  if (full < in) {
    V8 xv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) LoadTail(xv[r], x + r * in + full, in - full);
#pragma GCC unroll 8
    for (int o = 0; o < O; ++o) {
      V8 wv;
      LoadTail(wv, w + o * in + full, in - full);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r][o] += xv[r] * wv;
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int o = 0; o < O; ++o) {
      float* at = y + r * out + o;
      const float s = Sum(acc[r][o]);
      *at = accumulate ? *at + s : s;
    }
  }
}

// Outputs in blocks of kO (their weights stay in L1 while every row goes
// past them: the weights are read from memory once), rows in tiles of kR.
constexpr int kR = 3;
constexpr int kO = 4;
constexpr int64_t kRowBlock = 48;

template <int O>
__attribute__((always_inline)) inline void Column(int64_t rows, int64_t in, const float* x,
                                                  const float* w, float* y, int64_t out,
                                                  bool accumulate) {
  int64_t r = 0;
  for (; r + kR <= rows; r += kR) Tile<kR, O>(x + r * in, w, in, y + r * out, out, accumulate);
  for (; r < rows; ++r) Tile<1, O>(x + r * in, w, in, y + r * out, out, accumulate);
}

// Built twice on x86-64 Linux, for AVX2 and for the baseline, the loader
// picking one for the machine (so every worker on a machine runs the same
// one). Never FMA: the file is built with -ffp-contract=off, so that a
// product and its sum round as the code says in every tile.
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx2", "default")))
#endif
void ProductColumns(int64_t rows, int64_t out, int64_t in, int64_t first, int64_t last,
                    const float* x, const float* w, float* y, bool accumulate) {
  // Rows in blocks of kRowBlock, whose inputs stay in L2 while the weights
  // stream past them once a block.
  for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) {
    const int64_t n = std::min(kRowBlock, rows - r0);
    const float* xb = x + r0 * in;
    float* yb = y + r0 * out;
    int64_t o = first;
    for (; o + kO <= last; o += kO) Column<kO>(n, in, xb, w + o * in, yb + o, out, accumulate);
    for (; o < last; ++o) Column<1>(n, in, xb, w + o * in, yb + o, out, accumulate);
  }
}

}  // namespace

InvariantGemm::InvariantGemm(int threads)
    : threads_(threads > 0
                   ? threads
                   : static_cast<int>(std::clamp(std::thread::hardware_concurrency(), 1u, 8u))) {}

void InvariantGemm::Run(int64_t rows, int64_t out, int64_t in, const float* x, const float* w,
                        float* y, bool accumulate) const {
  // Threads by outputs, in whole blocks of kO: each takes a column range.
  const int64_t blocks = (out + kO - 1) / kO;
  const double macs =
      static_cast<double>(rows) * static_cast<double>(out) * static_cast<double>(in);
  const int64_t parts =
      macs < static_cast<double>(kParallelMacs) ? 1 : std::min<int64_t>(threads_, blocks);
  if (parts <= 1) {
    ProductColumns(rows, out, in, 0, out, x, w, y, accumulate);
    return;
  }
  const auto part = [&](int64_t i) {
    const int64_t first = blocks * i / parts * kO;
    const int64_t last = std::min(out, blocks * (i + 1) / parts * kO);
    // y's columns [first, last): the rows keep their stride `out`.
    ProductColumns(rows, out, in, first, last, x, w, y, accumulate);
  };
  // A thread that cannot be started leaves its part to this one.
  std::vector<std::thread> others;
  int64_t started = 1;
  try {
    others.reserve(static_cast<size_t>(parts - 1));
    for (; started < parts; ++started) others.emplace_back(part, started);
  } catch (const std::exception&) {
  }
  for (int64_t i = started; i < parts; ++i) part(i);
  part(0);
  for (std::thread& t : others) t.join();
}

}  // namespace hearth::llm
