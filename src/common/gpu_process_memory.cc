#include "common/gpu_process_memory.h"

#include <dlfcn.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

namespace hearth {
namespace {

// The C signatures of the entry points, as nvml.h declares them.
using InitFn = nvml::Return (*)();
using DeviceByPciBusIdFn = nvml::Return (*)(const char*, nvml::Device*);
using ProcessesFn = nvml::Return (*)(nvml::Device, unsigned int*, nvml::ProcessInfoV2*);
using ProcessesV1Fn = nvml::Return (*)(nvml::Device, unsigned int*, nvml::ProcessInfoV1*);
using ErrorStringFn = const char* (*)(nvml::Return);

// The first list read leaves room for this many processes.
constexpr unsigned int kFirstCapacity = 32;
// Lists that grow between the call that sized them and the next: tries.
constexpr int kAttempts = 4;

std::string ErrorText(const NvmlApi& api, nvml::Return code) {
  std::string text = "NVML error " + std::to_string(code);
  if (api.error_string) {
    const char* what = api.error_string(code);
    if (what != nullptr) text += std::string(" (") + what + ")";
  }
  return text;
}

// Reads one GPU's list with `call`, into an array grown as NVML asks, up to
// `limit` entries; sums the entries of a pid (one per MIG instance it uses).
template <typename Info, typename Call>
Result<ProcessMemory> ReadList(const NvmlApi& api, const Call& call, nvml::Device device,
                               unsigned int limit, const std::string& what) {
  std::vector<Info> infos(std::min(kFirstCapacity, limit));
  for (int attempt = 0; attempt < kAttempts; ++attempt) {
    unsigned int count = static_cast<unsigned int>(infos.size());
    const nvml::Return r = call(device, &count, infos.data());
    if (r == nvml::kSuccess) {
      if (count > infos.size())
        return Unavailable(what + " reported " + std::to_string(count) +
                           " processes in an array of " + std::to_string(infos.size()));
      ProcessMemory out;
      for (unsigned int i = 0; i < count; ++i)
        if (infos[i].usedGpuMemory != nvml::kValueNotAvailable)
          out[infos[i].pid] += infos[i].usedGpuMemory;
      return out;
    }
    if (r != nvml::kErrorInsufficientSize) return Unavailable(what + ": " + ErrorText(api, r));
    if (count > limit)
      return Unavailable(what + ": " + std::to_string(count) +
                         " processes, more than the limit of " + std::to_string(limit));
    // Room for what NVML needs now and for processes that start before the
    // next call.
    const size_t want = std::max<size_t>(infos.size() * 2, size_t{count} + 8);
    infos.resize(std::min<size_t>(want, limit));
  }
  return Unavailable(what + ": the list of processes grew at each of " + std::to_string(kAttempts) +
                     " reads");
}

}  // namespace

Result<NvmlApi> LoadNvml(const char* library) {
  void* lib = ::dlopen(library, RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* error = ::dlerror();
    return Unavailable(std::string(library) + " cannot be loaded (" +
                       (error != nullptr ? error : "dlopen failed") + "): no NVIDIA driver here");
  }
  // The first of `names` the library has, or nullptr.
  auto resolve = [lib](std::initializer_list<const char*> names, const char** found = nullptr) {
    for (const char* name : names) {
      if (void* f = ::dlsym(lib, name)) {
        if (found != nullptr) *found = name;
        return f;
      }
    }
    return static_cast<void*>(nullptr);
  };
  NvmlApi api;
  std::string missing;
  if (void* f = resolve({"nvmlInit_v2"}))
    api.init = reinterpret_cast<InitFn>(f);
  else
    missing += " nvmlInit_v2";
  if (void* f = resolve({"nvmlDeviceGetHandleByPciBusId_v2", "nvmlDeviceGetHandleByPciBusId"}))
    api.device_by_pci_bus_id = reinterpret_cast<DeviceByPciBusIdFn>(f);
  else
    missing += " nvmlDeviceGetHandleByPciBusId";
  const char* name = nullptr;
  if (void* f = resolve(
          {"nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2"},
          &name)) {
    api.processes = reinterpret_cast<ProcessesFn>(f);
    api.processes_name = name;
  } else if (void* v1 = resolve({"nvmlDeviceGetComputeRunningProcesses"})) {
    api.processes_v1 = reinterpret_cast<ProcessesV1Fn>(v1);
    api.processes_name = "nvmlDeviceGetComputeRunningProcesses";
  } else {
    missing += " nvmlDeviceGetComputeRunningProcesses";
  }
  if (void* f = resolve({"nvmlErrorString"})) api.error_string = reinterpret_cast<ErrorStringFn>(f);
  if (!missing.empty()) {
    ::dlclose(lib);
    return Unavailable(std::string(library) + " lacks" + missing);
  }
  // `lib` stays open until exit: the pointers above point into it.
  return api;
}

GpuProcessMemory::GpuProcessMemory(std::function<Result<NvmlApi>()> load,
                                   GpuProcessMemoryOptions options)
    : load_(std::move(load)), options_(std::move(options)) {}

GpuProcessMemory& GpuProcessMemory::Driver() {
  // Never destroyed: a thread may still ask while the process exits.
  static GpuProcessMemory* driver = new GpuProcessMemory([] { return LoadNvml(); });
  return *driver;
}

Result<ProcessMemory> GpuProcessMemory::OnDevice(const std::string& pci_bus_id,
                                                 std::span<const int64_t> expected) {
  std::lock_guard lock(mu_);
  if (!api_.has_value()) {
    Result<NvmlApi> api = load_();
    if (api.ok()) {
      if (const nvml::Return r = api->init(); r != nvml::kSuccess)
        api = Unavailable("nvmlInit_v2 failed: " + ErrorText(*api, r));
    }
    if (api.ok())
      spdlog::debug("NVML loaded: per-process device memory from {}", api->processes_name);
    else
      spdlog::info("no per-process device memory from the NVIDIA driver: {}",
                   api.status().message());
    api_ = std::move(api);
  }
  if (!api_->ok()) return api_->status();

  const auto now = options_.now();
  auto it = cache_.find(pci_bus_id);
  if (it != cache_.end() && now - it->second.at < options_.max_age) {
    const Result<ProcessMemory>& kept = it->second.memory;
    const bool lacks = kept.ok() && std::any_of(expected.begin(), expected.end(),
                                                [&](int64_t pid) { return !kept->contains(pid); });
    if (!lacks || now - it->second.at < options_.missing_max_age) return kept;
  }
  Result<ProcessMemory> memory = Read(**api_, pci_bus_id);
  // Said once when a GPU's list turns unreadable, or fails another way.
  if (!memory.ok() && (it == cache_.end() || it->second.memory.ok() ||
                       it->second.memory.status().message() != memory.status().message()))
    spdlog::warn("device memory per process on the GPU at {} is unknown: {}", pci_bus_id,
                 memory.status().message());
  cache_.insert_or_assign(pci_bus_id, Cached{now, memory});
  return memory;
}

Result<ProcessMemory> GpuProcessMemory::Read(const NvmlApi& api,
                                             const std::string& pci_bus_id) const {
  nvml::Device device = nullptr;
  if (const nvml::Return r = api.device_by_pci_bus_id(pci_bus_id.c_str(), &device);
      r != nvml::kSuccess)
    return Unavailable("no NVML device at PCI bus id " + pci_bus_id + ": " + ErrorText(api, r));
  const std::string what = api.processes_name + " of the GPU at " + pci_bus_id;
  if (api.processes)
    return ReadList<nvml::ProcessInfoV2>(api, api.processes, device, options_.max_processes, what);
  return ReadList<nvml::ProcessInfoV1>(api, api.processes_v1, device, options_.max_processes, what);
}

}  // namespace hearth
