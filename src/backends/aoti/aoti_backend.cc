// backend: aoti: an AOTInductor package (model.pt2, built with its constants
// left out of the .so) run by libtorch's AOTIModelPackageLoader, its
// constants bound without a copy to the store's read-only tensors
// (load_constants with user_managed = true).
//
// The package says what it takes and gives in its metadata (written by
// `python3 -m hearth.aoti export`): hearth.inputs, hearth.outputs,
// hearth.batch and hearth.constants (see python/hearth/aoti/__init__.py). A config
// that lists inputs and outputs must agree with them.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <sys/stat.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#ifdef HEARTH_TORCH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

#include <algorithm>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "backends/aoti/aoti_backend_abi.h"
#include "backends/backend.h"
#include "common/datatype.h"

namespace hearth {
namespace {

std::optional<at::ScalarType> ToTorch(DType d) {
  switch (d) {
    case DType::kF64:
      return at::kDouble;
    case DType::kF32:
      return at::kFloat;
    case DType::kF16:
      return at::kHalf;
    case DType::kBF16:
      return at::kBFloat16;
    case DType::kI64:
      return at::kLong;
    case DType::kI32:
      return at::kInt;
    case DType::kI16:
      return at::kShort;
    case DType::kI8:
      return at::kChar;
    case DType::kU8:
      return at::kByte;
    case DType::kU16:
      return at::kUInt16;
    case DType::kU32:
      return at::kUInt32;
    case DType::kU64:
      return at::kUInt64;
    case DType::kBool:
      return at::kBool;
    case DType::kF8E4M3:
      return at::kFloat8_e4m3fn;
    case DType::kF8E5M2:
      return at::kFloat8_e5m2;
    case DType::kBytes:
      return std::nullopt;
  }
  return std::nullopt;
}

std::string TorchName(int32_t scalar_type) {
  return c10::toString(static_cast<at::ScalarType>(scalar_type));
}

struct PackageInfo {
  std::vector<IoSpec> inputs, outputs;
  bool has_signature = false;
  bool dynamic = false;
  int64_t min_batch = 1, max_batch = 1;
  bool has_batch = false;
  // Name -> (dtype, shape), as the exporter recorded them.
  std::map<std::string, std::pair<DType, std::vector<int64_t>>> constants;
  bool has_constants = false;
};

Result<std::vector<IoSpec>> ParseSpecs(const nlohmann::json& list, const std::string& what) {
  if (!list.is_array()) return InvalidArgument(what + " is not a list");
  std::vector<IoSpec> specs;
  for (const auto& e : list) {
    if (!e.is_object() || !e.contains("name") || !e.contains("data_type") || !e.contains("dims"))
      return InvalidArgument(what + ": an entry without name, data_type and dims");
    IoSpec s;
    s.name = e["name"].get<std::string>();
    auto dtype = ParseTritonDataType(e["data_type"].get<std::string>());
    if (!dtype) return InvalidArgument(what + " '" + s.name + "': unknown data_type");
    s.dtype = *dtype;
    s.dims = e["dims"].get<std::vector<int64_t>>();
    specs.push_back(std::move(s));
  }
  return specs;
}

Result<PackageInfo> ReadPackageInfo(const std::unordered_map<std::string, std::string>& md,
                                    const std::string& path) {
  PackageInfo info;
  auto json = [&](const char* key) -> Result<std::optional<nlohmann::json>> {
    auto it = md.find(key);
    if (it == md.end()) return std::optional<nlohmann::json>();
    auto j = nlohmann::json::parse(it->second, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) return InvalidArgument(path + ": metadata " + key + " is not JSON");
    return std::optional<nlohmann::json>(std::move(j));
  };
  try {
    if (auto it = md.find("hearth.format"); it != md.end() && it->second != "1")
      return InvalidArgument(path + ": hearth.format " + it->second +
                             " is not one this build reads (1)");
    ASSIGN_OR_RETURN(auto in, json("hearth.inputs"));
    ASSIGN_OR_RETURN(auto out, json("hearth.outputs"));
    if (in && out) {
      ASSIGN_OR_RETURN(info.inputs, ParseSpecs(*in, path + ": hearth.inputs"));
      ASSIGN_OR_RETURN(info.outputs, ParseSpecs(*out, path + ": hearth.outputs"));
      info.has_signature = true;
    }
    ASSIGN_OR_RETURN(auto batch, json("hearth.batch"));
    if (batch) {
      info.dynamic = batch->value("dynamic", false);
      info.min_batch = batch->value("min", int64_t{1});
      info.max_batch = batch->value("max", int64_t{1});
      info.has_batch = true;
    }
    ASSIGN_OR_RETURN(auto constants, json("hearth.constants"));
    if (constants) {
      if (!constants->is_object()) return InvalidArgument(path + ": hearth.constants is no map");
      for (const auto& [name, e] : constants->items()) {
        auto dtype = ParseDType(e.at("dtype").get<std::string>());
        if (!dtype) return InvalidArgument(path + ": constant '" + name + "': unknown dtype");
        info.constants[name] = {*dtype, e.at("shape").get<std::vector<int64_t>>()};
      }
      info.has_constants = true;
    }
  } catch (const nlohmann::json::exception& e) {
    return InvalidArgument(path + ": malformed hearth metadata: " + e.what());
  }
  return info;
}

std::string Names(const std::vector<IoSpec>& specs) {
  std::string s;
  for (const IoSpec& t : specs) s += (s.empty() ? "" : ", ") + Describe(t);
  return s.empty() ? "none" : s;
}

class AotiBackend final : public Backend {
 public:
  AotiBackend(std::unique_ptr<torch::inductor::AOTIModelPackageLoader> loader,
              std::unordered_map<std::string, at::Tensor> constants, std::vector<IoSpec> inputs,
              std::vector<IoSpec> outputs, at::Device device, bool batching)
      : loader_(std::move(loader)),
        constants_(std::move(constants)),
        inputs_(std::move(inputs)),
        outputs_(std::move(outputs)),
        device_(device),
        batching_(batching) {}

