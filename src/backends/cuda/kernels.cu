#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "backends/cuda/argmax_order.cuh"
#include "backends/cuda/kernels.h"

namespace hearth::cuda {
namespace {

constexpr int kThreads = 256;  // a multiple of 32, at most 32 warps
constexpr unsigned kFullMask = 0xffffffffu;

unsigned ElementwiseBlocks(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 65535 * 16 ? blocks : 65535 * 16);
}

__global__ void NarrowFromF32(const float* src, void* dst, int64_t n, bool bf16) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    if (bf16) {
      static_cast<__nv_bfloat16*>(dst)[i] = __float2bfloat16_rn(src[i]);
    } else {
      static_cast<__half*>(dst)[i] = __float2half_rn(src[i]);
    }
  }
}

__global__ void WidenToF32(const void* src, float* dst, int64_t n, bool bf16) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    dst[i] = bf16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(src)[i])
                  : __half2float(static_cast<const __half*>(src)[i]);
  }
}

__device__ __forceinline__ void WarpArgmax(float& v, long long& i) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float ov = __shfl_down_sync(kFullMask, v, offset);
    const long long oi = __shfl_down_sync(kFullMask, i, offset);
    if (ArgmaxBefore<long long>(ov, oi, v, i)) {
      v = ov;
      i = oi;
    }
  }
}

// One block per row.
__global__ void ArgmaxRows(const float* x, int64_t cols, int64_t* out) {
  const float* row = x + blockIdx.x * cols;
  float best = 0.0f;
  long long index = -1;
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
    const float v = row[j];
    if (ArgmaxBefore<long long>(v, j, best, index)) {
      best = v;
      index = j;
    }
  }
  WarpArgmax(best, index);
  __shared__ float warp_best[32];
  __shared__ long long warp_index[32];
  const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) {
    warp_best[warp] = best;
    warp_index[warp] = index;
  }
  __syncthreads();
  if (warp != 0) return;
  const bool has = lane < blockDim.x / 32;
  best = has ? warp_best[lane] : 0.0f;
  index = has ? warp_index[lane] : -1;
  WarpArgmax(best, index);
  if (lane == 0) out[blockIdx.x] = index;
}

// One block per row.
__global__ void RowDot(const float* x, const float* w, int64_t cols, float* y) {
  const float* row = x + blockIdx.x * cols;
  float sum = 0.0f;
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) sum += row[j] * w[j];
  for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_down_sync(kFullMask, sum, offset);
  __shared__ float warp_sum[32];
  const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) warp_sum[warp] = sum;
  __syncthreads();
  if (warp != 0) return;
  sum = lane < blockDim.x / 32 ? warp_sum[lane] : 0.0f;
  for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_down_sync(kFullMask, sum, offset);
  if (lane == 0) y[blockIdx.x] = sum;
}

__global__ void WriteThrough(float* p) { *p = 1.0f; }

}  // namespace

cudaError_t LaunchIllegalAddressWrite(cudaStream_t stream) {
  // Low canonical addresses are never mapped in a CUDA context.
  WriteThrough<<<1, 1, 0, stream>>>(reinterpret_cast<float*>(uintptr_t{0x1000}));
  return cudaGetLastError();
}

cudaError_t LaunchNarrowFromF32(const float* src, void* dst, int64_t n, bool bf16,
                                cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  NarrowFromF32<<<ElementwiseBlocks(n), kThreads, 0, stream>>>(src, dst, n, bf16);
  return cudaGetLastError();
}

cudaError_t LaunchWidenToF32(const void* src, float* dst, int64_t n, bool bf16,
                             cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  WidenToF32<<<ElementwiseBlocks(n), kThreads, 0, stream>>>(src, dst, n, bf16);
  return cudaGetLastError();
}

// rows <= max_batch_size (an int), far below the grid's 2^31 - 1 limit.
cudaError_t LaunchArgmaxRows(const float* x, int64_t rows, int64_t cols, int64_t* out,
                             cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  ArgmaxRows<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(x, cols, out);
  return cudaGetLastError();
}

cudaError_t LaunchRowDot(const float* x, const float* w, int64_t rows, int64_t cols, float* y,
                         cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  RowDot<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(x, w, cols, y);
  return cudaGetLastError();
}

}  // namespace hearth::cuda
