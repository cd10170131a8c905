// The memory of one request slot of `hearth bench --shared-memory`: a
// region this process owns, that the server reads the slot's inputs from
// and writes its outputs into. Two kinds behind one interface, so that the
// session (bench_common.h) lays out, fills, registers and checks both the
// same way:
// - system: a POSIX shared-memory object, mapped here (system_shm.h);
// - cuda: device memory of this process (cuMemAlloc), registered by its
//   CUDA IPC handle (cuda_shm.h).
//
// A region is used by one request at a time (its slot's), from whichever
// thread sends or completes that request; nothing else touches it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "hearth/status.h"
#include "loadgen/load_generator.h"

namespace hearth::bench {

// What a server needs to open a region, and the registration call that
// carries it: system: the object's key (offset 0); cuda: the 64 bytes of
// the allocation's cudaIpcMemHandle_t and the ordinal of its GPU.
struct RegionHandle {
  BenchSharedMemory kind = BenchSharedMemory::kSystem;
  std::string key;         // system
  std::string ipc_handle;  // cuda: CU_IPC_HANDLE_SIZE bytes
  int device_id = 0;       // cuda
  uint64_t byte_size = 0;
};

class ShmRegion {
 public:
  virtual ~ShmRegion() = default;

  virtual uint64_t size() const = 0;
  virtual RegionHandle Handle() const = 0;
  // For messages: "/key", "cuda:0 (CUDA IPC handle)".
  virtual std::string Describe() const = 0;
  // The server has registered the region (and holds what it needs of it).
  virtual void Registered() {}

  // [offset, offset + bytes) must lie in the region (InvalidArgument
  // otherwise). Each call is complete when it returns: bytes written are
  // visible to the server, bytes read are what the server left.
  virtual Status Write(uint64_t offset, const void* data, uint64_t bytes) = 0;
  virtual Status Fill(uint64_t offset, unsigned char value, uint64_t bytes) = 0;
  virtual Status Read(uint64_t offset, void* out, uint64_t bytes) const = 0;

 protected:
  // The range check every kind applies first.
  Status CheckRange(uint64_t offset, uint64_t bytes, const char* what) const {
    if (offset > size() || bytes > size() - offset) {
      return InvalidArgument(std::string(what) + " of " + std::to_string(bytes) +
                             " bytes at offset " + std::to_string(offset) + " is outside " +
                             Describe() + " of " + std::to_string(size()) + " bytes");
    }
    return Status::Ok();
  }
};

}  // namespace hearth::bench
