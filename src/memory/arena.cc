// PackOffsets, CudaAvailable / DefaultDevice, and the dispatch of
// Arena::Create and ArenaMapping::Map on the device kind.
#include "hearth/arena.h"

#include <cstdio>
#include <string>

#include "memory/arena_kinds.h"
#include "platform/section.h"

#if HEARTH_HAVE_CUDA
#include "memory/cuda_driver.h"
#endif

namespace hearth {
namespace {

#if HEARTH_HAVE_CUDA
// Empty when CUDA devices can be used, else why not.
std::string ProbeCuda() {
  Result<const CudaDriver*> cu = CudaDriver::Get();
  if (!cu.ok()) return cu.status().message();
  int count = 0;
  Status status = CuCheck(**cu, (*cu)->DeviceGetCount(&count), "cuDeviceGetCount");
  if (!status.ok()) return status.message();
  if (count <= 0) return "the NVIDIA driver reports no CUDA device (check CUDA_VISIBLE_DEVICES)";
  return {};
}
#endif

}  // namespace

Result<std::vector<uint64_t>> PackOffsets(const std::vector<uint64_t>& sizes, uint64_t alignment,
                                          uint64_t* total) {
  if (alignment == 0 || (alignment & (alignment - 1)) != 0) {
    return InvalidArgument("alignment " + std::to_string(alignment) + " is not a power of two");
  }
  std::vector<uint64_t> offsets;
  offsets.reserve(sizes.size());
  uint64_t end = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    uint64_t offset = 0;
    if (!AlignUp(end, alignment, &offset) || sizes[i] > UINT64_MAX - offset) {
      return InvalidArgument("packing " + std::to_string(sizes.size()) +
                             " regions overflows 64 bits at region " + std::to_string(i) +
                             " (size " + std::to_string(sizes[i]) + ")");
    }
    offsets.push_back(offset);
    end = offset + sizes[i];
  }
  if (total != nullptr) *total = end;
  return offsets;
}

bool CudaAvailable(std::string* why) {
#if HEARTH_HAVE_CUDA
  static const std::string reason = ProbeCuda();
#else
  static const std::string reason = "built without CUDA support";
#endif
  if (reason.empty()) return true;
  if (why != nullptr) *why = reason;
  return false;
}

Result<int> CudaDeviceCount() {
  std::string why;
  if (!CudaAvailable(&why)) return Unavailable(why);
#if HEARTH_HAVE_CUDA
  ASSIGN_OR_RETURN(const CudaDriver* cu, CudaDriver::Get());
  int count = 0;
  RETURN_IF_ERROR(CuCheck(*cu, cu->DeviceGetCount(&count), "cuDeviceGetCount"));
  return count;
#else
  return Unavailable("built without CUDA support");
#endif
}

Result<std::string> CudaDevicePciBusId(int device) {
  std::string why;
  if (!CudaAvailable(&why)) return Unavailable(why);
#if HEARTH_HAVE_CUDA
  ASSIGN_OR_RETURN(const CudaDriver* cu, CudaDriver::Get());
  CUdevice dev = 0;
  RETURN_IF_ERROR(
      CuCheck(*cu, cu->DeviceGet(&dev, device), "cuDeviceGet(" + std::to_string(device) + ")"));
  int domain = 0, bus = 0, slot = 0;
  RETURN_IF_ERROR(CuCheck(
      *cu, cu->DeviceGetAttribute(&domain, CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID, dev), "PCI domain"));
  RETURN_IF_ERROR(
      CuCheck(*cu, cu->DeviceGetAttribute(&bus, CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, dev), "PCI bus"));
  RETURN_IF_ERROR(CuCheck(
      *cu, cu->DeviceGetAttribute(&slot, CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID, dev), "PCI device"));
  char id[32];
  std::snprintf(id, sizeof id, "%08x:%02x:%02x.0", static_cast<unsigned>(domain),
                static_cast<unsigned>(bus), static_cast<unsigned>(slot));
  return std::string(id);
#else
  (void)device;
  return Unavailable("built without CUDA support");
#endif
}

Device DefaultDevice() { return CudaAvailable() ? Device::Cuda(0) : Device::Host(); }

Result<std::unique_ptr<Arena>> Arena::Create(Device device, uint64_t size) {
  switch (device.kind) {
    case DeviceKind::kHost:
      return CreateHostArena(size);
    case DeviceKind::kCuda:
      return CreateCudaArena(device.index, size);
  }
  return InvalidArgument("unknown device kind " + std::to_string(static_cast<int>(device.kind)));
}

#ifdef _WIN32
Result<std::unique_ptr<ArenaMapping>> ArenaMapping::MapHandle(uint64_t handle, Device device,
                                                              uint64_t size) {
  switch (device.kind) {
    case DeviceKind::kHost:
      return MapHostArena(handle, size);
    case DeviceKind::kCuda:
      return MapCudaArena(handle, device.index, size);
  }
  platform::CloseHandle(reinterpret_cast<platform::NativeHandle>(static_cast<uintptr_t>(handle)));
  return InvalidArgument("unknown device kind " + std::to_string(static_cast<int>(device.kind)));
}
#else
Result<std::unique_ptr<ArenaMapping>> ArenaMapping::Map(UniqueFd fd, Device device, uint64_t size) {
  if (!fd.valid()) return InvalidArgument("cannot map an arena from an invalid descriptor");
  switch (device.kind) {
    case DeviceKind::kHost:
      return MapHostArena(std::move(fd), size);
    case DeviceKind::kCuda:
      return MapCudaArena(std::move(fd), device.index, size);
  }
  return InvalidArgument("unknown device kind " + std::to_string(static_cast<int>(device.kind)));
}
#endif

#if !HEARTH_HAVE_CUDA
Result<std::unique_ptr<Arena>> CreateCudaArena(int device, uint64_t) {
  return Unavailable("cannot create an arena on cuda:" + std::to_string(device) +
                     ": built without CUDA support");
}

#ifdef _WIN32
Result<std::unique_ptr<ArenaMapping>> MapCudaArena(uint64_t handle, int device, uint64_t) {
  platform::CloseHandle(reinterpret_cast<platform::NativeHandle>(static_cast<uintptr_t>(handle)));
  return Unavailable("cannot map an arena on cuda:" + std::to_string(device) +
                     ": built without CUDA support");
}
#else
Result<std::unique_ptr<ArenaMapping>> MapCudaArena(UniqueFd, int device, uint64_t) {
  return Unavailable("cannot map an arena on cuda:" + std::to_string(device) +
                     ": built without CUDA support");
}
#endif
#endif

}  // namespace hearth
