#include "attach/client_region.h"

#include <cstring>
#include <string>

#if HEARTH_HAVE_CUDA
#include "memory/cuda_driver.h"
#endif

namespace hearth {

#if HEARTH_HAVE_CUDA

namespace {
// The context current on entry is current again on exit: a worker whose
// own compute (a Python model's torch) runs in one context may open and
// copy regions of another GPU's.
class ContextKept {
 public:
  explicit ContextKept(const CudaDriver& cu)
      : cu_(cu), known_(cu.CtxGetCurrent(&was_) == CUDA_SUCCESS) {}
  ~ContextKept() {
    // Where none was current, ours stays (as the other calls here expect).
    CUcontext now = nullptr;
    if (known_ && was_ != nullptr && cu_.CtxGetCurrent(&now) == CUDA_SUCCESS && now != was_)
      CuLogIfError(cu_, cu_.CtxSetCurrent(was_), "cuCtxSetCurrent");
  }
  ContextKept(const ContextKept&) = delete;
  ContextKept& operator=(const ContextKept&) = delete;

 private:
  const CudaDriver& cu_;
  CUcontext was_ = nullptr;
  bool known_;
};
}  // namespace

Result<std::unique_ptr<ClientRegion>> ClientRegion::Open(
    int device, std::span<const uint8_t, kClientIpcHandleBytes> handle, uint64_t byte_size) {
  ASSIGN_OR_RETURN(const CudaDriver* cu, CudaDriver::Get());
  ContextKept kept(*cu);
  RETURN_IF_ERROR(MakeContextCurrent(device));
  CUipcMemHandle h;
  static_assert(sizeof h.reserved == kClientIpcHandleBytes);
  std::memcpy(h.reserved, handle.data(), kClientIpcHandleBytes);
  CUdeviceptr ptr = 0;
  if (Status s = CuCheck(*cu, cu->IpcOpenMemHandle(&ptr, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
                         "opening its CUDA IPC handle");
      !s.ok())
    return InvalidArgument(s.message());
  // The handle names a whole allocation: its size bounds every copy.
  CUdeviceptr base = 0;
  size_t size = 0;
  Status ranged =
      CuCheck(*cu, cu->MemGetAddressRange(&base, &size, ptr), "the size of its allocation");
  if (ranged.ok() && size - (ptr - base) < byte_size)
    ranged =
        InvalidArgument("registered with " + std::to_string(byte_size) +
                        " bytes, but its allocation has " + std::to_string(size - (ptr - base)));
  if (!ranged.ok()) {
    CuLogIfError(*cu, cu->IpcCloseMemHandle(ptr), "cuIpcCloseMemHandle");
    return ranged;
  }
  return std::unique_ptr<ClientRegion>(
      new ClientRegion(reinterpret_cast<std::byte*>(ptr), byte_size, device));
}

ClientRegion::~ClientRegion() {
  auto cu = CudaDriver::Get();
  if (!cu.ok() || data_ == nullptr) return;
  ContextKept kept(**cu);
  if (MakeContextCurrent(device_).ok())
    CuLogIfError(**cu, (*cu)->IpcCloseMemHandle(reinterpret_cast<CUdeviceptr>(data_)),
                 "cuIpcCloseMemHandle");
}

DeviceStaging::~DeviceStaging() {
  auto cu = CudaDriver::Get();
  if (!cu.ok() || data_ == nullptr) return;
  ContextKept kept(**cu);
  if (MakeContextCurrent(device_).ok())
    CuLogIfError(**cu, (*cu)->MemFree(reinterpret_cast<CUdeviceptr>(data_)), "cuMemFree");
}

Result<std::byte*> DeviceStaging::Reserve(int device, uint64_t bytes) {
  if (bytes <= size_ && data_ != nullptr) return data_;
  ASSIGN_OR_RETURN(const CudaDriver* cu, CudaDriver::Get());
  ContextKept kept(*cu);
  RETURN_IF_ERROR(MakeContextCurrent(device));
  if (data_ != nullptr) {
    CuLogIfError(*cu, cu->MemFree(reinterpret_cast<CUdeviceptr>(data_)), "cuMemFree");
    data_ = nullptr;
    size_ = 0;
  }
  // Rounded up to a power of two, so that growing is rare.
  uint64_t size = 1u << 20;
  while (size < bytes) size *= 2;
  CUdeviceptr p = 0;
  RETURN_IF_ERROR(CuCheck(*cu, cu->MemAlloc(&p, size),
                          "allocating " + std::to_string(size) + " bytes of device staging"));
  data_ = reinterpret_cast<std::byte*>(p);
  size_ = size;
  device_ = device;
  return data_;
}

Status WaitForCopies(int device) {
  ASSIGN_OR_RETURN(const CudaDriver* cu, CudaDriver::Get());
  ContextKept kept(*cu);
  RETURN_IF_ERROR(MakeContextCurrent(device));
  return CuCheck(*cu, cu->StreamSynchronize(nullptr), "waiting for copies");
}

Status CopyAnywhere(int device, void* dst, const void* src, uint64_t bytes, bool wait) {
  if (bytes == 0) return Status::Ok();
  ASSIGN_OR_RETURN(const CudaDriver* cu, CudaDriver::Get());
  ContextKept kept(*cu);
  RETURN_IF_ERROR(MakeContextCurrent(device));
  // The legacy default stream, waited for: device-to-device copies do not
  // wait for the host on their own, and the backend's own stream must find
  // the bytes there.
  RETURN_IF_ERROR(CuCheck(*cu,
                          cu->MemcpyAsync(reinterpret_cast<CUdeviceptr>(dst),
                                          reinterpret_cast<CUdeviceptr>(src), bytes, nullptr),
                          "copying " + std::to_string(bytes) + " bytes"));
  if (!wait) return Status::Ok();
  return CuCheck(*cu, cu->StreamSynchronize(nullptr), "waiting for a copy");
}

#else

namespace {
Status NoCuda() {
  return Unavailable("CUDA shared memory needs a build with CUDA (this one has none)");
}
}  // namespace

Result<std::unique_ptr<ClientRegion>> ClientRegion::Open(
    int, std::span<const uint8_t, kClientIpcHandleBytes>, uint64_t) {
  return NoCuda();
}
ClientRegion::~ClientRegion() = default;
DeviceStaging::~DeviceStaging() = default;
Result<std::byte*> DeviceStaging::Reserve(int, uint64_t) { return NoCuda(); }
Status CopyAnywhere(int, void*, const void*, uint64_t, bool) { return NoCuda(); }
Status WaitForCopies(int) { return NoCuda(); }

#endif

}  // namespace hearth
