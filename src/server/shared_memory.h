// Shared-memory regions that clients register (Triton's system and CUDA
// shared-memory extensions) for requests to read inputs from and write
// outputs to, so that tensor bytes need not travel in HTTP or gRPC bodies.
// A name is taken by at most one region, system or CUDA, and both kinds
// count towards one limit.
//
// A region is read with pread() and written with pwrite(), never mapped: a
// client that shrinks its object after registering it makes a request fail
// (every read and write is checked against the object's size then), never
// the server fault on a mapping past the end of a file.
//
// Who may use what: the server may be able to open objects that its client
// cannot (it may run as root), so it opens only what it can prove the
// client may use. A client must be a process on this machine (its
// connection found in the kernel's socket table, server/local_peer.h) of a
// user the server lets use shared memory (SharedMemoryAccess), and a system
// region's object must belong to that very user: a regular file (opened
// with O_NOFOLLOW, checked with fstat on the descriptor opened, so that a
// link or a swapped name changes nothing) that its owner may read and
// write and that neither group nor others may write. The descriptor opened
// at registration is the only one ever used: the object is never looked up
// by its name again.
//
// A CUDA region is a client's CUDA IPC handle, kept as bytes: the server
// has no CUDA and never opens it. A worker of a model on a GPU opens it
// and copies device to device (protocol/worker_protocol.h, DeviceRegion).
// Unlike Triton, which opens the handle when it is registered, nothing
// checks the handle or its byte_size until a request uses the region: a
// bad handle fails that request (and every later one naming the region),
// never the registration.
#pragma once

#include <sys/types.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "hearth/status.h"
#include "hearth/unique_fd.h"
#include "protocol/worker_protocol.h"
#include "server/inference_api.h"

namespace hearth {

// System and CUDA regions together.
inline constexpr size_t kMaxSharedMemoryRegions = 1024;
inline constexpr size_t kMaxRegionNameBytes = 256;

// A registered CUDA region, immutable once made; requests that name it
// share it (SharedMemoryRef::cuda) for as long as they run.
struct CudaSharedMemoryEntry {
  CudaSharedMemoryRegion info;
  // Never reused in the server's life: a worker that keeps a region open
  // by id never mistakes a region registered later under the same name.
  uint64_t id = 0;
  std::array<uint8_t, control::kCudaIpcHandleBytes> handle{};
  // Set when it is unregistered: a worker that ran a batch naming it after
  // the release for its unregistration is told again (WorkerSupervisor).
  mutable std::atomic<bool> unregistered{false};
};

// The users whose local processes may register shared memory (system and
// CUDA). None: shared memory is off, every registration is refused.
struct SharedMemoryAccess {
  std::vector<uid_t> users;
};

// Thread-safe.
class SharedMemoryRegistry {
 public:
  explicit SharedMemoryRegistry(SharedMemoryAccess access = {}) : access_(std::move(access)) {}

  // PermissionDenied unless `client_uid` is one of the access's users.
  Status CheckUser(uid_t client_uid) const;

  // A region of the object `key`, asked for by a local process of
  // `client_uid` (CheckUser first, then the object's checks above).
  Status Register(const std::string& name, const std::string& key, uint64_t offset,
                  uint64_t byte_size, uid_t client_uid);
  Status Unregister(const std::string& name);  // empty: all system regions
  Result<std::vector<SharedMemoryRegion>> List(const std::string& name) const;

  // A CUDA region on `device_id`, which must be one of `gpus` (the GPUs
  // this server uses; none: it has no GPU and refuses every CUDA region).
  // raw_handle must be exactly control::kCudaIpcHandleBytes; byte_size 1
  // to control::kMaxSlotBytes - 1.
  // Asked for by a local process of `client_uid` (CheckUser once the
  // arguments are well-formed).
  Status RegisterCuda(const std::string& name, std::span<const std::byte> raw_handle,
                      int64_t device_id, uint64_t byte_size, std::span<const int> gpus,
                      uid_t client_uid);
  Status UnregisterCuda(const std::string& name);  // empty: all CUDA regions
  // How many times CUDA regions were unregistered: when it moves on, the
  // workers close the regions they keep open (WorkerSupervisor).
  uint64_t CudaUnregistrations() const { return cuda_unregistrations_.load(); }
  Result<std::vector<CudaSharedMemoryRegion>> ListCuda(const std::string& name) const;
  // The CUDA region `ref.region`, once [ref.offset, ref.offset +
  // ref.byte_size) is checked to lie inside it (`what` names the tensor in
  // the error); nullptr when no CUDA region has that name (it may be a
  // system one, or none).
  Result<std::shared_ptr<const CudaSharedMemoryEntry>> FindCuda(const SharedMemoryRef& ref,
                                                                const std::string& what) const;

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

  // mu_ held: InvalidArgument, AlreadyExists or ResourceExhausted unless
  // `name` may be taken by one more region of either kind.
  Status CheckNewName(const std::string& name) const;

  const SharedMemoryAccess access_;
  mutable std::mutex mu_;
  std::map<std::string, std::shared_ptr<const Region>> regions_;
  std::map<std::string, std::shared_ptr<const CudaSharedMemoryEntry>> cuda_regions_;
  uint64_t last_cuda_id_ = 0;
  std::atomic<uint64_t> cuda_unregistrations_{0};
};

}  // namespace hearth
