#include "store/event_loop.h"

#include <spdlog/spdlog.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <optional>
#include <utility>

namespace hearth::store {

using std::chrono::milliseconds;

EventLoop::EventLoop(const StoreOptions& options, Registry* registry)
    : options_(options), registry_(registry), loads_(options.device, options.load_threads) {}

Status EventLoop::Init() {
  stop_fd_.Reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  epoll_.Reset(::epoll_create1(EPOLL_CLOEXEC));
  if (!stop_fd_ || !epoll_) return ErrnoError("creating the event loop", errno);
  RETURN_IF_ERROR(loads_.Init());
  limits_ = ResolveLimits(options_);
  return Status::Ok();
}

Status EventLoop::Listen(UniqueFd listener) {
  listen_ = std::move(listener);
  RETURN_IF_ERROR(Watch(listen_.get(), EPOLLIN, kListenTag));
  RETURN_IF_ERROR(Watch(stop_fd_.get(), EPOLLIN, kStopTag));
  RETURN_IF_ERROR(Watch(loads_.fd(), EPOLLIN, kLoadTag));
  return Status::Ok();
}

Status EventLoop::Run() {
  std::vector<epoll_event> events(64);
  while (!stopping_) {
    const int n =
        ::epoll_wait(epoll_.get(), events.data(), static_cast<int>(events.size()), TimeoutMs());
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError("epoll_wait", errno);
    }
    for (int i = 0; i < n; ++i) {
      const uint64_t tag = events[i].data.u64;
      if (tag == kStopTag) {
        stopping_ = true;
      } else if (tag == kListenTag) {
        AcceptSome();
      } else if (tag == kLoadTag) {
        FinishLoads();
      } else {
        OnConnectionEvent(tag, events[i].events);
      }
    }
    RunTimers();
    ServiceReady();
  }
  return Status::Ok();
}

void EventLoop::Stop() {
  const uint64_t one = 1;
  // write(2) is async-signal-safe; nothing to do if it fails (already signalled).
  [[maybe_unused]] ssize_t n = ::write(stop_fd_.get(), &one, sizeof one);
}

void EventLoop::CloseAll() {
  listen_.Reset();
  connections_.clear();
}

Status EventLoop::Watch(int fd, uint32_t events, uint64_t tag) {
  epoll_event ev{};
  ev.events = events;
  ev.data.u64 = tag;
  if (::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, fd, &ev) != 0) return ErrnoError("epoll_ctl", errno);
  return Status::Ok();
}

Connection* EventLoop::FindConnection(uint64_t id) {
  auto it = connections_.find(id);
  return it == connections_.end() ? nullptr : it->second.get();
}

// ---- timers ------------------------------------------------------------------

int EventLoop::TimeoutMs() const {
  if (!ready_.empty()) return 0;
  std::optional<Clock::time_point> next;
  if (accept_paused_) next = accept_resume_at_;
  if (in_flight_fds_ > 0) next = next ? std::min(*next, next_sweep_) : next_sweep_;
  if (SomethingWaits()) next = next ? std::min(*next, next_wait_check_) : next_wait_check_;
  if (!next) return -1;
  const auto left = std::chrono::ceil<milliseconds>(*next - Clock::now()).count();
  return static_cast<int>(std::clamp<int64_t>(left, 0, 60000));
}

void EventLoop::RunTimers() {
  const Clock::time_point now = Clock::now();
  if (accept_paused_ && now >= accept_resume_at_) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = kListenTag;
    ::epoll_ctl(epoll_.get(), EPOLL_CTL_MOD, listen_.get(), &ev);
    accept_paused_ = false;
  }
  if (in_flight_fds_ > 0 && now >= next_sweep_) {
    next_sweep_ = now + kInFlightSweep;
    for (auto& [id, c] : connections_) {
      if (c->in_flight_fds > 0 && RefreshInFlight(*c)) MarkReady(*c);
    }
  }
  if (SomethingWaits() && now >= next_wait_check_) {
    next_wait_check_ = now + limits_.wait_check_interval;
    ExpireWaitingAttaches(now);
    CloseStalledConnections(now);
  }
}

void EventLoop::ExpireWaitingAttaches(Clock::time_point now) {
  std::vector<uint64_t> expired;
  for (uint64_t id : deferred_) {
    Connection* c = FindConnection(id);
    if (c != nullptr && c->deferred && now - c->deferred_since >= limits_.attach_wait_timeout)
      expired.push_back(id);
  }
  for (uint64_t id : expired) {
    Connection& c = *FindConnection(id);
    std::erase(deferred_, id);
    ++counters_["attach_wait_timeouts"];
    spdlog::warn(
        "attach of {} by pid {} waited {} ms for the cap of {} unread descriptors; "
        "answered RESOURCE_EXHAUSTED",
        c.deferred->model.ToString(), c.pid, limits_.attach_wait_timeout.count(),
        limits_.max_unread_fds);
    QueueError(
        c, ResourceExhausted("the store's " + std::to_string(limits_.max_unread_fds) +
                             " descriptors for clients are all sent and not read yet; attach of " +
                             c.deferred->model.ToString() + " waited " +
                             std::to_string(limits_.attach_wait_timeout.count()) +
                             " ms (attach_wait_timeout); try again later"));
    c.deferred.reset();
    MarkReady(c);
  }
}

// While others wait, a connection whose peer has taken nothing of what it
// holds for unread_timeout is closed: for the descriptor cap, those with
// descriptors unread; for the reply budget, those with replies queued.
void EventLoop::CloseStalledConnections(Clock::time_point now) {
  const bool for_fds = !deferred_.empty();
  const bool for_bytes = !output_waiters_.empty();
  std::vector<uint64_t> stalled;
  for (auto& [id, c] : connections_) {
    const bool holds =
        (for_fds && c->queued_fds + c->in_flight_fds > 0) || (for_bytes && c->queued_bytes > 0);
    if (!holds || now - c->last_progress < limits_.unread_timeout) continue;
    // What the kernel shows now, not what the last sweep saw.
    if (!Flush(*c)) {
      stalled.push_back(id);
      continue;
    }
    RefreshInFlight(*c);
    const bool still =
        (for_fds && c->queued_fds + c->in_flight_fds > 0) || (for_bytes && c->queued_bytes > 0);
    if (still && now - c->last_progress >= limits_.unread_timeout) stalled.push_back(id);
  }
  for (uint64_t id : stalled) {
    Connection& c = *FindConnection(id);
    ++counters_["stalled_connections_closed"];
    spdlog::warn(
        "closing connection from pid {} uid {}: its peer read nothing of {} descriptors and {} "
        "bytes of replies for {} ms (unread_timeout) while {} attaches wait for the descriptor "
        "cap and {} connections for the reply budget",
        c.pid, c.uid, c.queued_fds + c.in_flight_fds, c.queued_bytes,
        limits_.unread_timeout.count(), deferred_.size(), output_waiters_.size());
    Close(id);
  }
}

}  // namespace hearth::store
