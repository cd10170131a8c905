#include "loadgen/cuda_shm.h"

#include <algorithm>
#include <vector>

#if defined(HEARTH_HAVE_CUDA) && HEARTH_HAVE_CUDA
#include <type_traits>

#include "memory/cuda_driver.h"
#endif

namespace hearth::bench {

std::string CudaShmRegion::Describe() const {
  return "device memory on cuda:" + std::to_string(device_) + " (CUDA IPC handle)";
}

RegionHandle CudaShmRegion::Handle() const {
  RegionHandle handle;
  handle.kind = BenchSharedMemory::kCuda;
  handle.ipc_handle = ipc_handle_;
  handle.device_id = device_;
  handle.byte_size = size_;
  return handle;
}

#if defined(HEARTH_HAVE_CUDA) && HEARTH_HAVE_CUDA

static_assert(std::is_same_v<CUdeviceptr, unsigned long long> && sizeof(CUdeviceptr) == 8);
static_assert(sizeof(CUipcMemHandle) == CU_IPC_HANDLE_SIZE);

namespace {

// The poison goes to the device from a host buffer of at most this many
// bytes, reused for as many copies as the room needs.
constexpr uint64_t kFillChunk = uint64_t{1} << 20;

Result<const CudaDriver*> Driver(int device) {
  ASSIGN_OR_RETURN(const CudaDriver* cu, CudaDriver::Get());
  RETURN_IF_ERROR(MakeContextCurrent(device));
  return cu;
}

}  // namespace

Status CudaShmUsable(int device) { return Driver(device).status(); }

Result<std::unique_ptr<CudaShmRegion>> CudaShmRegion::Create(int device, uint64_t bytes) {
  ASSIGN_OR_RETURN(const CudaDriver* cu, Driver(device));
  if (bytes == 0) return InvalidArgument("a CUDA shared-memory region of 0 bytes");
  CUdeviceptr pointer = 0;
  RETURN_IF_ERROR(CuCheck(
      *cu, cu->MemAlloc(&pointer, bytes),
      "cuMemAlloc(" + std::to_string(bytes) + " bytes on cuda:" + std::to_string(device) + ")"));
  // Owned from here: a failure below frees it.
  std::unique_ptr<CudaShmRegion> region(new CudaShmRegion(device, pointer, bytes));
  CUipcMemHandle handle{};
  RETURN_IF_ERROR(CuCheck(*cu, cu->IpcGetMemHandle(&handle, pointer), "cuIpcGetMemHandle"));
  region->ipc_handle_.assign(handle.reserved, sizeof(handle.reserved));
  return region;
}

CudaShmRegion::~CudaShmRegion() {
  Result<const CudaDriver*> cu = Driver(device_);
  if (!cu.ok()) return;  // it was allocated, so the driver is there; at exit it may be gone
  CuLogIfError(**cu, (*cu)->MemFree(pointer_), "cuMemFree (a bench region)");
}

Status CudaShmRegion::Write(uint64_t offset, const void* data, uint64_t bytes) {
  RETURN_IF_ERROR(CheckRange(offset, bytes, "a write"));
  ASSIGN_OR_RETURN(const CudaDriver* cu, Driver(device_));
  RETURN_IF_ERROR(CuCheck(*cu, cu->MemcpyHtoD(pointer_ + offset, data, bytes), "cuMemcpyHtoD"));
  // From pageable memory the copy may still be in flight when it returns.
  return CuCheck(*cu, cu->CtxSynchronize(), "cuCtxSynchronize after cuMemcpyHtoD");
}

Status CudaShmRegion::Fill(uint64_t offset, unsigned char value, uint64_t bytes) {
  RETURN_IF_ERROR(CheckRange(offset, bytes, "a fill"));
  ASSIGN_OR_RETURN(const CudaDriver* cu, Driver(device_));
  const std::vector<unsigned char> chunk(std::min(bytes, kFillChunk), value);
  for (uint64_t done = 0; done < bytes;) {
    const uint64_t n = std::min<uint64_t>(chunk.size(), bytes - done);
    RETURN_IF_ERROR(
        CuCheck(*cu, cu->MemcpyHtoD(pointer_ + offset + done, chunk.data(), n), "cuMemcpyHtoD"));
    done += n;
  }
  return CuCheck(*cu, cu->CtxSynchronize(), "cuCtxSynchronize after cuMemcpyHtoD");
}

Status CudaShmRegion::Read(uint64_t offset, void* out, uint64_t bytes) const {
  RETURN_IF_ERROR(CheckRange(offset, bytes, "a read"));
  ASSIGN_OR_RETURN(const CudaDriver* cu, Driver(device_));
  // Synchronous: done when it returns.
  return CuCheck(*cu, cu->MemcpyDtoH(out, pointer_ + offset, bytes), "cuMemcpyDtoH");
}

#else  // a hearth built without CUDA

namespace {
Status NoCuda() {
  return Unimplemented(
      "this hearth was built without CUDA (configured with -DHEARTH_CUDA=OFF, or where no nvcc "
      "was found); rebuild it with the CUDA toolkit");
}
}  // namespace

Status CudaShmUsable(int) { return NoCuda(); }
Result<std::unique_ptr<CudaShmRegion>> CudaShmRegion::Create(int, uint64_t) { return NoCuda(); }
CudaShmRegion::~CudaShmRegion() = default;
Status CudaShmRegion::Write(uint64_t, const void*, uint64_t) { return NoCuda(); }
Status CudaShmRegion::Fill(uint64_t, unsigned char, uint64_t) { return NoCuda(); }
Status CudaShmRegion::Read(uint64_t, void*, uint64_t) const { return NoCuda(); }

#endif

}  // namespace hearth::bench
