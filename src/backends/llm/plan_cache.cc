#include "backends/llm/plan_cache.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <thread>

namespace hearth::llm {
namespace {

std::string Errno(const std::string& what, const std::string& path) {
  return what + " " + path + ": " + std::strerror(errno);
}

// Ours alone: owned by us, writable by nobody else.
Status CheckOwned(const struct stat& st, const std::string& path, const char* kind) {
  if (st.st_uid != ::geteuid())
    return PermissionDenied("the plan cache " + std::string(kind) + " " + path +
                            " belongs to uid " + std::to_string(st.st_uid) + ", not to us (" +
                            std::to_string(::geteuid()) + ")");
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0)
    return PermissionDenied("the plan cache " + std::string(kind) + " " + path +
                            " is writable by others");
  return Status::Ok();
}

bool Printable(std::string_view s) {
  if (s.empty()) return false;
  for (const char c : s)
    if (c < 0x20 || c > 0x7e) return false;
  return true;
}

// How long Open waits for another worker's lock (its timing takes seconds).
constexpr auto kLockWait = std::chrono::seconds(120);

}  // namespace

Result<PlanCache> PlanCache::Open(const std::string& path) {
  namespace fs = std::filesystem;
  const fs::path file(path);
  const fs::path dir = file.parent_path();
  if (dir.empty() || file.filename().empty())
    return InvalidArgument("the plan cache path " + path + " names no file in a folder");
  std::error_code ec;
  if (!fs::exists(dir, ec)) {
    fs::create_directories(dir.parent_path(), ec);
    if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST)
      return Internal(Errno("cannot create the plan cache folder", dir.string()));
  }
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0)
    return Internal(Errno("cannot stat the plan cache folder", dir.string()));
  if (!S_ISDIR(st.st_mode))
    return FailedPrecondition("the plan cache folder " + dir.string() + " is not a folder");
  RETURN_IF_ERROR(CheckOwned(st, dir.string(), "folder"));

  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) return Internal(Errno("cannot open the plan cache", path));
  PlanCache cache(path, fd);  // closes fd on any return below
  if (::fstat(fd, &st) != 0) return Internal(Errno("cannot stat the plan cache", path));
  if (!S_ISREG(st.st_mode))
    return FailedPrecondition("the plan cache " + path + " is not a regular file");
  RETURN_IF_ERROR(CheckOwned(st, path, "file"));

  const auto deadline = std::chrono::steady_clock::now() + kLockWait;
  while (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    if (errno != EWOULDBLOCK && errno != EINTR)
      return Internal(Errno("cannot lock the plan cache", path));
    if (std::chrono::steady_clock::now() >= deadline)
      return Unavailable("the plan cache " + path + " stayed locked by another process for " +
                         std::to_string(kLockWait.count()) + " s");
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }

  if (::fstat(fd, &st) != 0) return Internal(Errno("cannot stat the plan cache", path));
  if (static_cast<uint64_t>(st.st_size) > kMaxFileBytes)
    return FailedPrecondition("the plan cache " + path + " holds " + std::to_string(st.st_size) +
                              " bytes, more than " + std::to_string(kMaxFileBytes));
  std::string text(static_cast<size_t>(st.st_size), '\0');
  size_t got = 0;
  while (got < text.size()) {
    const ssize_t n = ::pread(fd, text.data() + got, text.size() - got, static_cast<off_t>(got));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return Internal(Errno("cannot read the plan cache", path));
    got += static_cast<size_t>(n);
  }
  size_t at = 0, line = 0;
  while (at < text.size()) {
    ++line;
    const size_t end = text.find('\n', at);
    const std::string_view l(text.data() + at, (end == std::string::npos ? text.size() : end) - at);
    at = end == std::string::npos ? text.size() : end + 1;
    const size_t tab = l.find('\t');
    if (end == std::string::npos || tab == std::string_view::npos || !Printable(l.substr(0, tab)) ||
        !Printable(l.substr(tab + 1))) {
      cache.notes_.push_back(path + " line " + std::to_string(line) +
                             " is not a key<TAB>value entry: dropped");
      cache.changed_ = true;
      continue;
    }
    cache.entries_[std::string(l.substr(0, tab))] = std::string(l.substr(tab + 1));
  }
  return cache;
}

PlanCache::PlanCache(PlanCache&& other) noexcept
    : path_(std::move(other.path_)),
      fd_(std::exchange(other.fd_, -1)),
      entries_(std::move(other.entries_)),
      notes_(std::move(other.notes_)),
      changed_(other.changed_) {}

PlanCache::~PlanCache() {
  if (fd_ >= 0) ::close(fd_);  // releases the lock
}

std::optional<std::string> PlanCache::Get(std::string_view key) const {
  const auto it = entries_.find(key);
  if (it == entries_.end()) return std::nullopt;
  return it->second;
}

Status PlanCache::Put(std::string_view key, std::string_view value) {
  if (!Printable(key) || key.find('\t') != std::string_view::npos)
    return InvalidArgument("a plan cache key must be printable ASCII without tabs");
  if (!Printable(value) || value.find('\t') != std::string_view::npos)
    return InvalidArgument("a plan cache value must be printable ASCII without tabs");
  auto it = entries_.find(key);
  if (it != entries_.end() && it->second == value) return Status::Ok();
  entries_[std::string(key)] = std::string(value);
  changed_ = true;
  return Status::Ok();
}

Status PlanCache::Save() {
  if (!changed_) return Status::Ok();
  std::string text;
  for (const auto& [k, v] : entries_) text += k + "\t" + v + "\n";
  if (text.size() > kMaxFileBytes)
    return ResourceExhausted("the plan cache " + path_ + " would hold " +
                             std::to_string(text.size()) + " bytes, more than " +
                             std::to_string(kMaxFileBytes));
  if (::ftruncate(fd_, 0) != 0) return Internal(Errno("cannot truncate the plan cache", path_));
  size_t put = 0;
  while (put < text.size()) {
    const ssize_t n = ::pwrite(fd_, text.data() + put, text.size() - put, static_cast<off_t>(put));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return Internal(Errno("cannot write the plan cache", path_));
    put += static_cast<size_t>(n);
  }
  changed_ = false;
  return Status::Ok();
}

std::optional<std::string> DefaultPlanCachePath(std::string_view name) {
  const auto env = [](const char* key) -> std::optional<std::string> {
    const char* v = std::getenv(key);
    if (v == nullptr || *v == '\0') return std::nullopt;
    return std::string(v);
  };
  if (const auto dir = env("HEARTH_CACHE_DIR")) {
    if (*dir == "off") return std::nullopt;
    return *dir + "/" + std::string(name);
  }
  if (const auto xdg = env("XDG_CACHE_HOME")) return *xdg + "/hearth/" + std::string(name);
  if (const auto home = env("HOME")) return *home + "/.cache/hearth/" + std::string(name);
  return std::nullopt;
}

}  // namespace hearth::llm
