// Choices that a worker makes by timing (the CUDA executor's GEMM
// algorithms), kept in a file shared by every worker of the user on this
// machine, so that all of them make the same choice. The same choice is what
// lets a stream resume on another worker with the same tokens: an algorithm
// fixes the order of a dot product's sums, and two workers that timed their
// candidates apart could keep different ones. It also spares each later
// worker the timing.
//
// The file: one entry per line, "key<TAB>value\n", keys and values of
// printable ASCII without tabs. It is opened under an exclusive flock(2),
// held from Open until the PlanCache is destroyed, so that the first worker
// times and writes while the others wait, then read its choice. The file and
// its folder must belong to the user and be writable by nobody else;
// otherwise Open fails, naming why (the caller then times on its own and
// says so).
//
// Thread-safety: one thread per PlanCache.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "hearth/status.h"

namespace hearth::llm {

class PlanCache {
 public:
  // Most bytes a cache file may hold; a larger one is refused.
  static constexpr uint64_t kMaxFileBytes = uint64_t{1} << 20;

  // Opens (creating, 0600) and locks `path`; creates its folder (0700) when
  // missing. A line that is not an entry is dropped and said in notes().
  static Result<PlanCache> Open(const std::string& path);
  PlanCache(PlanCache&& other) noexcept;
  PlanCache& operator=(PlanCache&& other) = delete;
  PlanCache(const PlanCache&) = delete;
  ~PlanCache();

  std::optional<std::string> Get(std::string_view key) const;
  // InvalidArgument for a key or value that is empty or holds a tab, a
  // newline or a byte outside printable ASCII.
  Status Put(std::string_view key, std::string_view value);
  // Writes the entries back (whole, in place, while the lock is held) when
  // Put changed any.
  Status Save();

  // What Open found wrong in the file (dropped lines), for the log.
  const std::vector<std::string>& notes() const { return notes_; }
  const std::string& path() const { return path_; }

 private:
  PlanCache(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}

  std::string path_;
  int fd_ = -1;
  std::map<std::string, std::string, std::less<>> entries_;
  std::vector<std::string> notes_;
  bool changed_ = false;
};

// Where the cache of `name` lives: $HEARTH_CACHE_DIR/name, else
// $XDG_CACHE_HOME/hearth/name, else $HOME/.cache/hearth/name; nullopt when
// HEARTH_CACHE_DIR is "off" or none of them is set.
std::optional<std::string> DefaultPlanCachePath(std::string_view name);

}  // namespace hearth::llm