  const std::vector<IoSpec>& inputs() const override { return inputs_; }
  const std::vector<IoSpec>& outputs() const override { return outputs_; }
  uint64_t device_memory_bytes() const override { return device_bytes_; }
#ifdef HEARTH_TORCH_CUDA
  // A device input is given to the package as it is; a device output is
  // filled by a device-to-device copy.
  bool takes_device_addresses() const override { return device_.is_cuda(); }
#endif

  // Runs the largest batch once on zeros, so that the first request does not
  // pay for the package's lazy set-up, and records what the package's own
  // buffers (libtorch's caching allocator) hold on the device.
  Status WarmUp(int64_t max_rows) {
    try {
      std::vector<at::Tensor> args;
      for (const IoSpec& s : inputs_)
        args.push_back(at::zeros(Shape(s, max_rows),
                                 at::TensorOptions().dtype(*ToTorch(s.dtype)).device(device_)));
      std::vector<at::Tensor> results = loader_->run(args);
      for (at::Tensor& r : results) (void)r.cpu();
#ifdef HEARTH_TORCH_CUDA
      if (device_.is_cuda()) {
        const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device_.index());
        device_bytes_ = static_cast<uint64_t>(
            stats.reserved_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)]
                .current);
      }
#endif
      return Status::Ok();
    } catch (const std::exception& e) {
      return FromException("a first run on zeros of " + std::to_string(max_rows) + " rows", e);
    }
  }

  // Fault injection's cuda_illegal_address: a write far outside any
  // allocation, queued on the package's device; the batch's Run then meets
  // the sticky error as it would meet one from the package's own kernels.
  Status InjectDeviceFault() override {
    if (!device_.is_cuda()) return Backend::InjectDeviceFault();
    try {
      at::for_blob(reinterpret_cast<void*>(uintptr_t{1} << 46), {1024})
          .options(at::TensorOptions().dtype(at::kFloat).device(device_))
          .target_device(device_)
          .make_tensor()
          .fill_(1.0F);
      return Status::Ok();
    } catch (const std::exception& e) {
      return FromException("fault injection", e);
    }
  }

  // A device address (a client's CUDA shared-memory region, or the
  // worker's staging), as opposed to the slot's host memory.
  // Its GPU, or nullopt for host memory.
  std::optional<at::Device> OnDevice(const void* p) const {
#ifdef HEARTH_TORCH_CUDA
    if (!device_.is_cuda()) return std::nullopt;
    cudaPointerAttributes a{};
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
      (void)cudaGetLastError();  // not sticky: clear it
      return std::nullopt;
    }
    if (a.type != cudaMemoryTypeDevice) return std::nullopt;
    return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(a.device));
