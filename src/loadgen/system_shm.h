// The POSIX shared-memory objects `hearth bench --shared-memory system` makes
// for its requests' inputs and outputs (Triton's system shared-memory
// extension): created by this process, mapped read-write here, registered
// with the server by name, key, offset and size.
//
// Never left behind: an object's name is unlinked as soon as the server
// has registered it (a KServe/Triton server opens the key once, at
// registration, and keeps its own descriptor or mapping: hearth's
// server/shared_memory.h does), else by the owner's destructor, and, while
// ShmSignalCleanup is installed, by SIGINT, SIGTERM, SIGHUP or SIGQUIT
// before the signal takes its course. Only SIGKILL between creation and
// registration can leave one.
#pragma once

#include <signal.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "hearth/status.h"
#include "hearth/unique_fd.h"
#include "loadgen/shm_region.h"

namespace hearth {

// One object: shm_open(O_CREAT|O_EXCL, 0600) by this user, sized, mapped
// shared read-write. Move-only; the destructor unmaps, closes and unlinks
// the name if it is still linked. Not thread-safe; the mapping's bytes may
// be shared with other threads and the server as the caller arranges.
class SystemShmObject {
 public:
  // `key`: "/name" (one leading '/', no other, at most 255 bytes). Fails
  // with AlreadyExists when an object of that name exists: it is never
  // opened, truncated or unlinked.
  static Result<SystemShmObject> Create(const std::string& key, size_t bytes);

  SystemShmObject() = default;
  SystemShmObject(SystemShmObject&& other) noexcept;
  SystemShmObject& operator=(SystemShmObject&& other) noexcept;
  SystemShmObject(const SystemShmObject&) = delete;
  SystemShmObject& operator=(const SystemShmObject&) = delete;
  ~SystemShmObject();

  const std::string& key() const { return key_; }
  std::byte* data() const { return data_; }
  size_t size() const { return size_; }
  bool linked() const { return cleanup_index_ >= 0; }

  // Removes the name (the mapping and any descriptor the server holds stay
  // valid). Idempotent.
  void Unlink();

 private:
  void Reset();

  std::string key_;
  UniqueFd fd_;
  std::byte* data_ = nullptr;
  size_t size_ = 0;
  int cleanup_index_ = -1;  // this object's entry in the signal-time table; -1: unlinked
};

// While alive, SIGINT, SIGTERM, SIGHUP and SIGQUIT first unlink every
// SystemShmObject name still linked, then get the disposition they had
// before (re-raised). One at a time per process (the second Install fails);
// restores the old dispositions when destroyed.
class ShmSignalCleanup {
 public:
  static Result<ShmSignalCleanup> Install();
  ShmSignalCleanup() = default;
  ShmSignalCleanup(ShmSignalCleanup&& other) noexcept;
  ShmSignalCleanup& operator=(ShmSignalCleanup&& other) noexcept;
  ShmSignalCleanup(const ShmSignalCleanup&) = delete;
  ShmSignalCleanup& operator=(const ShmSignalCleanup&) = delete;
  ~ShmSignalCleanup();

 private:
  bool installed_ = false;
};

namespace bench {

// `--shared-memory system`: a slot's region in an object of its own,
// registered by its key at offset 0; its name is unlinked once registered.
class SystemShmRegion final : public ShmRegion {
 public:
  static Result<std::unique_ptr<SystemShmRegion>> Create(const std::string& key, uint64_t bytes);

  uint64_t size() const override { return object_.size(); }
  RegionHandle Handle() const override;
  std::string Describe() const override { return object_.key(); }
  void Registered() override { object_.Unlink(); }
  Status Write(uint64_t offset, const void* data, uint64_t bytes) override;
  Status Fill(uint64_t offset, unsigned char value, uint64_t bytes) override;
  Status Read(uint64_t offset, void* out, uint64_t bytes) const override;

  const SystemShmObject& object() const { return object_; }

 private:
  explicit SystemShmRegion(SystemShmObject object) : object_(std::move(object)) {}
  SystemShmObject object_;
};

}  // namespace bench
}  // namespace hearth
