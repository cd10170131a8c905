// System shared-memory regions that clients register (Triton's extension)
// for requests to read inputs from and write outputs to, so that tensor
// bytes need not travel in HTTP or gRPC bodies.
//
// A region is read with pread() and written with pwrite(), never mapped: a
// client that shrinks its object after registering it makes a request fail
// (every read and write is checked against the object's size then), never
// the server fault on a mapping past the end of a file. Only objects of
// this server's own user that neither group nor others may write are
// accepted: a client cannot point the server at someone else's memory.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "hearth/status.h"
#include "hearth/unique_fd.h"
#include "server/inference_api.h"

namespace hearth {

inline constexpr size_t kMaxSharedMemoryRegions = 1024;
inline constexpr size_t kMaxRegionNameBytes = 256;

class SharedMemoryRegistry {
 public:
  Status Register(const std::string& name, const std::string& key, uint64_t offset,
                  uint64_t byte_size);
  Status Unregister(const std::string& name);  // empty: all
  Result<std::vector<SharedMemoryRegion>> List(const std::string& name) const;

  // The `ref.byte_size` bytes at `ref.offset` of the region, read now.
  Result<std::vector<std::byte>> Read(const SharedMemoryRef& ref) const;
  // Writes `bytes` at `ref.offset` of the region; they must fit in
  // ref.byte_size.
  Status Write(const SharedMemoryRef& ref, std::span<const std::byte> bytes) const;

 private:
  struct Region {
    SharedMemoryRegion info;
    UniqueFd fd;
  };
  // A region in use stays open (shared) until its last user is done, even
  // once unregistered.
  Result<std::shared_ptr<const Region>> Find(const SharedMemoryRef& ref, uint64_t bytes,
                                             const char* what) const;

  mutable std::mutex mu_;
  std::map<std::string, std::shared_ptr<const Region>> regions_;
};

}  // namespace hearth
