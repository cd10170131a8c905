#include "server/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

namespace hearth {
namespace {

// The object's size now (it may have changed since registration).
Result<uint64_t> ObjectSize(int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return ErrnoError("fstat", errno);
  return static_cast<uint64_t>(st.st_size);
}

}  // namespace

Status SharedMemoryRegistry::CheckUser(uid_t client_uid) const {
  if (access_.users.empty())
    return PermissionDenied(
        "shared memory is off on this server (hearth serve --shared-memory-users)");
  if (std::find(access_.users.begin(), access_.users.end(), client_uid) != access_.users.end())
    return Status::Ok();
  std::string list;
  for (uid_t u : access_.users) list += (list.empty() ? "" : ", ") + std::to_string(u);
  return PermissionDenied("the client's user (uid " + std::to_string(client_uid) +
                          ") may not use shared memory on this server (users allowed: " + list +
                          "; hearth serve --shared-memory-users)");
}

Status SharedMemoryRegistry::Register(const std::string& name, const std::string& key,
                                      uint64_t offset, uint64_t byte_size, uid_t client_uid) {
  if (name.empty() || name.size() > kMaxRegionNameBytes)
    return InvalidArgument("a shared-memory region needs a name of 1 to " +
                           std::to_string(kMaxRegionNameBytes) + " bytes");
  // A POSIX shared-memory object: "/name", no other slash, no NUL.
  if (key.size() < 2 || key.size() > 255 || key[0] != '/' ||
      key.find('/', 1) != std::string::npos || key.find('\0') != std::string::npos || key == "/." ||
      key == "/..")
    return InvalidArgument("region '" + name + "': key '" + key +
                           "' is not a POSIX shared-memory name (/name, no other '/')");
  if (byte_size == 0) return InvalidArgument("region '" + name + "': byte_size is 0");
  if (offset > UINT64_MAX - byte_size)
    return InvalidArgument("region '" + name + "': offset + byte_size overflows");
  RETURN_IF_ERROR(CheckUser(client_uid));
  // O_NOFOLLOW: the name in /dev/shm is a file the server opens, not a link
  // to elsewhere. O_NONBLOCK: opening a FIFO placed there must not wait.
  // Read-write: outputs are written there. Whatever was opened is checked
  // through this descriptor before anything is read or written.
  const int fd = ::shm_open(key.c_str(), O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0);
  if (fd < 0) {
    const int error = errno;
    const std::string what = "region '" + name + "': " + key;
    switch (error) {
      case ENOENT:
        return NotFound(what + ": no such shared-memory object");
      case ELOOP:
        return PermissionDenied(what + " is a symbolic link (links are not followed)");
      case EISDIR:
      case EINVAL: {
        // glibc's shm_open says EINVAL for a directory. Looked at again
        // only to name the error: nothing is opened through this name.
        struct stat st {};
        const bool dir = ::lstat(("/dev/shm" + key).c_str(), &st) == 0 && S_ISDIR(st.st_mode);
        return InvalidArgument(what + (dir ? " is a directory" : " cannot be opened") +
                               ", not a shared-memory object");
      }
      case EACCES:
      case EPERM:
        return PermissionDenied(what + ": the server's user may not read and write it");
      case ENAMETOOLONG:
        return InvalidArgument(what + ": the name is too long");
      default:
        return ErrnoError("region '" + name + "': opening " + key, error);
    }
  }
  auto region = std::make_shared<Region>();
  region->fd.Reset(fd);
  struct stat st {};
  if (::fstat(fd, &st) != 0) return ErrnoError("fstat " + key, errno);
  if (!S_ISREG(st.st_mode))
    return InvalidArgument("region '" + name + "': " + key + " is not a regular object");
  const auto mode = [&] {
    char octal[8];
    std::snprintf(octal, sizeof(octal), "%04o", static_cast<unsigned>(st.st_mode & 07777));
    return std::string(octal);
  };
  if (st.st_uid != client_uid)
    return PermissionDenied("region '" + name + "': " + key + " belongs to uid " +
                            std::to_string(st.st_uid) + ", not to the client's user (uid " +
                            std::to_string(client_uid) +
                            "): a client may name only its own objects");
  if ((st.st_mode & (S_IRUSR | S_IWUSR)) != (S_IRUSR | S_IWUSR))
    return PermissionDenied("region '" + name + "': " + key + " (mode " + mode() +
                            ") does not let its owner read and write it");
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0)
    return PermissionDenied("region '" + name + "': " + key + " (mode " + mode() +
                            "): a region's object must be writable by nobody else than its owner");
  if (offset + byte_size > static_cast<uint64_t>(st.st_size))
    return InvalidArgument("region '" + name + "': [" + std::to_string(offset) + ", +" +
                           std::to_string(byte_size) + ") lies outside " + key + " (" +
                           std::to_string(st.st_size) + " bytes)");
  // Reads and writes block on nothing: the descriptor is a regular file's.
  if (::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK) != 0)
    return ErrnoError("fcntl " + key, errno);
  region->info = {name, key, offset, byte_size};
  std::lock_guard lock(mu_);
  RETURN_IF_ERROR(CheckNewName(name));
  regions_.emplace(name, std::move(region));
  return Status::Ok();
}

