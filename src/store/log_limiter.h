// Rate-limited log lines for events a peer can cause over and over.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <utility>

namespace hearth::store {

// At most one log line per interval for one kind of event; the next line
// written says how many were left out. A flood of refused peers or failing
// accepts then costs a line a second, not a line per event.
class LogLimiter {
 public:
  // True if a line may be written now; *dropped receives the number left out since the last one.
  bool Allow(uint64_t* dropped) {
    const std::chrono::steady_clock::time_point now = std::chrono::steady_clock::now();
    if (any_ && now - last_ < kInterval) {
      ++dropped_;
      return false;
    }
    any_ = true;
    last_ = now;
    *dropped = std::exchange(dropped_, 0);
    return true;
  }

 private:
  static constexpr std::chrono::milliseconds kInterval{1000};
  bool any_ = false;
  std::chrono::steady_clock::time_point last_;
  uint64_t dropped_ = 0;
};

// What a line that LogLimiter allowed adds: how many were left out before it.
inline std::string Dropped(uint64_t n) {
  return n == 0 ? std::string() : " (" + std::to_string(n) + " similar lines left out)";
}

}  // namespace hearth::store
