// The device memory `hearth bench --shared-memory cuda` gives each request
// slot (Triton's CUDA shared-memory extension, as perf_analyzer's
// `--shared-memory cuda`): one cuMemAlloc allocation per slot in the primary
// context of the chosen GPU, registered with the server by its CUDA IPC
// handle. The server's workers open the handle and copy inputs out of it and
// outputs into it, device to device; this process writes the inputs and the
// poison with cuMemcpyHtoD and reads answers back with cuMemcpyDtoH.
//
// The driver is resolved at run time (memory/cuda_driver.h); this header
// includes no CUDA header, and in a hearth built without CUDA every call
// fails, saying so.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "hearth/status.h"
#include "loadgen/shm_region.h"

namespace hearth::bench {

// OK when regions can be made on GPU `device`: this hearth was built with
// CUDA, the NVIDIA driver loads and initialises (not the toolkit's stub
// libcuda), and `device` is an ordinal of this machine. Otherwise the error
// says which of these failed (Unimplemented for the build, Unavailable for
// the driver, InvalidArgument for the ordinal). Makes the device's primary
// context current on the calling thread.
Status CudaShmUsable(int device);

// Owns one allocation; the destructor frees it (logging a failure). The
// server must have unregistered the region first: freeing memory another
// process has opened by its IPC handle leaves that mapping undefined.
// Neither copyable nor movable: held by its slot through a unique_ptr.
class CudaShmRegion final : public ShmRegion {
 public:
  static Result<std::unique_ptr<CudaShmRegion>> Create(int device, uint64_t bytes);
  ~CudaShmRegion() override;
  CudaShmRegion(const CudaShmRegion&) = delete;
  CudaShmRegion& operator=(const CudaShmRegion&) = delete;

  uint64_t size() const override { return size_; }
  RegionHandle Handle() const override;
  std::string Describe() const override;
  // Each makes the device's context current on the calling thread; Write
  // and Fill wait until the bytes are on the device.
  Status Write(uint64_t offset, const void* data, uint64_t bytes) override;
  Status Fill(uint64_t offset, unsigned char value, uint64_t bytes) override;
  Status Read(uint64_t offset, void* out, uint64_t bytes) const override;

 private:
  CudaShmRegion(int device, uint64_t pointer, uint64_t size)
      : device_(device), pointer_(pointer), size_(size) {}

  int device_;
  uint64_t pointer_;  // the allocation's CUdeviceptr
  uint64_t size_;
  std::string ipc_handle_;
};

}  // namespace hearth::bench