Status SharedMemoryRegistry::CheckNewName(const std::string& name) const {
  const bool system = regions_.count(name) > 0;
  if (system || cuda_regions_.count(name) > 0)
    return AlreadyExists(std::string("a ") + (system ? "system" : "CUDA") +
                         " shared-memory region named '" + name +
                         "' is registered (system and CUDA regions share one set of names)");
  if (regions_.size() + cuda_regions_.size() >= kMaxSharedMemoryRegions)
    return ResourceExhausted("already " + std::to_string(kMaxSharedMemoryRegions) +
                             " shared-memory regions are registered (system and CUDA together)");
  return Status::Ok();
}

Status SharedMemoryRegistry::RegisterCuda(const std::string& name,
                                          std::span<const std::byte> raw_handle, int64_t device_id,
                                          uint64_t byte_size, std::span<const int> gpus,
                                          uid_t client_uid) {
  if (name.empty() || name.size() > kMaxRegionNameBytes)
    return InvalidArgument("a shared-memory region needs a name of 1 to " +
                           std::to_string(kMaxRegionNameBytes) + " bytes");
  const std::string what = "CUDA region '" + name + "'";
  if (raw_handle.size() != control::kCudaIpcHandleBytes)
    return InvalidArgument(what +
                           ": 'raw_handle' must be a CUDA IPC handle (cudaIpcMemHandle_t) of " +
                           std::to_string(control::kCudaIpcHandleBytes) + " bytes, not " +
                           std::to_string(raw_handle.size()));
  if (device_id < 0)
    return InvalidArgument(what + ": device_id " + std::to_string(device_id) + " is negative");
  if (byte_size == 0 || byte_size >= control::kMaxSlotBytes)
    return InvalidArgument(what + ": byte_size must be 1 to " +
                           std::to_string(control::kMaxSlotBytes - 1) + ", not " +
                           std::to_string(byte_size));
  RETURN_IF_ERROR(CheckUser(client_uid));
  if (gpus.empty())
    return InvalidArgument(what +
                           ": this server has no GPU (it serves from host memory: --device cpu), "
                           "so it takes no CUDA shared memory; use system shared memory");
  if (std::find(gpus.begin(), gpus.end(), device_id) == gpus.end()) {
    std::string list;
    for (int g : gpus) list += (list.empty() ? "" : ", ") + std::to_string(g);
    return InvalidArgument(what + ": device_id " + std::to_string(device_id) +
                           " is not a GPU this server uses (" + list + ")");
  }
  auto entry = std::make_shared<CudaSharedMemoryEntry>();
  entry->info = {name, device_id, byte_size};
  std::memcpy(entry->handle.data(), raw_handle.data(), entry->handle.size());
  std::lock_guard lock(mu_);
  RETURN_IF_ERROR(CheckNewName(name));
  entry->id = ++last_cuda_id_;
  cuda_regions_.emplace(name, std::move(entry));
  return Status::Ok();
}

Status SharedMemoryRegistry::UnregisterCuda(const std::string& name) {
  std::lock_guard lock(mu_);
  if (name.empty()) {
    // Flagged before the count moves: a supervisor that sees the count
    // move then finds every flag (WorkerSupervisor).
    for (auto& [n, e] : cuda_regions_) e->unregistered = true;
    if (!cuda_regions_.empty()) ++cuda_unregistrations_;
    cuda_regions_.clear();
    return Status::Ok();
  }
  if (auto it = cuda_regions_.find(name); it != cuda_regions_.end())
    it->second->unregistered = true;
  if (cuda_regions_.erase(name) == 0)
    return NotFound("no CUDA shared-memory region named '" + name + "' is registered");
  ++cuda_unregistrations_;
  return Status::Ok();
}

Result<std::vector<CudaSharedMemoryRegion>> SharedMemoryRegistry::ListCuda(
    const std::string& name) const {
  std::lock_guard lock(mu_);
  std::vector<CudaSharedMemoryRegion> out;
  if (!name.empty()) {
    auto it = cuda_regions_.find(name);
    if (it == cuda_regions_.end())
      return NotFound("no CUDA shared-memory region named '" + name + "' is registered");
    out.push_back(it->second->info);
    return out;
  }
  for (const auto& [n, r] : cuda_regions_) out.push_back(r->info);
  return out;
}

