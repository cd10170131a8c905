// Host arenas: a platform::Section (a sealed memfd on Linux).
//
// Create: a section mapped read-write, which writers fill in place. Seal:
// the section unmaps its writable view and seals itself against every
// change. Export: a read-only handle of it (platform/section.h).
#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <limits>
#include <string>

#include "memory/arena_kinds.h"
#include "platform/section.h"

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
  explicit HostArena(platform::Section section) : section_(std::move(section)) {
    shared_ = std::make_shared<HostArenaShared>();
    shared_->size = section_.size();
    shared_->base = section_.writable().data();
  }

  ~HostArena() override { shared_->sealed.store(true, std::memory_order_release); }

  HostArena(const HostArena&) = delete;
  HostArena& operator=(const HostArena&) = delete;

  Device device() const override { return Device::Host(); }
  uint64_t size() const override { return section_.size(); }
  uint64_t allocation_size() const override { return section_.size(); }

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
    shared_->sealed.store(true, std::memory_order_release);
    shared_->base = nullptr;
    RETURN_IF_ERROR(section_.Seal().WithContext("sealing the host arena"));
    sealed_ = true;
    return Status::Ok();
  }

#ifdef _WIN32
  Result<uint64_t> ExportTo(uint32_t peer_pid) const override {
    if (!sealed_) return FailedPrecondition("cannot export a host arena before Seal()");
    ASSIGN_OR_RETURN(const platform::NativeHandle h, section_.ShareReadOnly(peer_pid));
    return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(h));
  }
#else
  Result<UniqueFd> Export() const override {
    if (!sealed_) return FailedPrecondition("cannot export a host arena before Seal()");
    ASSIGN_OR_RETURN(const platform::NativeHandle fd, section_.ShareReadOnly(0));
    return UniqueFd(fd);
  }
#endif

 private:
  platform::Section section_;
  bool sealed_ = false;
  std::shared_ptr<HostArenaShared> shared_;
};

}  // namespace

Result<std::unique_ptr<Arena>> CreateHostArena(uint64_t size) {
  if (size > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return InvalidArgument("host arena size " + std::to_string(size) + " is too large");
  }
  Result<platform::Section> section = platform::Section::Create(size, "hearth-arena");
  if (!section.ok()) return section.status().WithContext("creating a host arena");
  return std::unique_ptr<Arena>(std::make_unique<HostArena>(std::move(section).value()));
}

}  // namespace hearth
