#include "backends/backend.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <mutex>

#include "backends/aoti/aoti_backend_abi.h"
#include "backends/cpu/cpu_backends.h"
#include "backends/cuda/cuda_backend_abi.h"
#include "backends/engine.h"
#include "backends/llm/llm_engine.h"
#include "backends/model_weights.h"
#include "backends/plugin.h"
#include "backends/registry.h"

namespace hearth {
namespace {

// libhearth_backends_cuda.so, loaded once per process and never unloaded
// (backends it made point into it).
struct CudaLibrary {
  HearthCreateCudaBackendFn create = nullptr;
  HearthCudaHostRegisterFn host_register = nullptr;
  HearthCudaHostUnregisterFn host_unregister = nullptr;
  Plugin plugin;  // its engines: hearth_create_engine, when it has one
};

Result<CudaLibrary> OpenCudaLibrary() {
#ifdef HEARTH_BACKENDS_CUDA_BUILD_PATH
  const char* build_path = HEARTH_BACKENDS_CUDA_BUILD_PATH;
#else
  const char* build_path = nullptr;
#endif
  ASSIGN_OR_RETURN(Plugin plugin, OpenPlugin(HEARTH_CUDA_BACKEND_LIBRARY, build_path,
                                             {HEARTH_CREATE_CUDA_BACKEND, HEARTH_CUDA_HOST_REGISTER,
                                              HEARTH_CUDA_HOST_UNREGISTER}));
  CudaLibrary lib;
  lib.create = reinterpret_cast<HearthCreateCudaBackendFn>(plugin.entry[0]);
  lib.host_register = reinterpret_cast<HearthCudaHostRegisterFn>(plugin.entry[1]);
  lib.host_unregister = reinterpret_cast<HearthCudaHostUnregisterFn>(plugin.entry[2]);
  lib.plugin = std::move(plugin);
  return lib;
}

Result<CudaLibrary> GetCudaLibrary() {
  static std::once_flag once;
  static Result<CudaLibrary>* library = nullptr;  // leaked on purpose: lives until exit
  std::call_once(once, [] { library = new Result<CudaLibrary>(OpenCudaLibrary()); });
  return *library;
}

template <size_t N>
Status FromC(int code, const std::array<char, N>& error) {
  if (code == 0) return Status::Ok();
  return Status(static_cast<StatusCode>(code),
                std::string(error.data(), strnlen(error.data(), error.size())));
}

// The engine of `kind` from the CUDA library's hearth_create_engine, for a
// model on a GPU.
Result<std::unique_ptr<Engine>> CreateCudaEngine(std::string_view kind,
                                                 const std::vector<TensorView>& weights,
                                                 Device device, const EngineOptions& options) {
  ASSIGN_OR_RETURN(CudaLibrary lib, GetCudaLibrary());
  return CreatePluginEngine(lib.plugin, kind, weights, device, options);
}

Result<std::unique_ptr<Backend>> CreateCudaBackend(std::string_view kind,
                                                   const std::vector<TensorView>& weights,
                                                   Device device, const BackendOptions& options) {
  ASSIGN_OR_RETURN(CudaLibrary lib, GetCudaLibrary());
  const CArguments c(weights, options);
  const std::string c_kind(kind);
  void* backend = nullptr;
  std::array<char, 1024> error{};
  RETURN_IF_ERROR(FromC(
      lib.create(HEARTH_CUDA_BACKEND_ABI_VERSION, c_kind.c_str(), c.tensors.data(),
                 c.tensors.size(), device.index, &c.options, &backend, error.data(), error.size()),
      error));
  return std::unique_ptr<Backend>(static_cast<Backend*>(backend));
}

Result<std::unique_ptr<Backend>> CreateBuiltin(std::string_view kind,
                                               const std::vector<TensorView>& weights,
                                               Device device, const BackendOptions& options) {
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
  if (kind == "mlp") {
    ASSIGN_OR_RETURN(MlpWeights w, ValidateMlpWeights(weights));
    return CreateMlpCpu(w, options);
  }
  ASSIGN_OR_RETURN(ScaleWeights w, ValidateScaleWeights(weights));
  return CreateScaleCpu(w, options);
}

// backend: aoti, from libhearth_backend_aoti.so (built only with libtorch).
struct AotiLibrary {
  HearthCreateAotiBackendFn create = nullptr;
};

Result<AotiLibrary> GetAotiLibrary() {
  static std::once_flag once;
  static Result<AotiLibrary>* library = nullptr;  // leaked: lives until exit
  std::call_once(once, [] {
#ifdef HEARTH_AOTI_BUILD_PATH
    const char* build_path = HEARTH_AOTI_BUILD_PATH;
#else
    const char* build_path = nullptr;
#endif
    auto entry = OpenPlugin(HEARTH_AOTI_BACKEND_LIBRARY, build_path, {HEARTH_CREATE_AOTI_BACKEND});
    library = entry.ok() ? new Result<AotiLibrary>(AotiLibrary{
                               reinterpret_cast<HearthCreateAotiBackendFn>(entry->entry[0])})
                         : new Result<AotiLibrary>(
                               Unavailable("backend: aoti needs " HEARTH_AOTI_BACKEND_LIBRARY
                                           ", which this hearth was built without (configure "
                                           "with -DHEARTH_TORCH=ON and a torch >= 2.6): " +
                                           entry.status().message()));
  });
  return *library;
}

Result<std::unique_ptr<Backend>> CreateAoti(const std::vector<TensorView>& weights, Device device,
                                            const BackendOptions& options) {
  ASSIGN_OR_RETURN(AotiLibrary lib, GetAotiLibrary());
  RETURN_IF_ERROR(CheckWeightsDevice(weights, device));
  const CArguments c(weights, options);
  auto specs = [](const std::vector<IoSpec>& list) {
    std::vector<HearthAotiSpec> out;
    for (const IoSpec& s : list)
      out.push_back({s.name.c_str(), static_cast<int32_t>(s.dtype),
                     static_cast<int32_t>(s.dims.size()), s.dims.data()});
    return out;
  };
  const std::vector<HearthAotiSpec> in = specs(options.inputs), out = specs(options.outputs);
  const std::string package = options.version_dir + "/model.pt2";
  HearthAotiOptions o{};
  o.common = c.options;
  o.package_path = package.c_str();
  o.inputs = in.data();
  o.num_inputs = in.size();
  o.outputs = out.data();
  o.num_outputs = out.size();
  o.batching = options.batching ? 1 : 0;
  void* backend = nullptr;
  std::array<char, 4096> error{};
  RETURN_IF_ERROR(FromC(lib.create(HEARTH_AOTI_BACKEND_ABI_VERSION, c.tensors.data(),
                                   c.tensors.size(), static_cast<int32_t>(device.kind),
                                   device.index, &o, &backend, error.data(), error.size()),
                        error));
  return std::unique_ptr<Backend>(static_cast<Backend*>(backend));
}

// The first of `candidates` that exists, else the last.
std::string FirstExisting(const std::vector<std::string>& candidates) {
  std::error_code ec;
  for (const std::string& c : candidates)
    if (std::filesystem::exists(c, ec)) return c;
  return candidates.back();
}

// backend: python runs the model's model.py in `<interpreter> -m
// hearth.backend_worker`, which speaks the worker protocol through
// libhearth's C ABI. The interpreter: parameters.python, else
// $HEARTH_PYTHON, else python3 from PATH.
Result<ProgramLaunch> PythonLaunch(const BackendOptions& options) {
  ProgramLaunch launch;
  std::string python = "python3";
  if (const char* env = std::getenv("HEARTH_PYTHON"); env != nullptr && *env != '\0') python = env;
  if (auto it = options.parameters.find("python"); it != options.parameters.end())
    python = it->second;
  if (python.empty()) return InvalidArgument("parameters.python is empty");
  if (python.find('/') != std::string::npos && ::access(python.c_str(), X_OK) != 0)
    return InvalidArgument("parameters.python: " + python + " is not an executable file (" +
                           std::strerror(errno) + ")");
  launch.argv = {python, "-m", "hearth.backend_worker"};
  // The package and the library of this installation, unless the
  // environment already names them.
  const std::string exe_dir = ExecutableDir();
  std::vector<std::string> packages = {exe_dir + "/../lib/hearth/python"};
#ifdef HEARTH_PYTHON_PACKAGE_DIR
  packages.emplace_back(HEARTH_PYTHON_PACKAGE_DIR);
#endif
  std::string path = FirstExisting(packages);
  if (const char* old = std::getenv("PYTHONPATH"); old != nullptr && *old != '\0')
    path += ":" + std::string(old);
  launch.env.push_back("PYTHONPATH=" + path);
  if (const char* lib = std::getenv("HEARTH_LIBRARY"); lib == nullptr || *lib == '\0') {
    std::vector<std::string> libs = {exe_dir + "/../lib/libhearth.so", exe_dir + "/libhearth.so"};
#ifdef HEARTH_CAPI_BUILD_PATH
    libs.emplace_back(HEARTH_CAPI_BUILD_PATH);
#endif
    launch.env.push_back("HEARTH_LIBRARY=" + FirstExisting(libs));
  }
  return launch;
}

Result<std::pair<std::vector<IoSpec>, std::vector<IoSpec>>> MlpSignature(
    const std::vector<TensorView>& weights) {
  ASSIGN_OR_RETURN(MlpWeights w, ValidateMlpWeights(weights));
  return std::pair{MlpInputs(w), MlpOutputs(w)};
}

Result<std::pair<std::vector<IoSpec>, std::vector<IoSpec>>> ScaleSignature(
    const std::vector<TensorView>& weights) {
  ASSIGN_OR_RETURN(ScaleWeights w, ValidateScaleWeights(weights));
  return std::pair{ScaleInputs(w), ScaleOutputs()};
}

}  // namespace

std::vector<BackendKind> BuiltinBackendKinds() {
  std::vector<BackendKind> kinds;
  for (const char* name : {"mlp", "scale"}) {
    BackendKind k;
    k.name = name;
    k.summary = std::string(name) == "mlp" ? "two-layer perceptron (CPU: OpenBLAS, GPU: CUDA)"
                                           : "weighted sum (CPU and GPU)";
    k.signature = std::string(name) == "mlp" ? MlpSignature : ScaleSignature;
    k.create = [kind = std::string(name)](const std::vector<TensorView>& weights, Device device,
                                          const BackendOptions& options) {
      return CreateBuiltin(kind, weights, device, options);
    };
    kinds.push_back(std::move(k));
  }
  BackendKind aoti;
  aoti.name = "aoti";
  aoti.summary = "an AOTInductor package (model.pt2) on libtorch, CPU or GPU";
  aoti.create = CreateAoti;
  aoti.preload = [] { (void)GetAotiLibrary(); };
  kinds.push_back(std::move(aoti));
  BackendKind count;
  count.name = "count";
  count.summary = "counts to a request's n, one number a response (decoupled models; tests)";
  count.create_engine = [](const std::vector<TensorView>& weights, Device device,
                           const EngineOptions& options) {
    // On a GPU, the CUDA library's (cuda/cuda_engines.cc), as any kind's.
    if (device.is_cuda()) return CreateCudaEngine("count", weights, device, options);
    return CreateCountEngine(options);
  };
  kinds.push_back(std::move(count));
  BackendKind llm;
  llm.name = "llm";
  llm.summary =
      "generates text from a Hugging Face Llama, Mistral or Qwen2 checkpoint (decoupled; "
      "continuous batching over a paged KV cache)";
  llm.create_engine = [](const std::vector<TensorView>& weights, Device device,
                         const EngineOptions& options) -> Result<std::unique_ptr<Engine>> {
    if (device.is_cuda()) return CreateCudaEngine("llm", weights, device, options);
    return llm::CreateLlmEngine(
        weights, options, /*on_gpu=*/false,
        [](const llm::ModelConfig& c, const llm::ModelWeights& w, const llm::ExecutorOptions& o) {
          return llm::CreateCpuExecutor(c, w, o);
        });
  };
  kinds.push_back(std::move(llm));
  BackendKind python;
  python.name = "python";
  python.summary = "the model's model.py in a Python interpreter";
  python.program = PythonLaunch;
  kinds.push_back(std::move(python));
  return kinds;
}

Result<std::unique_ptr<Backend>> CreateBackend(std::string_view kind,
                                               const std::vector<TensorView>& weights,
                                               Device device, const BackendOptions& options) {
  const BackendKind* k = FindBackendKind(kind);
  if (k == nullptr) return UnknownBackendKind(kind);
  if (k->program)
    return InvalidArgument("backend kind '" + std::string(kind) +
                           "' runs as its own program, not inside hearth-worker");
  if (!k->create)
    return FailedPrecondition("backend kind '" + std::string(kind) +
                              "' serves decoupled models only (model_transaction_policy: "
                              "{decoupled: true}): it has an engine, not a backend");
  // Validates the weights for both devices, before any GPU work.
  if (k->signature) RETURN_IF_ERROR(k->signature(weights).status());
  return k->create(weights, device, options);
}

Result<std::pair<std::vector<IoSpec>, std::vector<IoSpec>>> BackendSignature(
    std::string_view kind, const std::vector<TensorView>& weights) {
  const BackendKind* k = FindBackendKind(kind);
  if (k == nullptr) return UnknownBackendKind(kind);
  if (!k->signature)
    return InvalidArgument("backend kind '" + std::string(kind) +
                           "' has no signature without its config's inputs and outputs");
  return k->signature(weights);
}

Status RegisterHostMemory(Device device, void* data, uint64_t bytes) {
  if (!device.is_cuda()) return Status::Ok();
  ASSIGN_OR_RETURN(CudaLibrary lib, GetCudaLibrary());
  std::array<char, 1024> error{};
  return FromC(lib.host_register(HEARTH_CUDA_BACKEND_ABI_VERSION, device.index, data, bytes,
                                 error.data(), error.size()),
               error);
}

void PreloadDeviceLibrary(Device device) {
  if (device.is_cuda()) (void)GetCudaLibrary();
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
