// Read-only mappings of host arenas (sealed memfds).
#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>

#include "memory/arena_kinds.h"

namespace hearth {
namespace {

// data() of an empty mapping: callers may rely on a non-null pointer.
alignas(kArenaAlignment) const std::byte kEmptyRegion[1] = {};

class HostArenaMapping final : public ArenaMapping {
 public:
  HostArenaMapping(const std::byte* data, uint64_t size) : data_(data), size_(size) {}

  ~HostArenaMapping() override {
    if (size_ == 0) return;
    if (::munmap(const_cast<std::byte*>(data_), static_cast<size_t>(size_)) != 0) {
      spdlog::error("munmap of a {}-byte host arena mapping failed: {}", size_,
                    std::strerror(errno));
    }
  }

  HostArenaMapping(const HostArenaMapping&) = delete;
  HostArenaMapping& operator=(const HostArenaMapping&) = delete;

  const void* data() const override { return data_; }
  uint64_t size() const override { return size_; }
  Device device() const override { return Device::Host(); }

  Status CopyToHost(uint64_t offset, std::span<std::byte> out) const override {
    if (!RangeWithin(offset, out.size(), size_)) {
      return InvalidArgument("bytes [" + std::to_string(offset) + ", +" +
                             std::to_string(out.size()) + ") lie outside the " +
                             std::to_string(size_) + "-byte mapping");
    }
    if (!out.empty()) std::memcpy(out.data(), data_ + offset, out.size());
    return Status::Ok();
  }

 private:
  const std::byte* data_;
  uint64_t size_;
};

}  // namespace

Result<std::unique_ptr<ArenaMapping>> MapHostArena(UniqueFd fd, uint64_t size) {
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return ErrnoError("fstat of a host arena descriptor", errno);
  if (!S_ISREG(st.st_mode)) {
    return InvalidArgument("host arena descriptor is not a regular file (a memfd)");
  }
  // The size check below means something only if the region cannot shrink
  // later (a mapping past the end of a shrunk file faults with SIGBUS), and
  // the bytes are weights only if nobody can still change them.
  int seals = ::fcntl(fd.get(), F_GET_SEALS);
  if (seals < 0) {
    return InvalidArgument(std::string("host arena descriptor cannot be sealed (F_GET_SEALS: ") +
                           std::strerror(errno) + "): not a memfd");
  }
  if ((seals & (F_SEAL_WRITE | F_SEAL_SHRINK)) != (F_SEAL_WRITE | F_SEAL_SHRINK)) {
    char hex[16];
    std::snprintf(hex, sizeof hex, "%#x", static_cast<unsigned>(seals));
    return FailedPrecondition(
        std::string("host arena memfd is not sealed against writes and shrinking (seals ") + hex +
        ")");
  }
  uint64_t real_size = static_cast<uint64_t>(st.st_size);
  if (real_size < size) {
    return InvalidArgument("host arena claims " + std::to_string(size) +
                           " bytes but its memfd holds only " + std::to_string(real_size));
  }
  if (size == 0) return std::unique_ptr<ArenaMapping>(new HostArenaMapping(kEmptyRegion, 0));
  void* addr = ::mmap(nullptr, static_cast<size_t>(size), PROT_READ, MAP_SHARED, fd.get(), 0);
  if (addr == MAP_FAILED) {
    return ErrnoError("mmap(PROT_READ) of a " + std::to_string(size) + "-byte host arena", errno);
  }
  // The mapping keeps the memfd alive; `fd` closes when this returns.
  return std::unique_ptr<ArenaMapping>(
      new HostArenaMapping(static_cast<const std::byte*>(addr), size));
}

}  // namespace hearth
