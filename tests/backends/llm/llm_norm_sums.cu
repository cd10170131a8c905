// Test kernels for llm_cuda_test: a row's sum of squares from its chunk sums
// taken both ways the CUDA llm executor takes it (llm_device.cuh): BlockSum
// over the AddRmsNorm launch's block, and SumOfChunks in one warp of a GEMM
// that folds the norm in.
#include "backends/cuda/llm_device.cuh"
#include "llm_norm_sums.h"

namespace hearth::llm::testing {
namespace {

using cuda::llm_device::BlockSum;
using cuda::llm_device::NormThreads;
using cuda::llm_device::SumOfChunks;

// Block b sums row b's chunks as the AddRmsNorm launch does (thread c holds
// chunk c, 0 past the last).
__global__ void BlockSums(const float* chunks, int64_t hidden, float* out) {
  __shared__ float scratch[32];
  const int64_t n8 = hidden / 8, c = threadIdx.x;
  const float* row = chunks + blockIdx.x * n8;
  const float total = BlockSum(c < n8 ? row[c] : 0.0f, scratch);
  if (threadIdx.x == 0) out[blockIdx.x] = total;
}

// Warp b of the grid sums row b's chunks as a folding GEMM's warp does.
__global__ void WarpSums(const float* chunks, int64_t hidden, float* out) {
  const float total = SumOfChunks(chunks + blockIdx.x * (hidden / 8), hidden);
  if (threadIdx.x == 0) out[blockIdx.x] = total;
}

}  // namespace

cudaError_t NormSumsBothWays(const float* chunks, int32_t rows, int64_t hidden, float* block_sums,
                             float* warp_sums) {
  BlockSums<<<rows, NormThreads(hidden)>>>(chunks, hidden, block_sums);
  WarpSums<<<rows, 32>>>(chunks, hidden, warp_sums);
  return cudaGetLastError();
}

}  // namespace hearth::llm::testing
