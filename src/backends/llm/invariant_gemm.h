// backend: llm — the CPU executor's projections: y = x * w^T over the rows
// of a step, computed so that every row of y comes out with the same bits
// whatever the other rows are and however many there are. A stream resumed
// on another worker is prefilled again (its prompt and the tokens its client
// has, in chunks beside other streams) and must then draw what it would
// have drawn; a greedy near-tie flips on one bit.
//
// Each output is one dot product over `in`, in one order: lane j of an
// 8-float accumulator sums the products at k = j, j + 8, ... (a last,
// partial group of 8 padded with zeros), then the lanes add in a fixed
// tree; accumulating adds that sum to y. Register tiles of 3 rows by 4
// outputs share the loads; a tile at the edge is smaller, with the same
// arithmetic per output, so a row's bits never depend on its place. The file
// is built without floating-point contraction (no FMA where the compiler
// would fuse in one tile and not in another), and on x86-64 Linux twice, for
// AVX2 and the baseline, the loader picking one per machine: every worker on
// a machine computes the same bits.
//
// Why not OpenBLAS's sgemm, as before: whether a row's bits depend on its
// neighbours is a property of the kernel OpenBLAS picks for the CPU. Its
// SkylakeX kernels hand small products to a small-matrix kernel that sums in
// another order, and its Haswell kernels (which it also runs on AMD Zen)
// give a row other bits by its place modulo 12 among the rows (measured,
// OpenBLAS 0.3.21 on an AMD EPYC with AVX-512). Padding rows and slicing
// `in` kept SkylakeX invariant but not Haswell; a kernel of our own is
// invariant by construction on every CPU.
//
// Cost, one thread, out = in = 2048 on that EPYC (AVX2 clone): 0.32 ms for
// one row (OpenBLAS 1.38 ms: 4x faster, the step of a decode), 0.63 ms for
// 4 rows (1.22), 7.0 ms for 64 rows (6.0 ms: 0.86x, a prefill chunk).
//
// Threads: a product of at least kParallelMacs multiply-adds is split by
// outputs, each output computed whole by one thread, so the thread count
// changes no bit. Rows go in blocks of 48 whose inputs stay in L2. The CPU
// executor on bench/llm/cpu_step_bench's shape, 2 threads on that EPYC:
// prefill of 512 tokens 685 ms (OpenBLAS 553 on 2 threads, 755 on one), a
// decode step of 16 sequences 39 ms (38).
#pragma once

#include <cstdint>

namespace hearth::llm {

// Thread-safety: const; any number of threads may use one.
class InvariantGemm {
 public:
  // Products smaller than this run on the calling thread alone.
  static constexpr int64_t kParallelMacs = int64_t{1} << 21;

  // threads: at most this many threads a product (the caller's included);
  // 0: the machine's cores, at most 8.
  explicit InvariantGemm(int threads = 1);

  int threads() const { return threads_; }

  // y[rows, out] = x[rows, in] * w[out, in]^T, or y += that (accumulate);
  // rows, out, in > 0; row-major, rows packed (strides in and out). Row r of
  // y is a function of row r of x (and of y, accumulating), w and the
  // shapes, nothing else.
  void Run(int64_t rows, int64_t out, int64_t in, const float* x, const float* w, float* y,
           bool accumulate) const;

 private:
  int threads_;
};

}  // namespace hearth::llm
