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

// Two kernels (see skinny_gemm.cu):
//  - warp rows: a warp owns a few features and every lane strides over k,
//    reading x through L1 for each feature; best for 1 or 2 rows, where it
//    streams the weights at full bandwidth. Up to 32 rows per pass.
//  - sliced: lanes hold a slice of x in registers and the weights are
//    broadcast to 4 groups of rows; for more rows, up to 16 per pass.
enum class SkinnyKernel { kAuto, kWarpRows, kSliced };

struct SkinnyTuning {
  SkinnyKernel kernel = SkinnyKernel::kAuto;
  // Output features per warp: 2, 4 or 8 for warp rows (8 runs as 4 on passes
  // of more than 16 rows), 8 or 16 for sliced; 0 for the kernel's default.
  int features_per_warp = 0;
};

// Whether the kernels can run these arguments: k a multiple of 4 and x, w
// 16-byte aligned (float4 loads of every row).
bool SkinnyGemmSupported(const SkinnyGemmArgs& a);

// Runs as many passes over the weights as the rows need. Returns
// cudaErrorInvalidValue for arguments SkinnyGemmSupported refuses or an
// unknown features_per_warp, else the launches' cudaGetLastError().
cudaError_t LaunchSkinnyGemmF32(const SkinnyGemmArgs& a, SkinnyTuning tuning,
                                cudaStream_t stream);

}  // namespace hearth::cuda
