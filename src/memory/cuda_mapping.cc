// Read-only mappings of exported CUDA arenas:
// cuMemImportFromShareableHandle + cuMemAddressReserve + cuMemMap +
// cuMemSetAccess(CU_MEM_ACCESS_FLAGS_PROT_READ), in the device's primary
// context.
#include <spdlog/spdlog.h>

#include <cstdint>
#include <string>

#include "memory/arena_kinds.h"
#include "memory/cuda_driver.h"
#include "memory/cuda_shareable.h"

namespace hearth {
namespace {

std::string DeviceName(int device) { return "cuda:" + std::to_string(device); }

class CudaArenaMapping final : public ArenaMapping {
 public:
  CudaArenaMapping(const CudaDriver* cu, int device, uint64_t size)
      : cu_(cu), device_(device), size_(size) {}

  ~CudaArenaMapping() override {
    if (!has_handle_) return;
    Status status = MakeContextCurrent(device_);
    if (!status.ok()) {
      spdlog::error("CUDA arena mapping on {} cannot be released: {}", DeviceName(device_),
                    status.ToString());
      return;
    }
    if (mapped_) CuLogIfError(*cu_, cu_->MemUnmap(va_, mapped_size_), "cuMemUnmap");
    if (reserved_) CuLogIfError(*cu_, cu_->MemAddressFree(va_, mapped_size_), "cuMemAddressFree");
    // The driver frees the memory once the store's handle, every exported
    // descriptor and every importer's handle and mapping are gone.
    CuLogIfError(*cu_, cu_->MemRelease(handle_), "cuMemRelease of an imported arena");
  }

  CudaArenaMapping(const CudaArenaMapping&) = delete;
  CudaArenaMapping& operator=(const CudaArenaMapping&) = delete;

  // `shareable` stays the caller's (cuda_shareable.h).
  Status Import(void* shareable, const std::string& what) {
    RETURN_IF_ERROR(MakeContextCurrent(device_));
    CUdevice dev = 0;
    RETURN_IF_ERROR(CuCheck(*cu_, cu_->DeviceGet(&dev, device_), "cuDeviceGet"));
    size_t total = 0;
    RETURN_IF_ERROR(CuCheck(*cu_, cu_->DeviceTotalMem(&total, dev), "cuDeviceTotalMem"));
    if (size_ > total) {
      return InvalidArgument("CUDA arena claims " + std::to_string(size_) + " bytes, more than " +
                             DeviceName(device_) + "'s " + std::to_string(total) +
                             " bytes of memory");
    }

    CUresult imported =
        cu_->MemImportFromShareableHandle(&handle_, shareable, kCudaShareableHandleType);
    if (imported != CUDA_SUCCESS) {
      Status status = CuCheck(*cu_, imported, "cuMemImportFromShareableHandle");
      return InvalidArgument(what +
                             " is not an exported CUDA arena of this machine: " + status.message());
    }
    has_handle_ = true;

    CUmemAllocationProp prop{};
    RETURN_IF_ERROR(CuCheck(*cu_, cu_->MemGetAllocationPropertiesFromHandle(&prop, handle_),
                            "cuMemGetAllocationPropertiesFromHandle"));
    if (prop.location.type != CU_MEM_LOCATION_TYPE_DEVICE) {
      return InvalidArgument("the imported CUDA arena is not device memory (location type " +
                             std::to_string(static_cast<int>(prop.location.type)) + ")");
    }
    if (prop.location.id != device_) {
      return InvalidArgument("the imported CUDA arena lives on " + DeviceName(prop.location.id) +
                             ", not on " + DeviceName(device_));
    }
    size_t granularity = 0;
    RETURN_IF_ERROR(CuCheck(
        *cu_,
        cu_->MemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
        "cuMemGetAllocationGranularity"));
    if (granularity == 0) return Internal("the driver reports an allocation granularity of 0");
    if (!RoundUpToMultiple(size_, granularity, &mapped_size_)) {
      return InvalidArgument("CUDA arena size " + std::to_string(size_) + " is too large");
    }

    RETURN_IF_ERROR(CuCheck(*cu_, cu_->MemAddressReserve(&va_, mapped_size_, 0, 0, 0),
                            "cuMemAddressReserve of " + std::to_string(mapped_size_) + " bytes"));
    reserved_ = true;
    // The driver offers no query for an imported allocation's size. Mapping
    // `size_` rounded up to the granularity fails if that is more than the
    // allocation holds, so the claim is checked before any byte is touched.
    CUresult mapped = cu_->MemMap(va_, mapped_size_, 0, handle_, 0);
    if (mapped != CUDA_SUCCESS) {
      Status status = CuCheck(*cu_, mapped, "cuMemMap");
      return InvalidArgument(
          "CUDA arena claims " + std::to_string(size_) + " bytes (" + std::to_string(mapped_size_) +
          " once rounded up to the " + std::to_string(granularity) +
          "-byte granularity), more than the exported allocation holds: " + status.message());
    }
    mapped_ = true;
    CUmemAccessDesc access{};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = device_;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READ;
    RETURN_IF_ERROR(CuCheck(*cu_, cu_->MemSetAccess(va_, mapped_size_, &access, 1),
                            "cuMemSetAccess(PROT_READ)"));
    return Status::Ok();
  }

