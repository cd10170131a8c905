// A GEMM for few rows and large weights, in F32:
//   y[m, n] = act(sum_k x[m, k] * w[n, k] + bias[n]),  m < rows, n < N,
// with w a row-major PyTorch Linear weight [N, K] and x, y row-major.
//
// Why: at batch 16 an F32 forward of the seed's MLP streams 1.8 GiB of
// weights for 8 FLOP per byte. cuBLAS tiles such a product for large
// matrices and spends ~1.24 ms on it on an H200 (about 12 TFLOP/s), where
// reading the weights once takes ~0.45 ms. This kernel reads each weight once
// and applies it to every row of the batch held in registers, so it runs at
// the weight-streaming rate until its FMAs (4 per weight byte at 16 rows)
// become the limit.
//
// How: one warp owns R consecutive output features n. Lanes stride over k
// with 16-byte loads: per step a lane loads R float4 of weights (streamed,
// evict-first) and, per row m, one float4 of x (read-only cache; every warp
// of the grid reads the same x, which stays in L1/L2), and accumulates
// rows x R partial sums. A butterfly shuffle reduces them across the warp
// and the lanes write the results with the bias and the optional ReLU.
// Accumulation is F32 throughout, in a different order than cuBLAS.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace hearth::cuda {

// Rows handled by one pass over the weights; more rows run in several passes.
inline constexpr int kSkinnyMaxRows = 32;

struct SkinnyGemmArgs {
  const float* x = nullptr;     // [rows, k]
  const float* w = nullptr;     // [n, k]
  const float* bias = nullptr;  // [n], or null
  float* y = nullptr;           // [rows, n]
  int64_t rows = 0, n = 0, k = 0;
  bool relu = false;
};

// Whether the kernel can run these arguments: k a multiple of 4 and x, w
// 16-byte aligned (float4 loads of every row).
bool SkinnyGemmSupported(const SkinnyGemmArgs& a);

// rows_per_warp: 2, 4 or 8 output features per warp (8 runs as 4 on passes of
// more than 16 rows), or 0 for the default tuned on the H200 (see
// bench/gemm). Returns cudaErrorInvalidValue for
// arguments SkinnyGemmSupported refuses or an unknown rows_per_warp, else the
// launch's cudaGetLastError().
cudaError_t LaunchSkinnyGemmF32(const SkinnyGemmArgs& a, int rows_per_warp, cudaStream_t stream);

}  // namespace hearth::cuda
