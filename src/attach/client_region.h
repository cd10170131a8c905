// Clients' device memory: CUDA shared-memory regions (Triton's
// cudasharedmemory extension) that a client registered by its CUDA IPC
// handle, opened in a worker so that a batch's inputs are copied from them,
// and its outputs into them, device to device; and the copies themselves.
//
// The attach side of another process's memory, as attach_client is for the
// store's: here a client's, mapped read-write for the batches that name it.
// The worker keeps each open until the server says it was unregistered
// (worker/session.h).
//
// Without CUDA (a build without it, or no driver) every call is Unavailable,
// saying why.
//
// Each call leaves the context that was current in the calling thread
// current again.
//
// Thread-safety: one thread uses these objects; the functions may be called
// from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <utility>

#include "hearth/status.h"

namespace hearth {

inline constexpr size_t kClientIpcHandleBytes = 64;  // CU_IPC_HANDLE_SIZE

class ClientRegion {
 public:
  // Opens `handle` in `device`'s primary context (the worker's; peer access
  // is enabled when the region is on another GPU), and checks that the
  // allocation it names holds at least `byte_size` bytes. InvalidArgument
  // naming the driver's error for a handle the driver refuses (a stale or
  // forged one, or one of this very process).
  static Result<std::unique_ptr<ClientRegion>> Open(
      int device, std::span<const uint8_t, kClientIpcHandleBytes> handle, uint64_t byte_size);
  ~ClientRegion();
  ClientRegion(const ClientRegion&) = delete;
  ClientRegion& operator=(const ClientRegion&) = delete;

  // The region's first byte, a device address in this process.
  std::byte* data() const { return data_; }
  uint64_t size() const { return size_; }

 private:
  ClientRegion(std::byte* data, uint64_t size, int device)
      : data_(data), size_(size), device_(device) {}
  std::byte* data_ = nullptr;
  uint64_t size_ = 0;
  int device_ = 0;  // whose context opened it
};

// Device memory of this process's own, for staging the parts of a batch
// that are on the device; grows, never shrinks.
class DeviceStaging {
 public:
  DeviceStaging() = default;
  ~DeviceStaging();
  DeviceStaging(DeviceStaging&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)),
        size_(std::exchange(other.size_, 0)),
        device_(other.device_) {}
  DeviceStaging& operator=(DeviceStaging&&) = delete;
  // At least `bytes` on `device` (its contents are not kept when it grows).
  Result<std::byte*> Reserve(int device, uint64_t bytes);

 private:
  std::byte* data_ = nullptr;
  uint64_t size_ = 0;
  int device_ = 0;
};

// Copies `bytes` from `src` to `dst`, each host or device memory of this
// process (unified addressing), with `device`'s context current, on its
// legacy default stream; waits until the copy is done unless `wait` is
// false (then WaitForCopies(device) waits for every copy queued so far).
Status CopyAnywhere(int device, void* dst, const void* src, uint64_t bytes, bool wait = true);
Status WaitForCopies(int device);

}  // namespace hearth
