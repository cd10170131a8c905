#include "loadgen/system_shm.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <utility>

namespace hearth {
namespace {

// The names a signal handler must unlink. The handler reads only `live`
// and `path` (unlink(2) is async-signal-safe, shm_unlink is not listed as
// such): a path is written while its entry is not live, and glibc keeps
// POSIX shared memory in /dev/shm.
constexpr size_t kCleanupEntries = 4096;
constexpr char kShmDirectory[] = "/dev/shm";
struct CleanupEntry {
  std::atomic<bool> live{false};
  bool reserved = false;  // under g_table_mu
  char path[sizeof(kShmDirectory) + 256] = {};
};
std::array<CleanupEntry, kCleanupEntries> g_table;
std::mutex g_table_mu;

int ReserveEntry(const std::string& key) {
  std::lock_guard lock(g_table_mu);
  for (size_t i = 0; i < g_table.size(); ++i) {
    CleanupEntry& entry = g_table[i];
    if (entry.reserved) continue;
    entry.reserved = true;
    std::snprintf(entry.path, sizeof(entry.path), "%s%s", kShmDirectory, key.c_str());
    entry.live.store(true, std::memory_order_release);
    return static_cast<int>(i);
  }
  return -1;
}

void ReleaseEntry(int index) {
  std::lock_guard lock(g_table_mu);
  g_table[static_cast<size_t>(index)].live.store(false, std::memory_order_release);
  g_table[static_cast<size_t>(index)].reserved = false;
}

constexpr std::array<int, 4> kCleanupSignals = {SIGINT, SIGTERM, SIGHUP, SIGQUIT};
std::atomic<bool> g_installed{false};
std::array<struct sigaction, kCleanupSignals.size()> g_old_actions;

void CleanupHandler(int signal_number) {
  const int saved_errno = errno;
  for (CleanupEntry& entry : g_table) {
    if (entry.live.load(std::memory_order_acquire)) ::unlink(entry.path);
  }
  // Give the signal the disposition it had (the default: end the process)
  // and deliver it again once this handler returns.
  for (size_t i = 0; i < kCleanupSignals.size(); ++i) {
    if (kCleanupSignals[i] == signal_number) ::sigaction(signal_number, &g_old_actions[i], nullptr);
  }
  ::raise(signal_number);
  errno = saved_errno;
}

}  // namespace

Result<SystemShmObject> SystemShmObject::Create(const std::string& key, size_t bytes) {
  if (key.size() < 2 || key.size() > 255 || key[0] != '/' ||
      key.find('/', 1) != std::string::npos || key.find('\0') != std::string::npos)
    return InvalidArgument("shared-memory key '" + key + "' is not /name");
  if (bytes == 0) return InvalidArgument("shared-memory object " + key + " of 0 bytes");
  SystemShmObject object;
  object.key_ = key;
  // Reserved before the object exists, so that no instant has it on disk
  // without a signal handler knowing its name.
  object.cleanup_index_ = ReserveEntry(key);
  if (object.cleanup_index_ < 0)
    return ResourceExhausted("more than " + std::to_string(kCleanupEntries) +
                             " shared-memory objects at once");
  const int fd = ::shm_open(key.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) {
    const int error = errno;
    // Not ours: never unlinked.
    ReleaseEntry(std::exchange(object.cleanup_index_, -1));
    if (error == EEXIST) return AlreadyExists("shared-memory object " + key + " already exists");
    return ErrnoError("shm_open " + key, error);
  }
  object.fd_.Reset(fd);
  // The server refuses an object that group or others may write; the umask
  // may only have narrowed 0600, and the owner needs both bits.
  if (::fchmod(fd, 0600) != 0) return ErrnoError("fchmod " + key, errno);
  // Allocated now, not on first touch: a full /dev/shm is ENOSPC here, not
  // SIGBUS when the inputs are written.
  if (const int error = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes)); error != 0)
    return ErrnoError("allocating " + std::to_string(bytes) + " bytes for " + key, error);
  void* data = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (data == MAP_FAILED) return ErrnoError("mmap " + key, errno);
  object.data_ = static_cast<std::byte*>(data);
  object.size_ = bytes;
  return object;
}