#else
    (void)p;
    return std::nullopt;
#endif
  }

  Status Run(int64_t batch, std::span<const void* const> in, std::span<void* const> out) override {
    try {
      std::vector<at::Tensor> args;
      args.reserve(inputs_.size());
      for (size_t i = 0; i < inputs_.size(); ++i) {
        const auto options = at::TensorOptions().dtype(*ToTorch(inputs_[i].dtype));
        if (const auto on = OnDevice(in[i])) {
          // On the package's GPU: used where it lies; on another: copied over.
          auto t = at::from_blob(const_cast<void*>(in[i]), Shape(inputs_[i], batch),
                                 options.device(*on));
          args.push_back(*on == device_ ? t : t.to(device_, /*non_blocking=*/true));
          continue;
        }
        auto host = at::from_blob(const_cast<void*>(in[i]), Shape(inputs_[i], batch), options);
        // The slot is page-locked on a GPU (hearth-worker registers it), so
        // the copy is a DMA; the package's kernels follow it on the stream.
        args.push_back(device_.is_cuda() ? host.to(device_, /*non_blocking=*/true) : host);
      }
      std::vector<at::Tensor> results = loader_->run(args);
      std::vector<at::Device> synced;  // whose streams a device output's copy is on
      if (results.size() != outputs_.size())
        return Internal("the package gave " + std::to_string(results.size()) + " outputs, not " +
                        std::to_string(outputs_.size()));
      for (size_t i = 0; i < outputs_.size(); ++i) {
        const std::vector<int64_t> shape = Shape(outputs_[i], batch);
        const at::Tensor& r = results[i];
        if (r.sizes().vec() != shape || r.scalar_type() != *ToTorch(outputs_[i].dtype))
          return InvalidArgument("output " + Describe(outputs_[i]) + ": the package gave " +
                                 std::string(c10::toString(r.scalar_type())) + " " +
                                 ShapeString(r.sizes().vec()));
        auto options = at::TensorOptions().dtype(r.scalar_type());
        if (const auto on = OnDevice(out[i])) {
          options = options.device(*on);
          if (*on != device_) synced.push_back(*on);
        }
        at::from_blob(out[i], shape, options).copy_(r);
      }
#ifdef HEARTH_TORCH_CUDA
      // Copies into device outputs are queued on streams: done before the
      // batch is answered.
      if (device_.is_cuda()) synced.push_back(device_);
      for (const at::Device& d : synced) c10::cuda::getCurrentCUDAStream(d.index()).synchronize();
#endif
      return Status::Ok();
    } catch (const std::exception& e) {
      return FromException("the package", e);
    }
  }

 private:
  // A kernel that faulted leaves the CUDA context unusable (every later call
  // fails): then the worker must go. Whether it did is asked of the device,
  // not read from the message.
  Status FromException(const std::string& what, const std::exception& e) const {
    const std::string message = e.what();
    if (device_.is_cuda() && !DeviceUsable())
      return DeviceLost(what + ": " + message.substr(0, message.find('\n')));
    return Internal(what + " failed: " + message.substr(0, 2000));
  }

  bool DeviceUsable() const {
    try {
      (void)at::zeros({1}, at::TensorOptions().device(device_)).cpu();
      return true;
    } catch (const std::exception&) {
      return false;
    }
  }

  std::vector<int64_t> Shape(const IoSpec& spec, int64_t batch) const {
    std::vector<int64_t> shape;
    if (batching_) shape.push_back(batch);
    shape.insert(shape.end(), spec.dims.begin(), spec.dims.end());
    return shape;
  }

  std::unique_ptr<torch::inductor::AOTIModelPackageLoader> loader_;
  // What the package's constants point to (views of the store's tensors);
  // held for as long as the package runs.
  std::unordered_map<std::string, at::Tensor> constants_;
  std::vector<IoSpec> inputs_, outputs_;
  at::Device device_;
  bool batching_;
  uint64_t device_bytes_ = 0;
};

std::vector<IoSpec> FromC(const HearthAotiSpec* specs, size_t n) {
  std::vector<IoSpec> out;
  for (size_t i = 0; i < n; ++i)
    out.push_back({specs[i].name, static_cast<DType>(specs[i].dtype),
                   std::vector<int64_t>(specs[i].dims, specs[i].dims + specs[i].rank)});
  return out;
}

