// A GEMM for few rows and large weights, in F32:
//   y[m, n] = act(sum_k x[m, k] * w[n, k] + bias[n]),  m < rows, n < N,
// with w a row-major PyTorch Linear weight [N, K] and x, y row-major.
//
// Why: a forward of a few rows streams every weight for little arithmetic,
// and cuBLAS's tiles, made for large matrices, leave bandwidth unused there.
// This kernel reads each weight once and applies it to every row of the
// batch. On an H200, for the seed's MLP (1.8 GiB of F32 weights), it runs
// 2 rows in 0.44 ms (4.3 TB/s) where cuBLASLt takes 0.70 ms, 4 rows in 0.54
// against 0.79 ms and 8 rows in 0.81 against 0.90 ms; from 16 rows on
// cuBLASLt is faster (1.28 against 1.78 ms): its x traffic through L1 grows
// with the rows, and the load units become the limit (bench/gemm).
//
// How: one warp owns R consecutive output features. Lanes stride over k
// with 16-byte loads: per step a lane loads R float4 of weights (streamed,
// evict-first) and, per row m, one float4 of x through the read-only cache,
// and accumulates rows x R partial sums. A butterfly shuffle reduces them
// across the warp at the end.
//
// Accumulation is F32 throughout, in a different order than cuBLAS.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace hearth::cuda {

struct SkinnyGemmArgs {
  const float* x = nullptr;     // [rows, k]
  const float* w = nullptr;     // [n, k]
  const float* bias = nullptr;  // [n], or null
  float* y = nullptr;           // [rows, n]
  int64_t rows = 0, n = 0, k = 0;
  bool relu = false;
};

// Rows handled by one pass over the weights; more rows run in several passes.
inline constexpr int kSkinnyMaxRows = 32;

// Whether the kernel can run these arguments: k a multiple of 4 and x, w
// 16-byte aligned (float4 loads of every row).
bool SkinnyGemmSupported(const SkinnyGemmArgs& a);

// Runs as many passes over the weights as the rows need. features_per_warp:
// 2, 4 or 8 output features per warp (8 runs as 4 on passes of more than 16
// rows), or 0 for the default. Returns cudaErrorInvalidValue for arguments
// SkinnyGemmSupported refuses or another features_per_warp, else the
// launches' cudaGetLastError().
cudaError_t LaunchSkinnyGemmF32(const SkinnyGemmArgs& a, int features_per_warp,
                                cudaStream_t stream);

}  // namespace hearth::cuda