  const void* data() const override {
    return reinterpret_cast<const void*>(static_cast<uintptr_t>(va_));
  }
  uint64_t size() const override { return size_; }
  Device device() const override { return Device::Cuda(device_); }

  Status CopyToHost(uint64_t offset, std::span<std::byte> out) const override {
    if (!RangeWithin(offset, out.size(), size_)) {
      return InvalidArgument("bytes [" + std::to_string(offset) + ", +" +
                             std::to_string(out.size()) + ") lie outside the " +
                             std::to_string(size_) + "-byte mapping");
    }
    if (out.empty()) return Status::Ok();
    RETURN_IF_ERROR(MakeContextCurrent(device_));
    return CuCheck(*cu_, cu_->MemcpyDtoH(out.data(), va_ + offset, out.size()),
                   "copying " + std::to_string(out.size()) + " bytes of a CUDA arena to the host");
  }

 private:
  const CudaDriver* cu_;
  const int device_;
  const uint64_t size_;
  uint64_t mapped_size_ = 0;
  CUmemGenericAllocationHandle handle_ = 0;
  bool has_handle_ = false;
  CUdeviceptr va_ = 0;
  bool reserved_ = false;
  bool mapped_ = false;
};

}  // namespace

Result<std::unique_ptr<ArenaMapping>> ImportCudaArena(void* shareable, const std::string& what,
                                                      int device, uint64_t size) {
  if (size == 0) {
    return InvalidArgument("a CUDA arena mapping cannot be empty (claimed size 0 on " +
                           DeviceName(device) + ")");
  }
  ASSIGN_OR_RETURN(const CudaDriver* cu, CudaDriver::Get());
  auto mapping = std::make_unique<CudaArenaMapping>(cu, device, size);
  RETURN_IF_ERROR(mapping->Import(shareable, what));
  return std::unique_ptr<ArenaMapping>(std::move(mapping));
}

#ifndef _WIN32
Result<std::unique_ptr<ArenaMapping>> MapCudaArena(UniqueFd fd, int device, uint64_t size) {
  // Driver quirk: for CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR the
  // descriptor itself is passed in the pointer argument, by value (export
  // takes a pointer to an int instead). `fd` is closed on return: the
  // imported handle holds the allocation.
  return ImportCudaArena(reinterpret_cast<void*>(static_cast<uintptr_t>(fd.get())),
                         "descriptor " + std::to_string(fd.get()), device, size);
}
#endif

}  // namespace hearth
