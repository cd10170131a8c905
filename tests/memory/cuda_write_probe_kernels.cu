#include <cuda_runtime.h>

#include "cuda_write_probe_kernels.h"

namespace hearth::probe {
namespace {

constexpr unsigned long long kPage = 4096;
constexpr unsigned kThreads = 256;

__global__ void WriteEveryPage(unsigned char* bytes, unsigned long long size) {
  unsigned long long i =
      (static_cast<unsigned long long>(blockIdx.x) * blockDim.x + threadIdx.x) * kPage;
  if (i < size) bytes[i] = 0xA5;
}

__global__ void SumBytes(const unsigned char* bytes, unsigned long long size,
                         unsigned long long* sum) {
  unsigned long long local = 0;
  const unsigned long long stride = static_cast<unsigned long long>(gridDim.x) * blockDim.x;
  for (unsigned long long i =
           static_cast<unsigned long long>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < size; i += stride) {
    local += bytes[i];
  }
  for (int delta = 16; delta > 0; delta /= 2) local += __shfl_down_sync(0xffffffffu, local, delta);
  if ((threadIdx.x & 31u) == 0) atomicAdd(sum, local);
}

std::string ErrorText(const char* what, cudaError_t error) {
  return std::string(what) + ": " + cudaGetErrorName(error) + ": " + cudaGetErrorString(error);
}

}  // namespace

std::string WriteThroughMapping(int device, const void* data, uint64_t size) {
  cudaError_t error = cudaSetDevice(device);
  if (error != cudaSuccess) return ErrorText("cudaSetDevice", error);
  unsigned long long pages = (size + kPage - 1) / kPage;
  unsigned blocks = static_cast<unsigned>((pages + kThreads - 1) / kThreads);
  if (blocks == 0) return "nothing to write";
  // The mapping is read-only; casting const away is the point of the probe.
  WriteEveryPage<<<blocks, kThreads>>>(
      const_cast<unsigned char*>(static_cast<const unsigned char*>(data)), size);
  error = cudaGetLastError();
  if (error != cudaSuccess) return ErrorText("launching the write kernel", error);
  error = cudaDeviceSynchronize();
  if (error != cudaSuccess) return ErrorText("write kernel", error);
  return "";
}

std::string SumThroughMapping(int device, const void* data, uint64_t size, uint64_t* sum) {
  cudaError_t error = cudaSetDevice(device);
  if (error != cudaSuccess) return ErrorText("cudaSetDevice", error);
  unsigned long long* device_sum = nullptr;
  error = cudaMalloc(&device_sum, sizeof *device_sum);
  if (error != cudaSuccess) return ErrorText("cudaMalloc", error);
  std::string result;
  error = cudaMemset(device_sum, 0, sizeof *device_sum);
  if (error == cudaSuccess) {
    SumBytes<<<1024, kThreads>>>(static_cast<const unsigned char*>(data), size, device_sum);
    error = cudaGetLastError();
    if (error == cudaSuccess) error = cudaDeviceSynchronize();
    if (error != cudaSuccess) result = ErrorText("sum kernel", error);
  } else {
    result = ErrorText("cudaMemset", error);
  }
  unsigned long long host_sum = 0;
  if (result.empty()) {
    error = cudaMemcpy(&host_sum, device_sum, sizeof host_sum, cudaMemcpyDeviceToHost);
    if (error != cudaSuccess) result = ErrorText("cudaMemcpy of the sum", error);
  }
  cudaFree(device_sum);
  *sum = host_sum;
  return result;
}

std::string StackSizeLimit(int device, uint64_t* bytes) {
  cudaError_t error = cudaSetDevice(device);
  if (error != cudaSuccess) return ErrorText("cudaSetDevice", error);
  size_t value = 0;
  error = cudaDeviceGetLimit(&value, cudaLimitStackSize);
  if (error != cudaSuccess) return ErrorText("cudaDeviceGetLimit(cudaLimitStackSize)", error);
  *bytes = value;
  return "";
}

}  // namespace hearth::probe
