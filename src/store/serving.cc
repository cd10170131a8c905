// The event loop's serving of connections: reading requests while the
// store's limits allow, queueing and sending replies, noticing what peers
// have read, closing connections.
#include <linux/sockios.h>
#include <spdlog/spdlog.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <span>
#include <utility>

#include "store/event_loop.h"

namespace hearth::store {
namespace {

using protocol::MessageType;

constexpr int kMaxFramesPerWakeup = 64;
// Replies queued in the store for one connection past which its requests are
// not read: with one reply in hand at most, a connection holds this plus one
// message.
constexpr size_t kPauseQueuedBytes = size_t{1} << 20;

}  // namespace

void EventLoop::MarkReady(Connection& c) {
  if (c.in_ready) return;
  c.in_ready = true;
  ready_.push_back(c.id);
}

void EventLoop::ServiceReady() {
  std::vector<uint64_t> ready;
  ready.swap(ready_);
  for (uint64_t id : ready) {
    if (Connection* c = FindConnection(id)) {
      c->in_ready = false;
      Service(id);
    }
  }
}

void EventLoop::OnConnectionEvent(uint64_t id, uint32_t events) {
  Connection* c = FindConnection(id);
  if (c == nullptr) return;
  if (events & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) c->readable = true;
  if (events & (EPOLLHUP | EPOLLERR)) c->hung_up = true;
  Service(id);
}

// Whether the store may read the connection's next request: not while an
// attach of it waits, nor while its peer leaves replies or descriptors unread.
bool EventLoop::MayRead(const Connection& c) const {
  return WhyNotRead(c) == Connection::Pause::kNone;
}

Connection::Pause EventLoop::WhyNotRead(const Connection& c) const {
  using Pause = Connection::Pause;
  if (c.deferred) return Pause::kAttachWaits;
  if (c.queued_fds + c.in_flight_fds >= limits_.per_connection_fds) return Pause::kDescriptors;
  if (c.queued_bytes >= kPauseQueuedBytes) return Pause::kQueuedBytes;
  if (queued_bytes_ >= limits_.max_queued_bytes) return Pause::kStoreQueuedBytes;
  return Pause::kNone;
}

// Counts a connection the store stops reading while requests of it may be
// waiting, once per pause and by reason; one paused for the store-wide
// budget is woken when the budget has room.
void EventLoop::NotePause(Connection& c) {
  using Pause = Connection::Pause;
  const Pause why = c.readable ? WhyNotRead(c) : Pause::kNone;
  if (why == Pause::kStoreQueuedBytes &&
      std::find(output_waiters_.begin(), output_waiters_.end(), c.id) == output_waiters_.end())
    output_waiters_.push_back(c.id);
  if (why == c.paused) return;
  c.paused = why;
  switch (why) {
    case Pause::kNone:
    case Pause::kAttachWaits:  // counted as attaches_deferred
      break;
    case Pause::kDescriptors:
      ++counters_["reads_paused_for_descriptors"];
      break;
    case Pause::kQueuedBytes:
      ++counters_["reads_paused_for_queued_bytes"];
      break;
    case Pause::kStoreQueuedBytes:
      ++counters_["reads_paused_for_store_queued_bytes"];
      break;
  }
}

// Everything a connection can do now: send what is queued, notice what its
// peer has read, run a waiting attach, read requests while it may.
void EventLoop::Service(uint64_t id) {
  Connection* c = FindConnection(id);
  if (c == nullptr) return;
  if (!Flush(*c)) return Close(id);
  RefreshInFlight(*c);
  if (c->deferred && !c->hung_up) {
    if (unread_fds_ >= limits_.max_unread_fds) {
      if (std::find(deferred_.begin(), deferred_.end(), id) == deferred_.end())
        deferred_.push_front(id);
      return;
    }
    protocol::AttachRequest req = std::move(*c->deferred);
    c->deferred.reset();
    HandleAttach(*c, req);
    if (!Flush(*c)) return Close(id);
  }
  for (int i = 0; i < kMaxFramesPerWakeup && c->readable && MayRead(*c); ++i) {
    if (!ReadOne(*c)) return;  // closed
  }
  NotePause(*c);
  if (c->readable && MayRead(*c)) {
    MarkReady(*c);  // more to read: after the others had their turn
  } else if (c->hung_up && !MayRead(*c)) {
    Close(id);  // gone without reading its answers: nothing left to do for it
  }
}

// Reads and handles one frame; false if the connection was closed.
bool EventLoop::ReadOne(Connection& c) {
  const uint64_t id = c.id;
  UniqueFd fd;
  bool would_block = false;
  Result<size_t> n = protocol::ReceiveFrame(c.fd.get(), frame_buffer_, &fd, &would_block);
  if (!n.ok()) {
    if (n.status().code() == StatusCode::kUnavailable) {
      Close(id);
    } else {
      Reject(id, n.status());
    }
    return false;
  }
  if (would_block) {
    c.readable = false;
    return true;
  }
  Result<bool> complete = c.assembler.Add(std::span(frame_buffer_.data(), *n), std::move(fd));
  ChargePartial(c);
  if (!complete.ok()) {
    Reject(id, complete.status());
    return false;
  }
  if (!*complete) {
    if (partial_bytes_ > limits_.max_partial_bytes) {
      ++counters_["partial_rejections"];
      Reject(id, ResourceExhausted(
                     "unfinished messages of all connections hold " +
                     std::to_string(partial_bytes_) + " bytes, more than the store's budget of " +
                     std::to_string(limits_.max_partial_bytes) +
                     " (--max-partial-bytes); dropping this " + std::to_string(c.partial_charged) +
                     "-byte message in progress"));
      return false;
    }
    return true;
  }
  protocol::Message message = c.assembler.TakeMessage();
  ChargePartial(c);
  if (message.fd.valid()) {
    Reject(id, InvalidArgument("clients may not send descriptors"));
    return false;
  }
  if (Status s = Handle(c, message); !s.ok()) {
    Reject(id, s);
    return false;
  }
  if (!Flush(c)) {
    Close(id);
    return false;
  }
  return true;
}

void EventLoop::ChargePartial(Connection& c) {
  const size_t now = c.assembler.allocated_bytes();
  partial_bytes_ = partial_bytes_ - c.partial_charged + now;
  c.partial_charged = now;
  if (partial_bytes_ > counters_["partial_bytes_peak"])
    counters_["partial_bytes_peak"] = partial_bytes_;
}

// Notices descriptors the peer has taken: SIOCOUTQ of a Unix socket is what
// the peer has not read yet of what was sent on it, so 0 means every reply
// and its descriptor was read. Returns true if the count went down. The
// output edge that wakes the loop when the peer reads comes an instant
// before the kernel's count drops, hence the periodic sweep as well.
bool EventLoop::RefreshInFlight(Connection& c) {
  if (c.in_flight_fds == 0) return false;
  int unread = 0;
  if (::ioctl(c.fd.get(), SIOCOUTQ, &unread) != 0 || unread != 0) return false;
  ReleaseUnread(c.in_flight_fds);
  in_flight_fds_ -= c.in_flight_fds;
  c.in_flight_fds = 0;
  c.last_progress = Clock::now();
  return true;
}

// Descriptors no longer counted against the store-wide cap: attaches that
// waited for it may run, the oldest first, as many as there is room for. A
// woken attach that finds the room taken again goes back to the front.
void EventLoop::ReleaseUnread(size_t n) {
  unread_fds_ -= n;
  size_t room = unread_fds_ < limits_.max_unread_fds ? limits_.max_unread_fds - unread_fds_ : 0;
  while (room > 0 && !deferred_.empty()) {
    const uint64_t id = deferred_.front();
    deferred_.pop_front();
    if (Connection* c = FindConnection(id); c != nullptr && c->deferred) {
      MarkReady(*c);
      --room;
    }
  }
}

// A protocol violation or a peer over a limit: tell it why, log it, drop the connection.
void EventLoop::Reject(uint64_t id, const Status& why) {
  Connection* c = FindConnection(id);
  if (c == nullptr) return;
  if (uint64_t dropped; reject_log_.Allow(&dropped))
    spdlog::warn("closing connection from pid {}: {}{}", c->pid, why.message(), Dropped(dropped));
  Flush(*c);
  SendAndForget(c->fd.get(), why);
  Close(id);
}

void EventLoop::Close(uint64_t id) {
  auto it = connections_.find(id);
  if (it == connections_.end()) return;
  Connection& c = *it->second;
  for (Lease& lease : c.leases) {
    --lease.model->leases;
    spdlog::debug("lease on {}@{} by pid {} ended", lease.model->name, lease.model->version, c.pid);
  }
  partial_bytes_ -= c.partial_charged;
  // Descriptors already in the peer's socket stay with the peer; the store
  // stops counting them with the connection, which was their only trace.
  in_flight_fds_ -= c.in_flight_fds;
  const size_t unread = c.queued_fds + c.in_flight_fds;
  const size_t queued = c.queued_bytes;
  if (c.deferred) std::erase(deferred_, id);
  std::erase(output_waiters_, id);
  ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, c.fd.get(), nullptr);
  connections_.erase(it);
  if (unread > 0) ReleaseUnread(unread);
  if (queued > 0) ReleaseQueued(queued);
  registry_->PruneRetired();
}

