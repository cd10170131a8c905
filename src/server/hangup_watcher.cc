#include "server/hangup_watcher.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <system_error>

namespace hearth {

Status HangupWatcher::Start() {
  epoll_.Reset(::epoll_create1(EPOLL_CLOEXEC));
  if (!epoll_) return ErrnoError("epoll_create1", errno);
  wake_.Reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake_) return ErrnoError("eventfd", errno);
  epoll_event e{};
  e.events = EPOLLIN;
  e.data.u64 = 0;
  if (::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, wake_.get(), &e) != 0)
    return ErrnoError("epoll_ctl", errno);
  try {
    thread_ = std::thread([this] { Run(); });
  } catch (const std::system_error& ex) {
    epoll_.Reset();
    return ResourceExhausted("starting the hang-up watcher's thread: " + std::string(ex.what()));
  }
  return Status::Ok();
}

HangupWatcher::~HangupWatcher() {
  if (!thread_.joinable()) return;
  const uint64_t one = 1;
  (void)!::write(wake_.get(), &one, sizeof one);
  thread_.join();
}

Result<HangupWatcher::Id> HangupWatcher::Watch(int fd, std::function<void()> on_hangup) {
  if (!thread_.joinable()) return Unavailable("the hang-up watcher is not running");
  std::lock_guard lock(mu_);
  const Id id = next_++;
  epoll_event e{};
  // EPOLLHUP is reported whatever is asked; nothing else is.
  e.events = EPOLLRDHUP | EPOLLONESHOT;
  e.data.u64 = id;
  if (::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, fd, &e) != 0) return ErrnoError("epoll_ctl", errno);
  callbacks_.emplace(id, std::move(on_hangup));
  return id;
}

void HangupWatcher::Forget(Id id, int fd) {
  std::lock_guard lock(mu_);
  if (callbacks_.erase(id) == 0) return;
  (void)::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, fd, nullptr);
}

void HangupWatcher::Run() {
  epoll_event events[64];
  for (;;) {
    const int n = ::epoll_wait(epoll_.get(), events, 64, -1);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return;
    for (int i = 0; i < n; ++i) {
      if (events[i].data.u64 == 0) return;  // the destructor's wake
      std::lock_guard lock(mu_);
      auto it = callbacks_.find(events[i].data.u64);
      if (it == callbacks_.end()) continue;  // forgotten since
      // One-shot: the registration stays (disarmed) until Forget.
      it->second();
    }
  }
}

}  // namespace hearth
