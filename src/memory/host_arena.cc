// Host arenas: a sealed memfd.
//
// Create: memfd_create + ftruncate + one read-write MAP_SHARED mapping that
// writers fill in place. Seal: munmap, then seal against every change.
// Export: a fresh O_RDONLY open file description of the memfd.
#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <limits>
#include <string>

#include "memory/arena_kinds.h"

namespace hearth {
namespace {

// What a writer shares with its arena: the read-write mapping, valid while
// `sealed` is false. Seal() and ~HostArena set it before unmapping.
struct HostArenaShared {
  std::byte* base = nullptr;
  uint64_t size = 0;
  std::atomic<bool> sealed{false};
};

class HostArenaWriter final : public ArenaWriter {
 public:
  HostArenaWriter(std::shared_ptr<HostArenaShared> shared, int threads, uint64_t max_chunk)
      : shared_(std::move(shared)), threads_(threads), max_chunk_(max_chunk) {}

  Result<std::span<std::byte>> Begin(int t, uint64_t offset, uint64_t len) override {
    if (shared_->sealed.load(std::memory_order_acquire)) {
      return FailedPrecondition("host arena writer used after the arena was sealed");
    }
    RETURN_IF_ERROR(CheckSlot(t));
    RETURN_IF_ERROR(CheckWriterChunk(offset, len, max_chunk_, shared_->size, "host arena"));
    // base is null for an empty arena; then offset and len are 0.
    return std::span<std::byte>(shared_->base + offset, static_cast<size_t>(len));
  }

  // The bytes are already in place: nothing to hand over.
  Status End(int t) override { return CheckSlot(t); }

  Status Finish() override { return Status::Ok(); }

 private:
  Status CheckSlot(int t) const {
    if (t < 0 || t >= threads_) {
      return InvalidArgument("writer thread index " + std::to_string(t) + " is not in [0, " +
                             std::to_string(threads_) + ")");
    }
    return Status::Ok();
  }

  std::shared_ptr<HostArenaShared> shared_;
  int threads_;
  uint64_t max_chunk_;
};

class HostArena final : public Arena {
 public:
  HostArena(UniqueFd fd, uint64_t size) : fd_(std::move(fd)), size_(size) {
    shared_ = std::make_shared<HostArenaShared>();
    shared_->size = size;
  }

  ~HostArena() override { Unmap(); }

  HostArena(const HostArena&) = delete;
  HostArena& operator=(const HostArena&) = delete;

  Status MapReadWrite() {
    if (size_ == 0) return Status::Ok();
    void* addr = ::mmap(nullptr, static_cast<size_t>(size_), PROT_READ | PROT_WRITE, MAP_SHARED,
                        fd_.get(), 0);
    if (addr == MAP_FAILED) {
      return ErrnoError("mmap of a " + std::to_string(size_) + "-byte host arena", errno);
    }
    shared_->base = static_cast<std::byte*>(addr);
    return Status::Ok();
  }

  Device device() const override { return Device::Host(); }
  uint64_t size() const override { return size_; }
  uint64_t allocation_size() const override { return size_; }

  Result<std::unique_ptr<ArenaWriter>> OpenWriter(int threads, uint64_t max_chunk) override {
    if (sealed_) return FailedPrecondition("cannot open a writer on a sealed host arena");
    if (threads < 1) {
      return InvalidArgument("a writer needs at least one thread slot, not " +
                             std::to_string(threads));
    }
    if (max_chunk == 0) return InvalidArgument("a writer's max_chunk must be at least one byte");
    return std::unique_ptr<ArenaWriter>(new HostArenaWriter(shared_, threads, max_chunk));
  }

  Status Seal() override {
    if (sealed_) return FailedPrecondition("host arena is already sealed");
    Unmap();
    // munmap first: F_SEAL_WRITE fails with EBUSY while any writable shared
    // mapping of the memfd exists.
    constexpr int kSeals = F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;
    if (::fcntl(fd_.get(), F_ADD_SEALS, kSeals) != 0) {
      return ErrnoError("sealing the host arena memfd (F_ADD_SEALS)", errno);
    }
    sealed_ = true;
    return Status::Ok();
  }

  Result<UniqueFd> Export() const override {
    if (!sealed_) return FailedPrecondition("cannot export a host arena before Seal()");
    // Reopening through /proc gives the importer its own read-only open file
    // description: mmap(PROT_WRITE, MAP_SHARED) of it fails with EACCES
    // whatever the seals say, and it cannot be turned writable by fcntl.
    std::string path = "/proc/self/fd/" + std::to_string(fd_.get());
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd >= 0) return UniqueFd(fd);
    int open_errno = errno;
    if (open_errno != ENOENT && open_errno != EACCES) {
      return ErrnoError("reopening the host arena read-only through " + path, open_errno);
    }
    // No /proc (or not allowed to reopen): share the writable description.
    // The seals still forbid every write, resize and writable shared mapping.
    spdlog::debug("{} unavailable ({}); exporting a dup of the sealed memfd", path,
                  std::strerror(open_errno));
    fd = ::fcntl(fd_.get(), F_DUPFD_CLOEXEC, 0);
    if (fd < 0) return ErrnoError("duplicating the host arena memfd", errno);
    return UniqueFd(fd);
  }

 private:
  void Unmap() noexcept {
    shared_->sealed.store(true, std::memory_order_release);
    if (shared_->base != nullptr) {
      if (::munmap(shared_->base, static_cast<size_t>(size_)) != 0) {
        spdlog::error("munmap of a {}-byte host arena failed: {}", size_, std::strerror(errno));
      }
      shared_->base = nullptr;
    }
  }

  UniqueFd fd_;
  uint64_t size_;
  bool sealed_ = false;
  std::shared_ptr<HostArenaShared> shared_;
};

}  // namespace

Result<std::unique_ptr<Arena>> CreateHostArena(uint64_t size) {
  if (size > static_cast<uint64_t>(std::numeric_limits<off_t>::max())) {
    return InvalidArgument("host arena size " + std::to_string(size) + " is too large");
  }
  int fd = ::memfd_create("hearth-arena", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return ErrnoError("memfd_create for a host arena", errno);
  UniqueFd owned(fd);
  if (::ftruncate(owned.get(), static_cast<off_t>(size)) != 0) {
    return ErrnoError("sizing a host arena to " + std::to_string(size) + " bytes", errno);
  }
  auto arena = std::make_unique<HostArena>(std::move(owned), size);
  RETURN_IF_ERROR(arena->MapReadWrite());
  return std::unique_ptr<Arena>(std::move(arena));
}

}  // namespace hearth