void EventLoop::Queue(Connection& c, MessageType type, const std::vector<std::byte>& payload,
                      UniqueFd fd) {
  if (fd.valid()) {
    ++c.queued_fds;
    ++unread_fds_;
  }
  if (c.out.empty() && c.in_flight_fds == 0) c.last_progress = Clock::now();
  auto frames = protocol::EncodeFrames(type, payload);
  for (size_t i = 0; i < frames.size(); ++i) {
    c.queued_bytes += frames[i].size();
    queued_bytes_ += frames[i].size();
    c.out.push_back({std::move(frames[i]), i == 0 ? std::move(fd) : UniqueFd()});
  }
  if (queued_bytes_ > counters_["queued_bytes_peak"])
    counters_["queued_bytes_peak"] = queued_bytes_;
}

// Bytes of replies no longer queued in the store: connections that were
// not read for the store-wide budget are looked at again once it has room.
void EventLoop::ReleaseQueued(size_t n) {
  queued_bytes_ -= n;
  if (queued_bytes_ >= limits_.max_queued_bytes) return;
  for (uint64_t id : std::exchange(output_waiters_, {}))
    if (Connection* c = FindConnection(id)) MarkReady(*c);
}

void EventLoop::QueueError(Connection& c, const Status& status) {
  Queue(c, MessageType::kError, protocol::EncodeError(status));
}

// Sends what the socket takes now; false if the connection is broken. What
// does not fit waits for the next output edge.
bool EventLoop::Flush(Connection& c) {
  while (!c.out.empty()) {
    OutgoingFrame& f = c.out.front();
    const ssize_t n = protocol::SendFrameOnce(c.fd.get(), f.bytes, f.fd.get(), MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) break;
      return false;
    }
    if (f.fd.valid()) {
      --c.queued_fds;
      ++c.in_flight_fds;
      if (in_flight_fds_++ == 0) next_sweep_ = Clock::now() + kInFlightSweep;
    }
    c.queued_bytes -= f.bytes.size();
    c.last_progress = Clock::now();
    const size_t sent = f.bytes.size();
    c.out.pop_front();
    ReleaseQueued(sent);
  }
  return true;
}

// Best effort: one error message on a socket about to be closed.
void EventLoop::SendAndForget(int fd, const Status& status) {
  const auto payload = protocol::EncodeError(status);
  for (const auto& frame : protocol::EncodeFrames(MessageType::kError, payload)) {
    if (::send(fd, frame.data(), frame.size(), MSG_DONTWAIT | MSG_NOSIGNAL) < 0) return;
  }
}

}  // namespace hearth::store
