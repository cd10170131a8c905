// Status conversion and RAII owners for the CUDA runtime and cuBLASLt handles
// used by the CUDA backends. Only for libhearth_backends_cuda.so.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>

#include "hearth/status.h"

namespace hearth::cuda {

// Errors that poison the context: every later call fails the same way, and
// only a new process gets a working GPU again.
bool IsSticky(cudaError_t error);
// "what: cudaErrorName (text)"; out of memory -> ResourceExhausted, a sticky
// error -> DeviceLost.
Status CudaCheck(cudaError_t error, std::string_view what);
// "what: CUBLAS_STATUS_NAME (text)"; CUBLAS_STATUS_ALLOC_FAILED -> ResourceExhausted.
Status LtCheck(cublasStatus_t status, std::string_view what);

// Destructors cannot report failure: these log it (never throw).
void LogIfError(cudaError_t error, std::string_view what) noexcept;
void LogIfError(cublasStatus_t status, std::string_view what) noexcept;

template <typename Handle, auto Destroy>
struct HandleDeleter {
  void operator()(Handle handle) const noexcept {
    LogIfError(Destroy(handle), "destroy CUDA handle");
  }
};
// One move-only owner per handle type (cudaStream_t, cublasLtHandle_t, ...).
template <typename Handle, auto Destroy>
using UniqueHandle = std::unique_ptr<std::remove_pointer_t<Handle>, HandleDeleter<Handle, Destroy>>;

using CudaStream = UniqueHandle<cudaStream_t, cudaStreamDestroy>;
using CudaEvent = UniqueHandle<cudaEvent_t, cudaEventDestroy>;
using LtHandle = UniqueHandle<cublasLtHandle_t, cublasLtDestroy>;
using LtMatmulDesc = UniqueHandle<cublasLtMatmulDesc_t, cublasLtMatmulDescDestroy>;
using LtLayout = UniqueHandle<cublasLtMatrixLayout_t, cublasLtMatrixLayoutDestroy>;
using LtPreference = UniqueHandle<cublasLtMatmulPreference_t, cublasLtMatmulPreferenceDestroy>;

struct DeviceFree {
  void operator()(void* p) const noexcept { LogIfError(cudaFree(p), "cudaFree"); }
};
using DeviceBuffer = std::unique_ptr<void, DeviceFree>;

// cudaMalloc of `bytes` (at least 1); adds them to *total.
Result<DeviceBuffer> AllocateDevice(uint64_t bytes, std::string_view what, uint64_t* total);

// A non-blocking stream (no implicit sync with the legacy default stream).
Result<CudaStream> CreateStream();

// A column-major matrix layout.
Result<LtLayout> CreateLayout(cudaDataType type, uint64_t rows, uint64_t cols, int64_t ld);

}  // namespace hearth::cuda