Result<std::shared_ptr<const CudaSharedMemoryEntry>> SharedMemoryRegistry::FindCuda(
    const SharedMemoryRef& ref, const std::string& what) const {
  std::shared_ptr<const CudaSharedMemoryEntry> entry;
  {
    std::lock_guard lock(mu_);
    auto it = cuda_regions_.find(ref.region);
    if (it == cuda_regions_.end()) return entry;
    entry = it->second;
  }
  const uint64_t size = entry->info.byte_size;
  if (ref.offset > size || ref.byte_size > size - ref.offset)
    return InvalidArgument(what + ": [" + std::to_string(ref.offset) + ", +" +
                           std::to_string(ref.byte_size) + ") lies outside CUDA region '" +
                           ref.region + "' (" + std::to_string(size) + " bytes)");
  return entry;
}

Status SharedMemoryRegistry::Unregister(const std::string& name) {
  std::lock_guard lock(mu_);
  if (name.empty()) {
    regions_.clear();
    return Status::Ok();
  }
  if (regions_.erase(name) == 0)
    return NotFound("no shared-memory region named '" + name + "' is registered");
  return Status::Ok();
}

Result<std::vector<SharedMemoryRegion>> SharedMemoryRegistry::List(const std::string& name) const {
  std::lock_guard lock(mu_);
  std::vector<SharedMemoryRegion> out;
  if (!name.empty()) {
    auto it = regions_.find(name);
    if (it == regions_.end())
      return NotFound("no shared-memory region named '" + name + "' is registered");
    out.push_back(it->second->info);
    return out;
  }
  for (const auto& [n, r] : regions_) out.push_back(r->info);
  return out;
}

Result<std::shared_ptr<const SharedMemoryRegistry::Region>> SharedMemoryRegistry::Find(
    const SharedMemoryRef& ref, uint64_t bytes, const char* what) const {
  std::shared_ptr<const Region> region;
  {
    std::lock_guard lock(mu_);
    auto it = regions_.find(ref.region);
    if (it == regions_.end())
      return NotFound("no shared-memory region named '" + ref.region + "' is registered");
    region = it->second;
  }
  const SharedMemoryRegion& r = region->info;
  if (ref.offset > r.byte_size || bytes > r.byte_size - ref.offset)
    return InvalidArgument(std::string(what) + " [" + std::to_string(ref.offset) + ", +" +
                           std::to_string(bytes) + ") lies outside region '" + r.name + "' (" +
                           std::to_string(r.byte_size) + " bytes)");
  return region;
}

Result<std::vector<std::byte>> SharedMemoryRegistry::Read(const SharedMemoryRef& ref) const {
  ASSIGN_OR_RETURN(auto region, Find(ref, ref.byte_size, "the input's bytes"));
  std::vector<std::byte> bytes(ref.byte_size);
  const uint64_t at = region->info.offset + ref.offset;
  for (uint64_t done = 0; done < bytes.size();) {
    const ssize_t n = ::pread(region->fd.get(), bytes.data() + done, bytes.size() - done,
                              static_cast<off_t>(at + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoError("reading region '" + ref.region + "'", errno);
    if (n == 0)
      return InvalidArgument("region '" + ref.region + "': " + region->info.key +
                             " has shrunk below the registered range");
    done += static_cast<uint64_t>(n);
  }
  return bytes;
}

Status SharedMemoryRegistry::Write(const SharedMemoryRef& ref,
                                   std::span<const std::byte> bytes) const {
  if (bytes.size() > ref.byte_size)
    return InvalidArgument("the output's " + std::to_string(bytes.size()) +
                           " bytes do not fit in the " + std::to_string(ref.byte_size) +
                           " bytes of region '" + ref.region + "' it was given");
  ASSIGN_OR_RETURN(auto region, Find(ref, ref.byte_size, "the output's room"));
  const uint64_t at = region->info.offset + ref.offset;
  // pwrite past the end would grow the object: never past what was registered.
  ASSIGN_OR_RETURN(uint64_t size, ObjectSize(region->fd.get()));
  if (at + bytes.size() > size)
    return InvalidArgument("region '" + ref.region + "': " + region->info.key +
                           " has shrunk below the registered range");
  for (uint64_t done = 0; done < bytes.size();) {
    const ssize_t n = ::pwrite(region->fd.get(), bytes.data() + done, bytes.size() - done,
                               static_cast<off_t>(at + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return ErrnoError("writing region '" + ref.region + "'", n < 0 ? errno : EIO);
    done += static_cast<uint64_t>(n);
  }
  return Status::Ok();
}

}  // namespace hearth
