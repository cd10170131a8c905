// Test kernels of llm_norm_sums.cu, for llm_cuda_test.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace hearth::llm::testing {

// For each of `rows` rows of hidden / 8 chunk sums (device memory, one row
// after another), the row's sum as the AddRmsNorm launch's block adds them
// (block_sums[row]) and as a GEMM that folds the norm in does
// (warp_sums[row]). hidden % 8 == 0, hidden <= 8192.
cudaError_t NormSumsBothWays(const float* chunks, int32_t rows, int64_t hidden, float* block_sums,
                             float* warp_sums);

}  // namespace hearth::llm::testing
