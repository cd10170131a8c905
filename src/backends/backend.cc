#include "backends/backend.h"

#include <dlfcn.h>
#include <unistd.h>

#include <array>
#include <cstring>
#include <filesystem>
#include <mutex>

#include "backends/cpu/cpu_backends.h"
#include "backends/cuda/cuda_backend_abi.h"
#include "backends/model_weights.h"

namespace hearth {


namespace {

// libhearth_backends_cuda.so, loaded once per process and never unloaded
// (backends it made point into it).
struct CudaLibrary {
  HearthCreateCudaBackendFn create = nullptr;
  HearthCudaHostRegisterFn host_register = nullptr;
  HearthCudaHostUnregisterFn host_unregister = nullptr;
};

// Tries, in order: next to the running executable (an installed worker), the
// build tree (HEARTH_BACKENDS_CUDA_BUILD_PATH, for tests and uninstalled
// builds), then the plain name through the loader's search path.
Result<CudaLibrary> OpenCudaLibrary() {
  std::vector<std::string> candidates;
  std::error_code ec;
  std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) candidates.push_back((exe.parent_path() / HEARTH_CUDA_BACKEND_LIBRARY).string());
#ifdef HEARTH_BACKENDS_CUDA_BUILD_PATH
  candidates.emplace_back(HEARTH_BACKENDS_CUDA_BUILD_PATH);
#endif
  candidates.emplace_back(HEARTH_CUDA_BACKEND_LIBRARY);

  std::string errors;
  for (const std::string& path : candidates) {
    // A path with a '/' that does not exist gives a dull dlerror; skip it.
    if (path.find('/') != std::string::npos && !std::filesystem::exists(path, ec)) continue;
    void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      const char* e = dlerror();
      errors += std::string(errors.empty() ? "" : "; ") + (e != nullptr ? e : path);
      continue;
    }
    CudaLibrary lib;
    lib.create =
        reinterpret_cast<HearthCreateCudaBackendFn>(dlsym(handle, HEARTH_CREATE_CUDA_BACKEND));
    lib.host_register =
        reinterpret_cast<HearthCudaHostRegisterFn>(dlsym(handle, HEARTH_CUDA_HOST_REGISTER));
    lib.host_unregister =
        reinterpret_cast<HearthCudaHostUnregisterFn>(dlsym(handle, HEARTH_CUDA_HOST_UNREGISTER));
    if (lib.create == nullptr || lib.host_register == nullptr || lib.host_unregister == nullptr) {
      errors += (errors.empty() ? "" : "; ") + path + ": missing hearth entry points";
      dlclose(handle);
      continue;
    }
    return lib;
  }
  return Unavailable("cannot load the CUDA backends (" HEARTH_CUDA_BACKEND_LIBRARY "): " +
                     (errors.empty() ? std::string("not found") : errors));
}

Result<CudaLibrary> GetCudaLibrary() {
  static std::once_flag once;
  static Result<CudaLibrary>* library = nullptr;  // leaked on purpose: lives until exit
  std::call_once(once, [] { library = new Result<CudaLibrary>(OpenCudaLibrary()); });
  return *library;
}

Status FromC(int code, const std::array<char, 1024>& error) {
  if (code == 0) return Status::Ok();
  return Status(static_cast<StatusCode>(code),
                std::string(error.data(), strnlen(error.data(), error.size())));
}

Result<std::unique_ptr<Backend>> CreateCudaBackend(std::string_view kind,
                                                   const std::vector<TensorView>& weights,
                                                   Device device, const BackendOptions& options) {
  ASSIGN_OR_RETURN(CudaLibrary lib, GetCudaLibrary());
  std::vector<HearthCudaTensor> tensors;
  tensors.reserve(weights.size());
  for (const TensorView& t : weights) {
    tensors.push_back({t.name.c_str(), static_cast<int32_t>(t.dtype),
                       static_cast<int32_t>(t.shape.size()), t.shape.data(), t.data, t.nbytes,
                       static_cast<int32_t>(t.device.kind), t.device.index});
  }
  std::vector<const char*> keys, values;
  for (const auto& [k, v] : options.parameters) {
    keys.push_back(k.c_str());
    values.push_back(v.c_str());
  }
  const HearthCudaOptions c_options{options.max_batch_size, options.allow_tf32 ? 1 : 0, keys.size(),
                                    keys.data(), values.data()};
  const std::string c_kind(kind);
  void* backend = nullptr;
  std::array<char, 1024> error{};
  RETURN_IF_ERROR(FromC(
      lib.create(HEARTH_CUDA_BACKEND_ABI_VERSION, c_kind.c_str(), tensors.data(), tensors.size(),
                 device.index, &c_options, &backend, error.data(), error.size()),
      error));
  return std::unique_ptr<Backend>(static_cast<Backend*>(backend));
}

}  // namespace

Result<std::unique_ptr<Backend>> CreateBackend(std::string_view kind,
                                               const std::vector<TensorView>& weights,
                                               Device device, const BackendOptions& options) {
  // Validates the weights and the kind for both devices, before any GPU work.
  RETURN_IF_ERROR(BackendSignature(kind, weights).status());
  RETURN_IF_ERROR(CheckWeightsDevice(weights, device));
  if (options.max_batch_size < 1) {
    return InvalidArgument("max_batch_size must be at least 1, got " +
                           std::to_string(options.max_batch_size));
  }
  for (const TensorView& t : weights) {
    if (t.data == nullptr && t.nbytes > 0)
      return InvalidArgument("tensor '" + t.name + "' has no data");
  }
  if (device.is_cuda()) return CreateCudaBackend(kind, weights, device, options);
  if (kind == "mlp") return CreateMlpCpu(*ValidateMlpWeights(weights), options);
  return CreateScaleCpu(*ValidateScaleWeights(weights), options);
}

Status RegisterHostMemory(Device device, void* data, uint64_t bytes) {
  if (!device.is_cuda()) return Status::Ok();
  ASSIGN_OR_RETURN(CudaLibrary lib, GetCudaLibrary());
  std::array<char, 1024> error{};
  return FromC(lib.host_register(HEARTH_CUDA_BACKEND_ABI_VERSION, device.index, data, bytes,
                                 error.data(), error.size()),
               error);
}

Status UnregisterHostMemory(Device device, void* data) {
  if (!device.is_cuda()) return Status::Ok();
  ASSIGN_OR_RETURN(CudaLibrary lib, GetCudaLibrary());
  std::array<char, 1024> error{};
  return FromC(lib.host_unregister(HEARTH_CUDA_BACKEND_ABI_VERSION, device.index, data,
                                   error.data(), error.size()),
               error);
}

}  // namespace hearth
