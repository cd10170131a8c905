// The extern "C" entry points of libhearth_backends_cuda.so (see
// cuda_backend_abi.h). No exception leaves them.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <string>
#include <type_traits>
#include <vector>

#include "backends/cuda/cuda_backend_abi.h"
#include "backends/cuda/cuda_backends.h"
#include "backends/cuda/cuda_util.h"
#include "backends/model_weights.h"
#include "memory/cuda_driver.h"

namespace hearth {
namespace {

int Report(const Status& status, char* error, size_t error_size) {
  if (status.ok()) return 0;
  if (error != nullptr && error_size > 0) {
    const size_t n = std::min(status.message().size(), error_size - 1);
    std::memcpy(error, status.message().data(), n);
    error[n] = '\0';
  }
  return static_cast<int>(status.code());
}

Status CheckAbi(uint32_t abi_version) {
  if (abi_version == HEARTH_CUDA_BACKEND_ABI_VERSION) return Status::Ok();
  return FailedPrecondition(HEARTH_CUDA_BACKEND_LIBRARY " speaks ABI version " +
                            std::to_string(HEARTH_CUDA_BACKEND_ABI_VERSION) + ", the caller " +
                            std::to_string(abi_version) + ": it comes from another build");
}

// Runs `body` (returning Status), turning any exception into Internal.
template <typename Body>
int Guarded(const char* what, char* error, size_t error_size, Body&& body) noexcept {
  try {
    return Report(body(), error, error_size);
  } catch (const std::exception& e) {
    return Report(Internal(std::string(what) + ": " + e.what()), error, error_size);
  } catch (...) {
    return Report(Internal(std::string(what) + ": unknown exception"), error, error_size);
  }
}

Status Create(const char* kind, const HearthCudaTensor* weights, size_t num_weights, int32_t device,
              const HearthCudaOptions* c_options, void** out) {
  std::vector<TensorView> views(num_weights);
  for (size_t i = 0; i < num_weights; ++i) {
    const HearthCudaTensor& t = weights[i];
    if (t.name == nullptr || t.rank < 0 || (t.rank > 0 && t.shape == nullptr) || t.dtype < 0 ||
        !IsStoredDType(t.dtype)) {
      return InvalidArgument("malformed weight #" + std::to_string(i));
    }
    views[i].name = t.name;
    views[i].dtype = static_cast<DType>(t.dtype);
    views[i].shape.assign(t.shape, t.shape + t.rank);
    views[i].data = t.data;
    views[i].nbytes = t.nbytes;
    views[i].device = Device{static_cast<DeviceKind>(t.device_kind), t.device_index};
  }
  BackendOptions options;
  options.max_batch_size = c_options->max_batch_size;
  options.allow_tf32 = c_options->allow_tf32 != 0;
  for (size_t i = 0; i < c_options->num_parameters; ++i) {
    options.parameters[c_options->parameter_keys[i]] = c_options->parameter_values[i];
  }
  if (options.max_batch_size < 1) return InvalidArgument("max_batch_size must be at least 1");
  RETURN_IF_ERROR(CheckWeightsDevice(views, Device::Cuda(device)));
  const std::string_view k(kind);
  Result<std::unique_ptr<Backend>> backend =
      Unimplemented("no CUDA backend '" + std::string(k) + "'");
  if (k == "mlp") {
    ASSIGN_OR_RETURN(MlpWeights w, ValidateMlpWeights(views));
    backend = CreateMlpCuda(w, device, options);
  } else if (k == "scale") {
    ASSIGN_OR_RETURN(ScaleWeights w, ValidateScaleWeights(views));
    backend = CreateScaleCuda(w, device, options);
  }
  if (!backend.ok()) return backend.status();
  *out = std::move(backend).value().release();
  return Status::Ok();
}

}  // namespace
}  // namespace hearth

extern "C" {

__attribute__((visibility("default"))) int hearth_create_cuda_backend(
    uint32_t abi_version, const char* kind, const HearthCudaTensor* weights, size_t num_weights,
    int32_t device_index, const HearthCudaOptions* options, void** backend, char* error,
    size_t error_size) {
  return hearth::Guarded("create CUDA backend", error, error_size, [&] {
    RETURN_IF_ERROR(hearth::CheckAbi(abi_version));
    if (kind == nullptr || options == nullptr || backend == nullptr ||
        (num_weights > 0 && weights == nullptr)) {
      return hearth::InvalidArgument("hearth_create_cuda_backend: null argument");
    }
    *backend = nullptr;
    return hearth::Create(kind, weights, num_weights, device_index, options, backend);
  });
}

__attribute__((visibility("default"))) int hearth_cuda_host_register(uint32_t abi_version,
                                                                     int32_t device_index,
                                                                     void* data, uint64_t bytes,
                                                                     char* error,
                                                                     size_t error_size) {
  return hearth::Guarded("cudaHostRegister", error, error_size, [&] {
    RETURN_IF_ERROR(hearth::CheckAbi(abi_version));
    RETURN_IF_ERROR(hearth::MakeContextCurrent(device_index));
    return hearth::cuda::CudaCheck(cudaHostRegister(data, bytes, cudaHostRegisterDefault),
                                   "cudaHostRegister " + std::to_string(bytes) + " bytes");
  });
}

__attribute__((visibility("default"))) int hearth_cuda_host_unregister(uint32_t abi_version,
                                                                       int32_t device_index,
                                                                       void* data, char* error,
                                                                       size_t error_size) {
  return hearth::Guarded("cudaHostUnregister", error, error_size, [&] {
    RETURN_IF_ERROR(hearth::CheckAbi(abi_version));
    RETURN_IF_ERROR(hearth::MakeContextCurrent(device_index));
    return hearth::cuda::CudaCheck(cudaHostUnregister(data), "cudaHostUnregister");
  });
}

}  // extern "C"

static_assert(std::is_same_v<decltype(&hearth_create_cuda_backend), HearthCreateCudaBackendFn>);
static_assert(std::is_same_v<decltype(&hearth_cuda_host_register), HearthCudaHostRegisterFn>);
static_assert(std::is_same_v<decltype(&hearth_cuda_host_unregister), HearthCudaHostUnregisterFn>);