Result<std::unique_ptr<Backend>> Create(const HearthCudaTensor* weights, size_t num_weights,
                                        int32_t device_kind, int32_t device_index,
                                        const HearthAotiOptions& o) {
  const std::string path = o.package_path;
  const bool cuda = device_kind == static_cast<int32_t>(DeviceKind::kCuda);
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode))
    return NotFound(path +
                    ": no AOTInductor package (backend: aoti runs model.pt2; make one with "
                    "python3 -m hearth.aoti export)");
  std::unique_ptr<torch::inductor::AOTIModelPackageLoader> loader;
  try {
    loader = std::make_unique<torch::inductor::AOTIModelPackageLoader>(
        path, "model", /*run_single_threaded=*/false, /*num_runners=*/1,
        cuda ? static_cast<c10::DeviceIndex>(device_index) : static_cast<c10::DeviceIndex>(-1));
  } catch (const std::exception& e) {
    return InvalidArgument(
        path + ": libtorch cannot load the package: " + std::string(e.what()).substr(0, 2000));
  }
  ASSIGN_OR_RETURN(PackageInfo info, ReadPackageInfo(loader->get_metadata(), path));

  // The signature: the config's, which must agree with the package's.
  std::vector<IoSpec> inputs = FromC(o.inputs, o.num_inputs);
  std::vector<IoSpec> outputs = FromC(o.outputs, o.num_outputs);
  if (inputs.empty() && outputs.empty()) {
    if (!info.has_signature)
      return InvalidArgument(path +
                             ": the package records no inputs and outputs (hearth.inputs, "
                             "hearth.outputs) and the config lists none");
    inputs = info.inputs;
    outputs = info.outputs;
  } else if (info.has_signature && (inputs != info.inputs || outputs != info.outputs)) {
    return InvalidArgument("the config lists inputs " + Names(inputs) + " and outputs " +
                           Names(outputs) + "; " + path + " takes " + Names(info.inputs) +
                           " and gives " + Names(info.outputs));
  }
  for (const auto* specs : {&inputs, &outputs}) {
    for (const IoSpec& s : *specs) {
      if (!s.fixed_size() || !ToTorch(s.dtype))
        return InvalidArgument(Describe(s) +
                               ": the aoti backend takes fixed dims beyond the batch dimension and "
                               "numeric types");
    }
  }
  // Every batch size the server may send must be one the package was built for.
  const int64_t max_rows = o.common.max_batch_size;
  if (info.has_batch && o.batching) {
    if (!info.dynamic && info.max_batch != max_rows)
      return InvalidArgument("the config's max_batch_size is " + std::to_string(max_rows) +
                             " but " + path + " was exported for batches of " +
                             std::to_string(info.max_batch) +
                             " only (export it with "
                             "--dynamic-batch 1.." +
                             std::to_string(max_rows) + ")");
    if (info.dynamic && (info.min_batch > 1 || info.max_batch < max_rows))
      return InvalidArgument("the config's max_batch_size " + std::to_string(max_rows) +
                             " is outside " + path + "'s batch range [" +
                             std::to_string(info.min_batch) + ", " +
                             std::to_string(info.max_batch) + "] (batches of 1 to " +
                             std::to_string(max_rows) + " rows are sent)");
  }

  // The constants: exactly the store's tensors, names, dtypes and shapes;
  // every difference is listed.
  std::vector<std::string> fqns;
  std::unordered_map<std::string, int32_t> dtypes;  // by fqn
  try {
    fqns = loader->get_constant_fqns();
    auto* runner = loader->get_runner();
    const auto to_fqn = runner->getConstantNamesToOriginalFQNs();
    for (const auto& [internal, dtype] : runner->getConstantNamesToDtypes()) {
      auto it = to_fqn.find(internal);
      dtypes[it != to_fqn.end() ? it->second : internal] = dtype;
    }
  } catch (const std::exception& e) {
    return Internal(path + ": reading the package's constants: " + std::string(e.what()));
  }
  std::map<std::string, const HearthCudaTensor*> store;
  for (size_t i = 0; i < num_weights; ++i) store[weights[i].name] = &weights[i];
  std::vector<std::string> problems;
  std::set<std::string> wanted(fqns.begin(), fqns.end());
  for (const std::string& name : wanted) {
    auto it = store.find(name);
    if (it == store.end()) {
      problems.push_back("'" + name + "' is missing from the store");
      continue;
    }
    const HearthCudaTensor& t = *it->second;
    const DType dtype = static_cast<DType>(t.dtype);
    if (auto d = dtypes.find(name);
        d != dtypes.end() && ToTorch(dtype) && static_cast<int32_t>(*ToTorch(dtype)) != d->second)
      problems.push_back("'" + name + "' is " + std::string(DTypeName(dtype)) + " in the store, " +
                         TorchName(d->second) + " in the package");
    const std::vector<int64_t> shape(t.shape, t.shape + t.rank);
    if (auto c = info.constants.find(name); c != info.constants.end() && c->second.second != shape)
      problems.push_back("'" + name + "' has shape " + ShapeString(shape) + " in the store, " +
                         ShapeString(c->second.second) + " in the package");
  }
  for (const auto& [name, t] : store)
    if (!wanted.count(name)) problems.push_back("'" + name + "' is in the store, not the package");
  if (!problems.empty()) {
    std::string text;
    for (size_t i = 0; i < problems.size() && i < 64; ++i) text += (i ? "; " : "") + problems[i];
    if (problems.size() > 64) text += "; and " + std::to_string(problems.size() - 64) + " more";
    return InvalidArgument("the store's tensors are not " + path + "'s constants: " + text);
  }
  const at::Device device = cuda
                                ? at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device_index))
                                : at::Device(at::kCPU);
  std::unordered_map<std::string, at::Tensor> constants;
  for (const std::string& name : wanted) {
    const HearthCudaTensor& t = *store[name];
    auto dtype = ToTorch(static_cast<DType>(t.dtype));
    if (!dtype) return InvalidArgument("'" + name + "': a dtype libtorch has no name for");
    constants[name] =
        at::from_blob(const_cast<void*>(t.data), std::vector<int64_t>(t.shape, t.shape + t.rank),
                      at::TensorOptions().dtype(*dtype).device(device));
  }
  try {
    // user_managed: the package uses these tensors' memory as it is, the
    // store's read-only mapping: no copy, no device memory of its own.
    loader->load_constants(constants, /*use_inactive=*/false, /*check_full_update=*/true,
                           /*user_managed=*/true);
  } catch (const std::exception& e) {
    return InvalidArgument(
        path + ": binding the store's tensors: " + std::string(e.what()).substr(0, 2000));
  }
  auto backend =
      std::make_unique<AotiBackend>(std::move(loader), std::move(constants), std::move(inputs),
                                    std::move(outputs), device, o.batching != 0);
  RETURN_IF_ERROR(backend->WarmUp(o.batching != 0 ? std::max<int64_t>(max_rows, 1) : 1));
  return std::unique_ptr<Backend>(std::move(backend));
}

