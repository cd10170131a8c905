// What the NVIDIA driver accounts to the served models' worker processes
// and hot spares on their GPUs (common/gpu_process_memory.h: as nvidia-smi
// lists it, CUDA contexts included), for /metrics and GET /v2/hearth/workers.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "common/gpu_process_memory.h"
#include "server/inference_api.h"

namespace hearth {

struct ModelRuntime;

// One reading, for the devices of some placements.
struct DriverMemory {
  // By placement device name ("cuda:N"), where NVML answered for that GPU:
  // the device memory the driver accounts to each process there.
  std::map<std::string, ProcessMemory> by_device;

  // What the driver accounts to `pid` on `device`; nullopt where NVML did not
  // answer for that device (a host placement, no NVIDIA driver, an NVML
  // error) or does not list the pid (its pids are of another PID namespace,
  // as in a container without the host's).
  std::optional<uint64_t> Of(const std::string& device, int64_t pid) const;
  // NVML answered for at least one device.
  bool answered() const { return !by_device.empty(); }
};

// Reads it for the GPUs of `runtimes`' placements on CUDA devices: one list
// per GPU, found by PCI bus id (CudaDevicePciBusId), from
// GpuProcessMemory::Driver() (a GPU's list is at most a second old). Empty
// where no placement is on a GPU, or NVML answers for none.
DriverMemory ReadDriverMemory(const std::vector<const ModelRuntime*>& runtimes);

// The device memory of hot spares on `device`: per spare, the driver's figure
// where it has one, else what the spare reported of its own buffers.
uint64_t HotSpareDeviceMemory(const DriverMemory& driver, const std::string& device,
                              const std::vector<HotSpareInfo>& spares);

}  // namespace hearth
