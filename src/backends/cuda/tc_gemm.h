// hearth's own tensor-core GEMM for the llm executor, batch invariant by
// construction:
//   y[m, n] = x[m, k] * w[n, k]^T (+ bias[n]),
// with w a row-major checkpoint weight, x and y row-major, F16 or BF16
// inputs, F32 accumulation, y in the input type or F32 (the bias in y's
// type, as cuBLASLt's epilogue takes it). A strided batch of two weights
// (k_proj and v_proj, gate_proj and up_proj packed in one arena) runs in the
// same launch, each product its own.
//
// Why: a decode step of a few sequences reads every weight once for little
// arithmetic. cuBLASLt's tiles, made for large matrices, take ~10 us per
// call on the q, k, v and o projections of a 1B Llama, whose weights take
// 1-4 us to read on an H200, and one cuBLASLt algorithm must serve every
// row count (llm_gemm.h says why). This kernel streams the weights at any
// row count and still computes each output element the same way.
//
// The order of sums, fixed per shape (n, k, batch) and never by m:
//   - k is cut into `splits` equal parts of k / splits (a multiple of 64);
//   - within a part, 64-wide blocks in order, each 4 mma.m16n8k16 steps
//     accumulated into an F32 sum that starts at 0 for the part; step s of
//     a block takes, for the lane pair (r, q), the elements
//     q * 16 + 4 * s + {0, 1, 2, 3} of the block (a fixed permutation of k
//     that lets every lane load 32 contiguous bytes of a weight row);
//   - the parts are added in order: ((p0 + p1) + p2) + ...; then the bias;
//     then one rounding to y's type.
// Each element depends on its own row of x and column of w only, so a row's
// bits do not depend on the row count, the tile it fell in or the mode.
//
// Two modes, the same bits (and in the split mode, a SwiGLU epilogue):
//   - few rows (m <= kTcSplitRows): a warp per (8 columns, part), the parts
//     of a column group in one CTA, which adds them in shared memory in
//     order. Every warp streams its weights once with 16-byte loads, enough
//     of them in flight to near the memory's bandwidth; nothing leaves the
//     CTA but y.
//   - more rows: a CTA per 64 x 128 tile of y and group of consecutive
//     parts, x and w staged through shared memory by cp.async. The first
//     group adds its parts in registers; where a shape has too few tiles to
//     fill the GPU and the launch has a workspace, the other groups write
//     each part alone to it and a second kernel adds them in order.
//
// Thread-safety: a many-rows launch may use the workspace; launches sharing
// it must be ordered (one stream).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <span>

namespace hearth::cuda {

// Rows up to which a launch runs in the split mode.
inline constexpr int64_t kTcSplitRows = 16;

struct TcGemmShape {
  int64_t n = 0, k = 0;
  int32_t batch = 1;
};

// The number of parts k is cut into for this shape: enough warps at one row
// to keep the memory busy within one wave (the target warps below), at most
// 8 (one CTA's warps), a function of the shape alone. 0 when the kernel
// cannot run the shape (k not a multiple of 64, n not of 8).
int32_t TcGemmSplits(const TcGemmShape& shape);

// For benches that compare, each for the launches and TcGemmSplits calls
// after it in every thread, the default again for 0:
// the most warps a one-row launch's parts may give it (per weight of a
// batch), which sets each shape's parts (and so the order of its sums), 2112
// by default;
void SetTcGemmTargetWarps(int64_t warps);
// the tiles below which a many-rows launch spreads a shape's parts over
// more CTAs (99 by default; the bits do not depend on it).
void SetTcGemmSpreadBelowTiles(int64_t tiles);

// The most workspace a many-rows launch uses (more of it, more CTAs at once
// for shapes with few tiles; none, one CTA per tile and no second kernel).
inline constexpr uint64_t kTcMaxWorkspaceBytes = uint64_t{32} << 20;

struct TcGemmArgs {
  TcGemmShape shape;
  bool bf16 = true;            // else F16
  bool f32_out = false;        // y (and the bias) in F32
  const void* x = nullptr;     // [m, k], 16-byte aligned
  const void* w = nullptr;     // [n, k], 16-byte aligned
  const void* bias = nullptr;  // [n], or null
  void* y = nullptr;           // [m, n]
  int64_t m = 0;
  // The second weight, bias and output of a batch of two, in elements.
  int64_t w_stride = 0, bias_stride = 0, y_stride = 0;
  // A batch of two (gate_proj, up_proj) whose y is silu(gate) * up, [m, n]
  // (y_stride unused): each product rounded to the input type first, so the
  // bits equal the two products followed by a SwiGLU launch. Split mode only
  // (m <= kTcSplitRows), no bias, not f32_out.
  bool swiglu = false;
  // Optional: where the many-rows mode may keep part sums, and its size in
  // bytes (the split mode uses none).
  float* workspace = nullptr;
  uint64_t workspace_bytes = 0;
};

// Queues the product. cudaErrorInvalidValue for a shape TcGemmSplits
// refuses, misaligned pointers or strides, or a workspace size without a
// workspace; else the launch's cudaGetLastError().
cudaError_t LaunchTcGemm(const TcGemmArgs& args, cudaStream_t stream);

// Queues up to kTcMaxGroup split-mode products in one launch (q_proj and the
// k/v pair, which read one x): each entry's bits are LaunchTcGemm's. Every
// entry has the same m (at most kTcSplitRows) and input type, no swiglu and
// no f32_out; else cudaErrorInvalidValue.
inline constexpr int kTcMaxGroup = 3;
cudaError_t LaunchTcGemmGroup(std::span<const TcGemmArgs> group, cudaStream_t stream);

}  // namespace hearth::cuda
