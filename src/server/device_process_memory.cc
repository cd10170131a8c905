#include "server/device_process_memory.h"

#include <set>

#include "hearth/arena.h"
#include "server/model_runtime.h"

namespace hearth {

std::optional<uint64_t> DriverMemory::Of(const std::string& device, int64_t pid) const {
  auto d = by_device.find(device);
  if (d == by_device.end()) return std::nullopt;
  auto p = d->second.find(pid);
  if (p == d->second.end()) return std::nullopt;
  return p->second;
}

namespace {

// The pids of the ready workers and hot spares of `runtimes`' placements on
// `device`: processes that have made their CUDA context there.
std::vector<int64_t> ReadyPidsOn(const std::vector<const ModelRuntime*>& runtimes,
                                 const std::string& device) {
  std::vector<int64_t> pids;
  for (const ModelRuntime* m : runtimes) {
    for (const auto& w : m->workers) {
      if (w->placement().device_name == device && w->ready() && w->pid() > 0)
        pids.push_back(w->pid());
    }
    for (const auto& p : m->placements) {
      if (p->device_name != device || p->hot_spares == nullptr) continue;
      for (const HotSpareInfo& s : p->hot_spares->Describe())
        if (s.pid > 0) pids.push_back(s.pid);
    }
  }
  return pids;
}

}  // namespace

DriverMemory ReadDriverMemory(const std::vector<const ModelRuntime*>& runtimes) {
  DriverMemory out;
  std::set<std::string> asked;  // device names
  for (const ModelRuntime* m : runtimes) {
    for (const auto& p : m->placements) {
      if (!p->memory.is_cuda() || !asked.insert(p->device_name).second) continue;
      Result<std::string> bus_id = CudaDevicePciBusId(p->memory.index);
      if (!bus_id.ok()) continue;
      // Its errors are logged where they are read, once. A list read before
      // a ready worker or spare of ours made its context is read again.
      const std::vector<int64_t> expected = ReadyPidsOn(runtimes, p->device_name);
      Result<ProcessMemory> memory = GpuProcessMemory::Driver().OnDevice(*bus_id, expected);
      if (!memory.ok()) continue;
      out.by_device[p->device_name] = std::move(memory).value();
    }
  }
  return out;
}

uint64_t HotSpareDeviceMemory(const DriverMemory& driver, const std::string& device,
                              const std::vector<HotSpareInfo>& spares) {
  uint64_t bytes = 0;
  for (const HotSpareInfo& s : spares)
    bytes += driver.Of(device, s.pid).value_or(s.device_memory_bytes);
  return bytes;
}

}  // namespace hearth