int Report(const Status& s, char* error, size_t error_size) {
  if (s.ok()) return 0;
  if (error != nullptr && error_size > 0) {
    const size_t n = std::min(s.message().size(), error_size - 1);
    std::memcpy(error, s.message().data(), n);
    error[n] = '\0';
  }
  return static_cast<int>(s.code());
}

}  // namespace
}  // namespace hearth

extern "C" __attribute__((visibility("default"))) int hearth_create_aoti_backend(
    uint32_t abi_version, const HearthCudaTensor* weights, size_t num_weights, int32_t device_kind,
    int32_t device_index, const HearthAotiOptions* options, void** backend, char* error,
    size_t error_size) {
  using namespace hearth;
  try {
    if (abi_version != HEARTH_AOTI_BACKEND_ABI_VERSION)
      return Report(FailedPrecondition(HEARTH_AOTI_BACKEND_LIBRARY " is from another build"), error,
                    error_size);
    auto made = Create(weights, num_weights, device_kind, device_index, *options);
    if (!made.ok()) return Report(made.status(), error, error_size);
    *backend = made->release();
    return 0;
  } catch (const std::exception& e) {
    return Report(Internal(std::string("creating the aoti backend: ") + e.what()), error,
                  error_size);
  } catch (...) {
    return Report(Internal("creating the aoti backend: unknown exception"), error, error_size);
  }
}
