// Tells a supervisor at once that its idle worker died: one thread (per
// server) waits in epoll for the end of every live worker's control socket
// and calls what the socket's supervisor registered (its queue's Nudge,
// which makes it look at its worker now instead of at its next idle tick).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <thread>

#include "hearth/status.h"
#include "hearth/unique_fd.h"

namespace hearth {

class HangupWatcher {
 public:
  HangupWatcher() = default;
  ~HangupWatcher();
  HangupWatcher(const HangupWatcher&) = delete;
  HangupWatcher& operator=(const HangupWatcher&) = delete;

  // Starts the thread. An error leaves the watcher off: Watch then fails and
  // supervisors notice deaths at their idle tick, as without it.
  Status Start();

  using Id = uint64_t;
  // Calls `on_hangup` (once, from the watcher's thread, no lock of the
  // caller's held) when the peer of socket `fd` has closed it. The id is for
  // Forget, which must come before `fd` is closed.
  Result<Id> Watch(int fd, std::function<void()> on_hangup);
  // Stops watching: once it returns, the callback is not running and will
  // not be called.
  void Forget(Id id, int fd);

 private:
  void Run();

  UniqueFd epoll_, wake_;
  std::thread thread_;
  std::mutex mu_;  // callbacks_, next_; held while a callback runs
  std::map<Id, std::function<void()>> callbacks_;
  Id next_ = 1;  // 0 is the wake descriptor's
};

}  // namespace hearth
