// backend: llm — the CPU executor's projections: y = x * w^T over the rows
// of a step, by OpenBLAS's sgemm, called so that every row of y comes out
// with the same bits whatever the other rows are, however many rows there
// are, and whatever OpenBLAS's thread count. A stream resumed on another
// worker is prefilled again (its prompt and the tokens its client has, in
// chunks beside other streams) and must then draw what it would have drawn;
// a greedy near-tie flips on one bit.
//
// What makes sgemm (OpenBLAS 0.3.21) give a row other bits, measured with
// y[rows, out] = x[rows, in] * w[out, in]^T in row-major order, which
// OpenBLAS computes as the column-major product y^T = w * x^T with w read
// transposed ("TN": M = out, N = rows, K = in):
//  - Its SkylakeX (and Cooper Lake, Sapphire Rapids) kernels hand a TN
//    product with out * rows <= 1200, in >= 32 and out * rows * in <= 1e6 to
//    a small-matrix kernel that sums in another order than its blocked GEMM
//    (sgemm_small_kernel_permit_skylakex.c): a decode step of few rows and a
//    prefill of many then differ in the last bits. Run pads such products
//    with zero rows, so that out * rows > 1200: every call takes the blocked
//    GEMM.
//  - The blocked GEMM sums `in` in blocks of GEMM_Q (448 on SkylakeX) and
//    splits a remainder between GEMM_Q and 2 * GEMM_Q in two: one thread
//    (driver/level3/level3.c) rounds the half up to a multiple of 16, more
//    threads (level3_thread.c) do not. For `in` such as 600, 777 or 1000 a
//    row then differs between 1 and 2 threads. Run sums `in` in slices of
//    at most kMaxSlice, each one sgemm adding into y: 256 is within one
//    block of either driver on the cores from Sandy Bridge and Zen on
//    (GEMM_Q 320 to 448); older AMD cores (Bulldozer to Excavator, 168 to
//    192) may still split a slice.
//  - Nothing else: within the blocked GEMM a row's bits do not depend on the
//    number of rows, its place among them (edges of the 16 x 4 micro-tiles
//    included) or how threads split the rows and columns (measured for 1 to
//    512 rows, 1, 2 and 4 threads, out and in from 32 to 2816, 777, 1000).
// Run also never calls sgemm with one row: OpenBLAS 0.3.28 built for arm64,
// riscv or power (GEMM_GEMV_FORWARD) sends such a product to GEMV (read in
// its source, not measured). invariant_gemm_test.cc checks all this on the
// machine it runs on; another OpenBLAS must pass it again.
//
// Cost, against one sgemm (measured, 1 and 2 threads): slices of 256 are
// within 5% (the lm_head of 32000 x 1024 for 16 rows) and usually within
// the noise; the padding only touches products of one row or of fewer than
// 1200 outputs per row.
#pragma once

#include <cstdint>
#include <vector>

namespace hearth::llm {

// Thread-safety: one thread uses an InvariantGemm (it owns the padding's
// scratch).
class InvariantGemm {
 public:
  static constexpr int64_t kMaxSlice = 256;
  // out * rows at most this goes to OpenBLAS's small-matrix kernel.
  static constexpr int64_t kSmallProduct = 1200;
  static constexpr int64_t kMinRows = 2;

  // y[rows, out] = x[rows, in] * w[out, in]^T, or y += that (accumulate);
  // rows, out, in > 0; row-major, rows packed (strides in and out). Row r of
  // y is a function of row r of x (and of y, accumulating), w and the
  // shapes, nothing else.
  void Run(int64_t rows, int64_t out, int64_t in, const float* x, const float* w, float* y,
           bool accumulate);

 private:
  std::vector<float> x_pad_, y_pad_;
};

}  // namespace hearth::llm
