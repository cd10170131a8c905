// Sections on Linux: sealed memfds (section.h).
#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <limits>
#include <string>
#include <utility>

#include "platform/section.h"

namespace hearth::platform {

void CloseHandle(NativeHandle h) {
  if (h != kNoHandle) ::close(h);
}

Result<Section> Section::Create(uint64_t bytes, std::string_view name) {
  if (bytes > static_cast<uint64_t>(std::numeric_limits<off_t>::max()))
    return InvalidArgument("a section of " + std::to_string(bytes) + " bytes is too large");
  const std::string label(name.substr(0, 200));
  const int fd = ::memfd_create(label.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return ErrnoError("memfd_create for a section", errno);
  Section s;
  s.handle_ = fd;
  s.size_ = bytes;
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0)
    return ErrnoError("sizing a section to " + std::to_string(bytes) + " bytes", errno);
  if (bytes == 0) return s;  // an empty memfd maps nothing
  void* addr =
      ::mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (addr == MAP_FAILED)
    return ErrnoError("mmap of a " + std::to_string(bytes) + "-byte section", errno);
  s.base_ = static_cast<std::byte*>(addr);
  return s;
}

void Section::Release() {
  if (base_ != nullptr && ::munmap(base_, static_cast<size_t>(size_)) != 0)
    spdlog::error("munmap of a {}-byte section failed: {}", size_, std::strerror(errno));
  base_ = nullptr;
  CloseHandle(handle_);
  handle_ = kNoHandle;
}

Status Section::Seal() {
  if (sealed_) return Status::Ok();
  // munmap first: F_SEAL_WRITE fails with EBUSY while any writable shared
  // mapping of the memfd exists.
  if (base_ != nullptr && ::munmap(base_, static_cast<size_t>(size_)) != 0)
    return ErrnoError("munmap of a section's writable view", errno);
  base_ = nullptr;
  constexpr int kSeals = F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;
  if (::fcntl(handle_, F_ADD_SEALS, kSeals) != 0)
    return ErrnoError("sealing a section's memfd (F_ADD_SEALS)", errno);
  sealed_ = true;
  return Status::Ok();
}

Result<NativeHandle> Section::ShareReadOnly(uint32_t /*peer_pid*/) const {
  if (!sealed_) return FailedPrecondition("a section is shared only once sealed");
  // Reopening through /proc gives the peer its own read-only open file
  // description: mmap(PROT_WRITE, MAP_SHARED) of it fails with EACCES
  // whatever the seals say, and fcntl cannot make it writable.
  const std::string path = "/proc/self/fd/" + std::to_string(handle_);
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd >= 0) return fd;
  const int open_errno = errno;
  if (open_errno != ENOENT && open_errno != EACCES)
    return ErrnoError("reopening a section read-only through " + path, open_errno);
  // No /proc (or not allowed to reopen): share the writable description.
  // The seals still forbid every write, resize and writable shared mapping.
  spdlog::debug("{} unavailable ({}); sharing a dup of the sealed memfd", path,
                std::strerror(open_errno));
  fd = ::fcntl(handle_, F_DUPFD_CLOEXEC, 0);
  if (fd < 0) return ErrnoError("duplicating a section's memfd", errno);
  return fd;
}

Result<ReadOnlyView> ReadOnlyView::Map(NativeHandle handle, uint64_t bytes) {
  ReadOnlyView v;
  v.handle_ = handle;  // closed by v on every return
  if (handle == kNoHandle) return InvalidArgument("no section handle");
  struct stat st {};
  if (::fstat(handle, &st) != 0) return ErrnoError("fstat of a section", errno);
  if (static_cast<uint64_t>(st.st_size) < bytes)
    return InvalidArgument("the section holds " + std::to_string(st.st_size) +
                           " bytes, fewer than the " + std::to_string(bytes) + " expected");
  v.size_ = bytes;
  if (bytes == 0) return v;
  void* addr = ::mmap(nullptr, static_cast<size_t>(bytes), PROT_READ, MAP_SHARED, handle, 0);
  if (addr == MAP_FAILED) return ErrnoError("read-only mmap of a section", errno);
  v.base_ = static_cast<const std::byte*>(addr);
  return v;
}

void ReadOnlyView::Release() {
  if (base_ != nullptr) ::munmap(const_cast<std::byte*>(base_), static_cast<size_t>(size_));
  base_ = nullptr;
  CloseHandle(handle_);
  handle_ = kNoHandle;
}

ReadOnlyView::WriteAttempts ReadOnlyView::TryToWrite() const {
  WriteAttempts tried;
  if (size_ == 0) return tried;
  void* w =
      ::mmap(nullptr, static_cast<size_t>(size_), PROT_READ | PROT_WRITE, MAP_SHARED, handle_, 0);
  if (w != MAP_FAILED) {
    ::munmap(w, static_cast<size_t>(size_));
    tried.mapped_writable = true;
  }
  if (::mprotect(const_cast<std::byte*>(base_), static_cast<size_t>(size_),
                 PROT_READ | PROT_WRITE) == 0) {
    ::mprotect(const_cast<std::byte*>(base_), static_cast<size_t>(size_), PROT_READ);
    tried.protection_raised = true;
  }
  // A descriptor's access mode cannot be raised (F_SETFL ignores it), but a
  // reopen through /proc can be writable; the seals must then refuse the
  // write (of the byte already there, so that nothing changes if it went).
  const std::string path = "/proc/self/fd/" + std::to_string(handle_);
  const int rw = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (rw >= 0) {
    const std::byte first = base_[0];
    if (::pwrite(rw, &first, 1, 0) == 1) tried.handle_upgraded = true;
    ::close(rw);
  }
  return tried;
}

}  // namespace hearth::platform
