// Host launchers of the backends' CUDA kernels. Each queues its kernel on
// `stream` and returns cudaGetLastError() (launch errors only; faults show up
// at the next synchronisation).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace hearth::cuda {

// dst[i] = src[i] rounded to nearest even, as F16 (bf16 = false) or BF16.
cudaError_t LaunchNarrowFromF32(const float* src, void* dst, int64_t n, bool bf16,
                                cudaStream_t stream);
// dst[i] = src[i] (F16 or BF16) as float, exactly.
cudaError_t LaunchWidenToF32(const void* src, float* dst, int64_t n, bool bf16,
                             cudaStream_t stream);
// out[r] = first index of the max of row r of x [rows, cols]; a NaN counts as
// larger than any number (as the CPU backend and torch.argmax).
cudaError_t LaunchArgmaxRows(const float* x, int64_t rows, int64_t cols, int64_t* out,
                             cudaStream_t stream);
// Fault injection: a kernel that stores to an address no allocation covers,
// so that the stream's next synchronisation fails with the sticky
// cudaErrorIllegalAddress, as a buggy kernel would.
cudaError_t LaunchIllegalAddressWrite(cudaStream_t stream);
// y[r] = sum_j x[r, j] * w[j], f32 accumulation.
cudaError_t LaunchRowDot(const float* x, const float* w, int64_t rows, int64_t cols, float* y,
                         cudaStream_t stream);

}  // namespace hearth::cuda
