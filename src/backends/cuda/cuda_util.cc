#include "backends/cuda/cuda_util.h"

#include <spdlog/spdlog.h>

namespace hearth::cuda {

bool IsSticky(cudaError_t error) {
  switch (error) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorHardwareStackError:
    case cudaErrorAssert:
    case cudaErrorLaunchTimeout:
    case cudaErrorECCUncorrectable:
    case cudaErrorContextIsDestroyed:
      return true;
    default:
      return false;
  }
}

Status CudaCheck(cudaError_t error, std::string_view what) {
  if (error == cudaSuccess) return Status::Ok();
  // Clears the runtime's last error, so that a later launch check
  // (cudaGetLastError) does not report this failure again. Sticky errors
  // (a fault that poisons the context) stay: every later call reports them.
  (void)cudaGetLastError();
  std::string message =
      std::string(what) + ": " + cudaGetErrorName(error) + " (" + cudaGetErrorString(error) + ")";
  if (error == cudaErrorMemoryAllocation) return ResourceExhausted(std::move(message));
  if (error == cudaErrorNoDevice || error == cudaErrorInsufficientDriver) {
    return Unavailable(std::move(message));
  }
  if (IsSticky(error)) return DeviceLost(std::move(message));
  return Internal(std::move(message));
}

Status LtCheck(cublasStatus_t status, std::string_view what) {
  if (status == CUBLAS_STATUS_SUCCESS) return Status::Ok();
  std::string message = std::string(what) + ": " + cublasLtGetStatusName(status) + " (" +
                        cublasLtGetStatusString(status) + ")";
  if (status == CUBLAS_STATUS_ALLOC_FAILED) return ResourceExhausted(std::move(message));
  if (status == CUBLAS_STATUS_NOT_SUPPORTED) return Unimplemented(std::move(message));
  return Internal(std::move(message));
}

void LogIfError(cudaError_t error, std::string_view what) noexcept {
  // At exit the runtime may already be torn down; it has freed everything.
  if (error == cudaSuccess || error == cudaErrorCudartUnloading) return;
  spdlog::warn("{}: {} ({})", what, cudaGetErrorName(error), cudaGetErrorString(error));
}

void LogIfError(cublasStatus_t status, std::string_view what) noexcept {
  if (status == CUBLAS_STATUS_SUCCESS) return;
  spdlog::warn("{}: {}", what, cublasLtGetStatusName(status));
}

Result<DeviceBuffer> AllocateDevice(uint64_t bytes, std::string_view what, uint64_t* total) {
  void* p = nullptr;
  RETURN_IF_ERROR(
      CudaCheck(cudaMalloc(&p, bytes == 0 ? 1 : bytes),
                "cudaMalloc " + std::to_string(bytes) + " bytes for " + std::string(what)));
  *total += bytes;
  return DeviceBuffer(p);
}

Result<CudaStream> CreateStream() {
  cudaStream_t stream = nullptr;
  RETURN_IF_ERROR(CudaCheck(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                            "cudaStreamCreateWithFlags"));
  return CudaStream(stream);
}

Result<LtLayout> CreateLayout(cudaDataType type, uint64_t rows, uint64_t cols, int64_t ld) {
  cublasLtMatrixLayout_t layout = nullptr;
  RETURN_IF_ERROR(LtCheck(cublasLtMatrixLayoutCreate(&layout, type, rows, cols, ld),
                          "cublasLtMatrixLayoutCreate"));
  return LtLayout(layout);
}

}  // namespace hearth::cuda