SystemShmObject::SystemShmObject(SystemShmObject&& other) noexcept
    : key_(std::move(other.key_)),
      fd_(std::move(other.fd_)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      cleanup_index_(std::exchange(other.cleanup_index_, -1)) {}

SystemShmObject& SystemShmObject::operator=(SystemShmObject&& other) noexcept {
  if (this != &other) {
    Reset();
    key_ = std::move(other.key_);
    fd_ = std::move(other.fd_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    cleanup_index_ = std::exchange(other.cleanup_index_, -1);
  }
  return *this;
}

SystemShmObject::~SystemShmObject() { Reset(); }

void SystemShmObject::Unlink() {
  if (cleanup_index_ < 0) return;
  ::shm_unlink(key_.c_str());  // ENOENT: a signal handler was first
  ReleaseEntry(std::exchange(cleanup_index_, -1));
}

void SystemShmObject::Reset() {
  Unlink();
  if (data_ != nullptr) ::munmap(data_, size_);
  data_ = nullptr;
  size_ = 0;
  fd_.Reset();
}

Result<ShmSignalCleanup> ShmSignalCleanup::Install() {
  if (g_installed.exchange(true))
    return FailedPrecondition("the shared-memory signal cleanup is already installed");
  struct sigaction action {};
  action.sa_handler = CleanupHandler;
  sigemptyset(&action.sa_mask);
  for (int s : kCleanupSignals) sigaddset(&action.sa_mask, s);
  for (size_t i = 0; i < kCleanupSignals.size(); ++i) {
    if (::sigaction(kCleanupSignals[i], &action, &g_old_actions[i]) != 0) {
      const int error = errno;
      for (size_t j = 0; j < i; ++j) ::sigaction(kCleanupSignals[j], &g_old_actions[j], nullptr);
      g_installed = false;
      return ErrnoError("sigaction", error);
    }
  }
  ShmSignalCleanup cleanup;
  cleanup.installed_ = true;
  return cleanup;
}

ShmSignalCleanup::ShmSignalCleanup(ShmSignalCleanup&& other) noexcept
    : installed_(std::exchange(other.installed_, false)) {}

ShmSignalCleanup& ShmSignalCleanup::operator=(ShmSignalCleanup&& other) noexcept {
  if (this != &other) {
    this->~ShmSignalCleanup();
    installed_ = std::exchange(other.installed_, false);
  }
  return *this;
}

ShmSignalCleanup::~ShmSignalCleanup() {
  if (!installed_) return;
  for (size_t i = 0; i < kCleanupSignals.size(); ++i)
    ::sigaction(kCleanupSignals[i], &g_old_actions[i], nullptr);
  installed_ = false;
  g_installed = false;
}

namespace bench {

Result<std::unique_ptr<SystemShmRegion>> SystemShmRegion::Create(const std::string& key,
                                                                 uint64_t bytes) {
  if (bytes > SIZE_MAX) return InvalidArgument("shared-memory object " + key + " is too large");
  ASSIGN_OR_RETURN(SystemShmObject object,
                   SystemShmObject::Create(key, static_cast<size_t>(bytes)));
  return std::unique_ptr<SystemShmRegion>(new SystemShmRegion(std::move(object)));
}

RegionHandle SystemShmRegion::Handle() const {
  RegionHandle handle;
  handle.kind = BenchSharedMemory::kSystem;
  handle.key = object_.key();
  handle.byte_size = object_.size();
  return handle;
}

Status SystemShmRegion::Write(uint64_t offset, const void* data, uint64_t bytes) {
  RETURN_IF_ERROR(CheckRange(offset, bytes, "a write"));
  std::memcpy(object_.data() + offset, data, bytes);
  return Status::Ok();
}

Status SystemShmRegion::Fill(uint64_t offset, unsigned char value, uint64_t bytes) {
  RETURN_IF_ERROR(CheckRange(offset, bytes, "a fill"));
  std::memset(object_.data() + offset, value, bytes);
  return Status::Ok();
}

Status SystemShmRegion::Read(uint64_t offset, void* out, uint64_t bytes) const {
  RETURN_IF_ERROR(CheckRange(offset, bytes, "a read"));
  std::memcpy(out, object_.data() + offset, bytes);
  return Status::Ok();
}

}  // namespace bench
}  // namespace hearth
