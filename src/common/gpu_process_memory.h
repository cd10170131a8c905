// GpuProcessMemory: the device memory the NVIDIA driver accounts to each
// process on a GPU, as nvidia-smi lists it (NVML's
// nvmlDeviceGetComputeRunningProcesses): everything the process holds there,
// its CUDA context, library workspaces and caching allocator included, which
// is more than what a worker knows of its own buffers.
//
// hearth never links NVML: the same binary must run where there is no NVIDIA
// driver. LoadNvml() dlopens libnvidia-ml.so.1 and resolves the few entry
// points below; where it cannot, or NVML fails, every figure is unknown and
// callers report what they knew before.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <span>
#include <string>

#include "hearth/status.h"

namespace hearth {

// NVML's types and constants, written from NVIDIA's documented API (nvml.h,
// "NVML API Reference"), so that no NVML header is needed to build hearth.
namespace nvml {

using Return = int;                    // nvmlReturn_t, an enum
using Device = struct DeviceOpaque*;   // nvmlDevice_t, an opaque struct nvmlDevice_st*
inline constexpr Return kSuccess = 0;  // NVML_SUCCESS
inline constexpr Return kErrorInsufficientSize = 7;  // NVML_ERROR_INSUFFICIENT_SIZE
// usedGpuMemory when the driver does not have it (e.g. Windows WDDM).
inline constexpr unsigned long long kValueNotAvailable = ~0ULL;  // NVML_VALUE_NOT_AVAILABLE

// nvmlProcessInfo_v1_t, filled by nvmlDeviceGetComputeRunningProcesses (no
// suffix): { unsigned int pid; unsigned long long usedGpuMemory; }, 16 bytes
// on x86-64 and aarch64 (4 bytes of padding after pid).
struct ProcessInfoV1 {
  unsigned int pid;
  unsigned long long usedGpuMemory;
};
static_assert(sizeof(ProcessInfoV1) == 16);

// nvmlProcessInfo_v2_t, filled by nvmlDeviceGetComputeRunningProcesses_v2,
// and nvmlProcessInfo_t (the same four members in the same order) filled by
// _v3: { unsigned int pid; unsigned long long usedGpuMemory; unsigned int
// gpuInstanceId; unsigned int computeInstanceId; }, 24 bytes. The instance
// ids are 0xFFFFFFFF outside MIG.
struct ProcessInfoV2 {
  unsigned int pid;
  unsigned long long usedGpuMemory;
  unsigned int gpuInstanceId;
  unsigned int computeInstanceId;
};
static_assert(sizeof(ProcessInfoV2) == 24);

}  // namespace nvml

// The NVML entry points GpuProcessMemory calls; LoadNvml() fills them from
// the library, a test from fakes.
struct NvmlApi {
  std::function<nvml::Return()> init;  // nvmlInit_v2
  // nvmlDeviceGetHandleByPciBusId_v2 (or the unsuffixed one): the GPU at a
  // PCI bus id, "domain:bus:device.function" in hex.
  std::function<nvml::Return(const char*, nvml::Device*)> device_by_pci_bus_id;
  // One of the two: nvmlDeviceGetComputeRunningProcesses_v3 or _v2 where the
  // library has one, else the unsuffixed call (the v1 layout). Each takes
  // the array's length in *count and returns the number of processes there;
  // NVML_ERROR_INSUFFICIENT_SIZE with the number needed when it is too short.
  std::function<nvml::Return(nvml::Device, unsigned int*, nvml::ProcessInfoV2*)> processes;
  std::function<nvml::Return(nvml::Device, unsigned int*, nvml::ProcessInfoV1*)> processes_v1;
  std::function<const char*(nvml::Return)> error_string;  // nvmlErrorString; may be empty
  std::string processes_name;  // which of the calls `processes` is, for messages
};

// Opens `library` (dlopen, RTLD_LOCAL; kept loaded until exit, never closed)
// and resolves NvmlApi's entry points, each at the newest version it has.
// Unavailable saying why when the library cannot be loaded or lacks one.
// Does not call nvmlInit.
Result<NvmlApi> LoadNvml(const char* library = "libnvidia-ml.so.1");

// pid -> bytes of device memory the driver accounts to that process. The pids
// are as NVML gives them: those of the driver's PID namespace, which in a
// container without the host's PID namespace are not the container's.
using ProcessMemory = std::map<int64_t, uint64_t>;

struct GpuProcessMemoryOptions {
  // A GPU's list is read again once it is this old; older answers (errors
  // too) are kept until then, so that a scrape a second asks NVML once.
  std::chrono::milliseconds max_age{1000};
  // A younger list that lacks a process the caller expects there (one it
  // just started) is read again once it is this old: a new process is
  // listed within this, and a pid NVML never lists (another PID namespace)
  // costs at most one read per this interval.
  std::chrono::milliseconds missing_max_age{100};
  // The most processes one GPU's list may hold; more is an error.
  unsigned int max_processes = 4096;
  std::function<std::chrono::steady_clock::time_point()> now = std::chrono::steady_clock::now;
};

// Reads and caches the per-process lists of GPUs named by PCI bus id.
//
// Thread-safe: OnDevice may be called from any thread; calls are serialised
// (one NVML query at a time). The first call loads the API (`load`) and calls
// its init; a failure of either is kept: every later call answers it.
class GpuProcessMemory {
 public:
  explicit GpuProcessMemory(std::function<Result<NvmlApi>()> load,
                            GpuProcessMemoryOptions options = {});
  GpuProcessMemory(const GpuProcessMemory&) = delete;
  GpuProcessMemory& operator=(const GpuProcessMemory&) = delete;

  // The process-wide one over libnvidia-ml.so.1 (LoadNvml()); lives until exit.
  static GpuProcessMemory& Driver();

  // The processes on the GPU at `pci_bus_id` and the device memory of each,
  // read at most options.max_age ago, or options.missing_max_age where the
  // list read lacks one of `expected` (pids the caller has running there).
  // A process whose figure NVML does not have is left out. Unavailable
  // saying why where NVML cannot tell: no library, nvmlInit failed, no GPU
  // at that bus id, an NVML error, more than options.max_processes
  // processes.
  Result<ProcessMemory> OnDevice(const std::string& pci_bus_id,
                                 std::span<const int64_t> expected = {});

 private:
  struct Cached {
    std::chrono::steady_clock::time_point at;
    Result<ProcessMemory> memory;
  };
  Result<ProcessMemory> Read(const NvmlApi& api, const std::string& pci_bus_id) const;

  const std::function<Result<NvmlApi>()> load_;
  const GpuProcessMemoryOptions options_;
  std::mutex mu_;                        // guards the members below
  std::optional<Result<NvmlApi>> api_;   // set at the first call
  std::map<std::string, Cached> cache_;  // by PCI bus id
};

}  // namespace hearth
