// The event loop's accepting: new connections admitted, refused, or the
// listener paused while accepts fail.
#include <spdlog/spdlog.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <utility>

#include "common/trusted_path.h"
#include "store/event_loop.h"

namespace hearth::store {
namespace {

using std::chrono::milliseconds;

constexpr int kMaxAcceptsPerWakeup = 64;
constexpr milliseconds kMinAcceptBackoff(100);
constexpr milliseconds kMaxAcceptBackoff(1000);

}  // namespace

void EventLoop::AcceptSome() {
  for (int i = 0; i < kMaxAcceptsPerWakeup; ++i) {
    UniqueFd fd(::accept4(listen_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
    if (!fd) {
      const int err = errno;
      if (err == EINTR || err == ECONNABORTED) continue;
      if (err == EAGAIN || err == EWOULDBLOCK) return;
      // EMFILE, ENFILE, ENOBUFS, ENOMEM, or something unexpected: the
      // listener stays readable, so polling it again at once would spin.
      ++counters_["accept_failures"];
      return PauseAccepting(err);
    }
    accept_backoff_ = milliseconds(0);
    Admit(std::move(fd));
  }
}

void EventLoop::PauseAccepting(int err) {
  ++counters_["accept_pauses"];
  accept_backoff_ = accept_backoff_.count() == 0 ? kMinAcceptBackoff
                                                 : std::min(2 * accept_backoff_, kMaxAcceptBackoff);
  epoll_event ev{};
  ev.data.u64 = kListenTag;
  ::epoll_ctl(epoll_.get(), EPOLL_CTL_MOD, listen_.get(), &ev);
  accept_paused_ = true;
  accept_resume_at_ = Clock::now() + accept_backoff_;
  if (uint64_t dropped; accept_log_.Allow(&dropped))
    spdlog::warn("accept: {} ({} connections open, limit {}); not accepting for {} ms{}",
                 std::strerror(err), connections_.size(), limits_.max_connections,
                 accept_backoff_.count(), Dropped(dropped));
}

void EventLoop::Admit(UniqueFd fd) {
  Result<PeerCredentials> cred = GetPeerCredentials(fd.get());
  if (!cred.ok()) {
    if (uint64_t dropped; refuse_log_.Allow(&dropped))
      spdlog::warn("dropping a connection: {}{}", cred.status().message(), Dropped(dropped));
    return;
  }
  if (!Authorized(cred->uid, cred->gid)) {
    if (uint64_t dropped; refuse_log_.Allow(&dropped))
      spdlog::warn(
          "refused connection from pid {} uid {} gid {}: not allowed by "
          "--allow-uid/--allow-gid{}",
          cred->pid, cred->uid, cred->gid, Dropped(dropped));
    return Refuse(fd.get(),
                  PermissionDenied("uid " + std::to_string(cred->uid) + " gid " +
                                   std::to_string(cred->gid) + " may not use this store"));
  }
  if (connections_.size() >= limits_.max_connections) {
    ++counters_["connections_refused"];
    if (uint64_t dropped; refuse_log_.Allow(&dropped))
      spdlog::warn("refused connection from pid {}: {} connections open, the limit{}", cred->pid,
                   connections_.size(), Dropped(dropped));
    return Refuse(fd.get(),
                  ResourceExhausted("the store is serving " + std::to_string(connections_.size()) +
                                    " connections, its limit (--max-connections); "
                                    "try again later"));
  }
  auto conn = std::make_unique<Connection>();
  conn->id = next_connection_id_++;
  conn->pid = cred->pid;
  conn->uid = cred->uid;
  conn->gid = cred->gid;
  conn->fd = std::move(fd);
  if (Status s = Watch(conn->fd.get(), EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLET, conn->id);
      !s.ok()) {
    spdlog::warn("{}", s.ToString());
    return;
  }
  spdlog::debug("connection {} from pid {} uid {}", conn->id, conn->pid, conn->uid);
  Connection& c = *conn;
  connections_.emplace(conn->id, std::move(conn));
  MarkReady(c);  // a request may have arrived before the accept
}

bool EventLoop::Authorized(uid_t uid, gid_t gid) const {
  if (uid == ::geteuid() || uid == 0) return true;
  if (std::find(options_.allow_uids.begin(), options_.allow_uids.end(), uid) !=
      options_.allow_uids.end())
    return true;
  return std::find(options_.allow_gids.begin(), options_.allow_gids.end(), gid) !=
         options_.allow_gids.end();
}

// Answers a connection that is not admitted and closes it at once. What the
// peer already sent is read first: closing a Unix socket with unread input
// makes the peer's next read fail with ECONNRESET instead of the answer.
void EventLoop::Refuse(int fd, const Status& why) {
  char discard[16];
  for (int i = 0; i < 16; ++i) {
    if (::recv(fd, discard, sizeof discard, MSG_DONTWAIT | MSG_TRUNC) <= 0) break;
  }
  SendAndForget(fd, why);
}

}  // namespace hearth::store
