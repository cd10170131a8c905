#include "backends/plugin.h"

#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <filesystem>

#include "backends/c_engine.h"

namespace hearth {

std::string ExecutableDir() {
  std::error_code ec;
  return std::filesystem::read_symlink("/proc/self/exe", ec).parent_path().string();
}

Result<Plugin> OpenPlugin(const std::string& name, const char* build_path,
                          const std::vector<const char*>& symbols) {
  std::vector<std::string> candidates;
  if (const std::string dir = ExecutableDir(); !dir.empty()) candidates.push_back(dir + "/" + name);
  std::error_code ec;
  if (build_path != nullptr) candidates.emplace_back(build_path);
  candidates.push_back(name);

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
    std::vector<void*> found;
    for (const char* symbol : symbols) found.push_back(dlsym(handle, symbol));
    if (std::find(found.begin(), found.end(), nullptr) != found.end()) {
      errors += (errors.empty() ? "" : "; ") + path + ": missing hearth entry points";
      dlclose(handle);
      continue;
    }
    Plugin plugin;
    plugin.name = name;
    plugin.path = path;
    plugin.entry = std::move(found);
    plugin.create_engine =
        reinterpret_cast<HearthCreateEngineFn>(dlsym(handle, HEARTH_CREATE_ENGINE));
    return plugin;
  }
  return Unavailable("cannot load " + name + ": " +
                     (errors.empty() ? std::string("not found") : errors));
}

CArguments::CArguments(const std::vector<TensorView>& weights, const BackendOptions& o) {
  tensors.reserve(weights.size());
  for (const TensorView& t : weights) {
    tensors.push_back({t.name.c_str(), static_cast<int32_t>(t.dtype),
                       static_cast<int32_t>(t.shape.size()), t.shape.data(), t.data, t.nbytes,
                       static_cast<int32_t>(t.device.kind), t.device.index});
  }
  for (const auto& [k, v] : o.parameters) {
    keys.push_back(k.c_str());
    values.push_back(v.c_str());
  }
  options = {o.max_batch_size, o.allow_tf32 ? 1 : 0, keys.size(), keys.data(), values.data()};
}

Result<std::unique_ptr<Engine>> CreatePluginEngine(const Plugin& plugin, std::string_view kind,
                                                   const std::vector<TensorView>& weights,
                                                   Device device, const EngineOptions& options) {
  if (plugin.create_engine == nullptr)
    return FailedPrecondition("backend kind '" + std::string(kind) + "' has no engine on " +
                              device.ToString() + ": " + plugin.path + " exports no " +
                              HEARTH_CREATE_ENGINE + " (it serves batches only)");
  const CArguments c(weights, options);
  HearthEngineOptions o{};
  o.common = c.options;
  o.version_dir = options.version_dir.c_str();
  o.batching = options.batching ? 1 : 0;
  o.max_streams = options.max_streams;
  const std::vector<HearthEngineSpec> inputs = EngineSpecs(options.inputs);
  const std::vector<HearthEngineSpec> outputs = EngineSpecs(options.outputs);
  o.inputs = inputs.data();
  o.num_inputs = inputs.size();
  o.outputs = outputs.data();
  o.num_outputs = outputs.size();
  const std::string c_kind(kind);
  const HearthEngineTable* table = nullptr;
  void* engine = nullptr;
  std::array<char, 4096> error{};
  const int code =
      plugin.create_engine(HEARTH_ENGINE_ABI_VERSION, c_kind.c_str(), c.tensors.data(),
                           c.tensors.size(), static_cast<int32_t>(device.kind), device.index, &o,
                           &table, &engine, error.data(), error.size());
  if (code != 0)
    return Status(static_cast<StatusCode>(code),
                  std::string(error.data(), strnlen(error.data(), error.size())));
  return WrapCEngine(table, engine);
}

}  // namespace hearth
