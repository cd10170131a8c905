#include "hearth/store.h"

#include <fcntl.h>
#include <linux/sockios.h>
#include <spdlog/spdlog.h>
#include <stdio.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <deque>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>

#include "common/trusted_path.h"
#include "hearth/arena.h"
#include "hearth/manifest.h"
#include "protocol/messages.h"
#include "protocol/wire.h"
#include "store/loader.h"
#include "store/registry.h"
#include "store/socket_file.h"

namespace hearth {
namespace {

using protocol::MessageType;
using store::BindSocket;
using store::CheckSocketName;
using store::Lease;
using store::ModelVersion;
using store::NowMs;
using store::OpenSocketFile;
using store::RemoveSocketFile;
using store::SocketFile;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr int kMaxFramesPerWakeup = 64;
constexpr int kMaxAcceptsPerWakeup = 64;
// Replies queued in the store for one connection past which its requests are
// not read: with one reply in hand at most, a connection holds this plus one
// message.
constexpr size_t kPauseQueuedBytes = size_t{1} << 20;
// Descriptors kept out of the automatic limits for the store itself (stdio,
// epoll, eventfds, the listener and its directory, arenas, checkpoint files).
constexpr size_t kDescriptorReserve = 64;
constexpr size_t kMaxAutomaticConnections = 4096;
// `hearth load` requests running at once (each holds a thread and its
// staging buffers); more wait their turn in kMaxWaitingLoads.
constexpr size_t kMaxConcurrentLoads = 4;
// Loads asked for while kMaxConcurrentLoads run, kept in the order asked;
// past this many a load is answered RESOURCE_EXHAUSTED.
constexpr size_t kMaxWaitingLoads = 256;
constexpr milliseconds kMinAcceptBackoff(100);
constexpr milliseconds kMaxAcceptBackoff(1000);
constexpr milliseconds kLogInterval(1000);
// How often descriptors sent but not seen read are looked at again (see
// RefreshInFlight for why a wakeup alone is not enough).
constexpr milliseconds kInFlightSweep(1000);

// At most one log line per interval for one kind of event; the next line
// written says how many were left out. A flood of refused peers or failing
// accepts then costs a line a second, not a line per event.
class LogLimiter {
 public:
  // True if a line may be written now; *dropped receives the number left out since the last one.
  bool Allow(uint64_t* dropped) {
    const Clock::time_point now = Clock::now();
    if (any_ && now - last_ < kLogInterval) {
      ++dropped_;
      return false;
    }
    any_ = true;
    last_ = now;
    *dropped = std::exchange(dropped_, 0);
    return true;
  }

 private:
  bool any_ = false;
  Clock::time_point last_;
  uint64_t dropped_ = 0;
};

std::string Dropped(uint64_t n) {
  return n == 0 ? std::string() : " (" + std::to_string(n) + " similar lines left out)";
}

struct OutgoingFrame {
  std::vector<std::byte> bytes;
  UniqueFd fd;
};

// One client. Registered edge-triggered for input and output: `readable`
// remembers input the loop has not drained yet (it may stop reading a
// connection on purpose), and an output edge, which comes each time the peer
// reads a reply, is how the store learns that sent descriptors were taken.
struct Connection {
  uint64_t id = 0;
  UniqueFd fd;
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
  protocol::FrameAssembler assembler;
  size_t partial_charged = 0;  // assembler bytes counted in Impl::partial_bytes_
  std::deque<OutgoingFrame> out;
  size_t queued_bytes = 0;
  size_t queued_fds = 0;     // descriptors in `out`
  size_t in_flight_fds = 0;  // sent, not yet known to be read by the peer
  // An attach that waits for the store-wide descriptor cap; while it is set
  // nothing more is read from the connection.
  std::optional<protocol::AttachRequest> deferred;
  Clock::time_point deferred_since;
  // When the peer last took something the store holds for it (a reply sent
  // or a descriptor seen read), or when it began to hold something.
  Clock::time_point last_progress;
  // Why the store stopped reading this connection, counted once per pause.
  enum class Pause {
    kNone,
    kAttachWaits,
    kDescriptors,
    kQueuedBytes,
    kStoreQueuedBytes
  } paused = Pause::kNone;
  bool readable = true;
  bool hung_up = false;
  bool in_ready = false;
  std::vector<Lease> leases;
};

struct LoadDone {
  uint64_t load_id;
  uint64_t connection_id;
  std::string name;
  std::string path;
  Result<LoadedModel> result;
};

size_t DescriptorLimit() {
  rlimit rl{};
  if (::getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY) return size_t{1} << 20;
  return static_cast<size_t>(rl.rlim_cur);
}

}  // namespace

class Store::Impl {
 public:
  explicit Impl(StoreOptions options) : options_(std::move(options)) {}

  ~Impl() {
    cancel_loads_ = true;
    for (auto& [id, t] : load_threads_) t.join();
  }

  Status Init() {
    stop_fd_.Reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    load_fd_.Reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    epoll_.Reset(::epoll_create1(EPOLL_CLOEXEC));
    if (!stop_fd_ || !load_fd_ || !epoll_) return ErrnoError("creating the event loop", errno);
    SetLimits();
    // The directory and the name are checked before loading, so that a bad
    // directory or a store already serving there fails at once rather than
    // after minutes of loading; the socket is bound after loading.
    ASSIGN_OR_RETURN(socket_, OpenSocketFile(options_.socket_path));
    RETURN_IF_ERROR(CheckSocketName(socket_).status());
    for (const auto& [name, path] : options_.models) {
      if (name.empty() || name.find('@') != std::string::npos)
        return InvalidArgument("model name '" + name + "' is empty or contains '@'");
      LoadOptions load;
      load.threads = options_.load_threads;
      load.cancel = options_.cancel;
      if (options_.show_progress) load.progress = TerminalProgress(name);
      spdlog::info("loading {} from {}", name, path);
      Result<LoadedModel> loaded = LoadCheckpoint(path, options_.device, load);
      if (!loaded.ok()) return loaded.status();
      const double seconds = loaded->seconds;
      const auto& v = registry_.Register(name, path, std::move(loaded).value());
      spdlog::info("loaded {}@{} from {}: {} tensors, {:.1f} MiB on {} in {:.2f} s ({:.2f} GB/s)",
                   v.name, v.version, path, v.manifest.tensors.size(),
                   static_cast<double>(v.manifest.arena_size) / (1 << 20),
                   options_.device.ToString(), seconds,
                   seconds > 0 ? static_cast<double>(v.manifest.arena_size) / seconds / 1e9 : 0.0);
    }
    if (options_.cancel != nullptr && options_.cancel->load())
      return Unavailable("interrupted before the socket was bound: the store is stopping");
    ASSIGN_OR_RETURN(listen_, BindSocket(socket_, options_.socket_mode));
    RETURN_IF_ERROR(Watch(listen_.get(), EPOLLIN, kListenTag));
    RETURN_IF_ERROR(Watch(stop_fd_.get(), EPOLLIN, kStopTag));
    RETURN_IF_ERROR(Watch(load_fd_.get(), EPOLLIN, kLoadTag));
    return Status::Ok();
  }

  Status Run() {
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
    Shutdown();
    return Status::Ok();
  }

  void Stop() {
    const uint64_t one = 1;
    // write(2) is async-signal-safe; nothing to do if it fails (already signalled).
    [[maybe_unused]] ssize_t n = ::write(stop_fd_.get(), &one, sizeof one);
  }

  void RemoveSocket() { RemoveSocketFile(socket_); }

  // The loaders check the flag between blocks; a load started after it fails
  // before reading, so waiting loads are answered as their turn comes.
  void CancelLoads() { cancel_loads_ = true; }

  Store::Held HeldArenas() const { return registry_.Held(); }

 private:
  static constexpr uint64_t kStopTag = 1, kListenTag = 2, kLoadTag = 3, kFirstConnection = 16;

  void SetLimits() {
    const size_t limit = DescriptorLimit();
    const size_t reserve = std::min(kDescriptorReserve, limit / 4);
    const size_t available = limit > reserve ? limit - reserve : 1;
    per_connection_fds_ = std::max<size_t>(1, options_.max_unread_descriptors_per_connection);
    max_connections_ = options_.max_connections > 0
                           ? options_.max_connections
                           : std::clamp<size_t>(available / 2, 1, kMaxAutomaticConnections);
    max_unread_fds_ =
        options_.max_unread_descriptors > 0
            ? options_.max_unread_descriptors
            : std::max<size_t>(
                  1, std::min(available > max_connections_ ? available - max_connections_ : 1,
                              max_connections_ * per_connection_fds_));
    max_partial_bytes_ = options_.max_partial_bytes;
    max_queued_bytes_ = std::max<size_t>(1, options_.max_queued_bytes);
    options_.max_leases_per_connection = std::max<size_t>(1, options_.max_leases_per_connection);
    options_.unread_timeout = std::max(options_.unread_timeout, milliseconds(1));
    options_.attach_wait_timeout = std::max(options_.attach_wait_timeout, milliseconds(1));
    wait_check_interval_ =
        std::clamp(std::min(options_.unread_timeout, options_.attach_wait_timeout) / 4,
                   milliseconds(5), milliseconds(1000));
    spdlog::info(
        "limits: {} connections, {} unread descriptors ({} per connection), {} bytes of "
        "unfinished messages, {} bytes of queued replies, {} leases per connection; unread for "
        "{} ms closes a connection while others wait, an attach waits {} ms at most; descriptor "
        "limit {}",
        max_connections_, max_unread_fds_, per_connection_fds_, max_partial_bytes_,
        max_queued_bytes_, options_.max_leases_per_connection, options_.unread_timeout.count(),
        options_.attach_wait_timeout.count(), limit);
    if (max_connections_ + max_unread_fds_ + reserve > limit)
      spdlog::warn(
          "{} connections and {} unread descriptors may need more than the descriptor limit of "
          "{}; accepts will back off when it is reached",
          max_connections_, max_unread_fds_, limit);
  }

  Status Watch(int fd, uint32_t events, uint64_t tag) {
    epoll_event ev{};
    ev.events = events;
    ev.data.u64 = tag;
    if (::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, fd, &ev) != 0)
      return ErrnoError("epoll_ctl", errno);
    return Status::Ok();
  }

  Connection* FindConnection(uint64_t id) {
    auto it = connections_.find(id);
    return it == connections_.end() ? nullptr : it->second.get();
  }

  bool Authorized(uid_t uid, gid_t gid) const {
    if (uid == ::geteuid() || uid == 0) return true;
    if (std::find(options_.allow_uids.begin(), options_.allow_uids.end(), uid) !=
        options_.allow_uids.end())
      return true;
    return std::find(options_.allow_gids.begin(), options_.allow_gids.end(), gid) !=
           options_.allow_gids.end();
  }

  // ---- timers --------------------------------------------------------------

  int TimeoutMs() const {
    if (!ready_.empty()) return 0;
    std::optional<Clock::time_point> next;
    if (accept_paused_) next = accept_resume_at_;
    if (in_flight_fds_ > 0) next = next ? std::min(*next, next_sweep_) : next_sweep_;
    if (SomethingWaits()) next = next ? std::min(*next, next_wait_check_) : next_wait_check_;
    if (!next) return -1;
    const auto left = std::chrono::ceil<milliseconds>(*next - Clock::now()).count();
    return static_cast<int>(std::clamp<int64_t>(left, 0, 60000));
  }

  void RunTimers() {
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
      next_wait_check_ = now + wait_check_interval_;
      ExpireWaitingAttaches(now);
      CloseStalledConnections(now);
    }
  }

  // Attaches wait for the store-wide descriptor cap, or connections are not
  // read for the store-wide reply budget.
  bool SomethingWaits() const { return !deferred_.empty() || !output_waiters_.empty(); }

  void ExpireWaitingAttaches(Clock::time_point now) {
    std::vector<uint64_t> expired;
    for (uint64_t id : deferred_) {
      Connection* c = FindConnection(id);
      if (c != nullptr && c->deferred && now - c->deferred_since >= options_.attach_wait_timeout)
        expired.push_back(id);
    }
    for (uint64_t id : expired) {
      Connection& c = *FindConnection(id);
      std::erase(deferred_, id);
      ++counters_["attach_wait_timeouts"];
      spdlog::warn(
          "attach of {} by pid {} waited {} ms for the cap of {} unread descriptors; "
          "answered RESOURCE_EXHAUSTED",
          c.deferred->model.ToString(), c.pid, options_.attach_wait_timeout.count(),
          max_unread_fds_);
      QueueError(c, ResourceExhausted(
                        "the store's " + std::to_string(max_unread_fds_) +
                        " descriptors for clients are all sent and not read yet; attach of " +
                        c.deferred->model.ToString() + " waited " +
                        std::to_string(options_.attach_wait_timeout.count()) +
                        " ms (attach_wait_timeout); try again later"));
      c.deferred.reset();
      MarkReady(c);
    }
  }

  // While others wait, a connection whose peer has taken nothing of what it
  // holds for unread_timeout is closed: for the descriptor cap, those with
  // descriptors unread; for the reply budget, those with replies queued.
  void CloseStalledConnections(Clock::time_point now) {
    const bool for_fds = !deferred_.empty();
    const bool for_bytes = !output_waiters_.empty();
    std::vector<uint64_t> stalled;
    for (auto& [id, c] : connections_) {
      const bool holds =
          (for_fds && c->queued_fds + c->in_flight_fds > 0) || (for_bytes && c->queued_bytes > 0);
      if (!holds || now - c->last_progress < options_.unread_timeout) continue;
      // What the kernel shows now, not what the last sweep saw.
      if (!Flush(*c)) {
        stalled.push_back(id);
        continue;
      }
      RefreshInFlight(*c);
      const bool still =
          (for_fds && c->queued_fds + c->in_flight_fds > 0) || (for_bytes && c->queued_bytes > 0);
      if (still && now - c->last_progress >= options_.unread_timeout) stalled.push_back(id);
    }
    for (uint64_t id : stalled) {
      Connection& c = *FindConnection(id);
      ++counters_["stalled_connections_closed"];
      spdlog::warn(
          "closing connection from pid {} uid {}: its peer read nothing of {} descriptors and {} "
          "bytes of replies for {} ms (unread_timeout) while {} attaches wait for the descriptor "
          "cap and {} connections for the reply budget",
          c.pid, c.uid, c.queued_fds + c.in_flight_fds, c.queued_bytes,
          options_.unread_timeout.count(), deferred_.size(), output_waiters_.size());
      Close(id);
    }
  }

  // ---- accepting -----------------------------------------------------------

  void AcceptSome() {
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

  void PauseAccepting(int err) {
    ++counters_["accept_pauses"];
    accept_backoff_ = accept_backoff_.count() == 0
                          ? kMinAcceptBackoff
                          : std::min(2 * accept_backoff_, kMaxAcceptBackoff);
    epoll_event ev{};
    ev.data.u64 = kListenTag;
    ::epoll_ctl(epoll_.get(), EPOLL_CTL_MOD, listen_.get(), &ev);
    accept_paused_ = true;
    accept_resume_at_ = Clock::now() + accept_backoff_;
    if (uint64_t dropped; accept_log_.Allow(&dropped))
      spdlog::warn("accept: {} ({} connections open, limit {}); not accepting for {} ms{}",
                   std::strerror(err), connections_.size(), max_connections_,
                   accept_backoff_.count(), Dropped(dropped));
  }

  void Admit(UniqueFd fd) {
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
    if (connections_.size() >= max_connections_) {
      ++counters_["connections_refused"];
      if (uint64_t dropped; refuse_log_.Allow(&dropped))
        spdlog::warn("refused connection from pid {}: {} connections open, the limit{}", cred->pid,
                     connections_.size(), Dropped(dropped));
      return Refuse(fd.get(), ResourceExhausted("the store is serving " +
                                                std::to_string(connections_.size()) +
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

  // Answers a connection that is not admitted and closes it at once. What the
  // peer already sent is read first: closing a Unix socket with unread input
  // makes the peer's next read fail with ECONNRESET instead of the answer.
  static void Refuse(int fd, const Status& why) {
    char discard[16];
    for (int i = 0; i < 16; ++i) {
      if (::recv(fd, discard, sizeof discard, MSG_DONTWAIT | MSG_TRUNC) <= 0) break;
    }
    SendAndForget(fd, why);
  }

  // Best effort: one error message on a socket about to be closed.
  static void SendAndForget(int fd, const Status& status) {
    const auto payload = protocol::EncodeError(status);
    for (const auto& frame : protocol::EncodeFrames(MessageType::kError, payload)) {
      if (::send(fd, frame.data(), frame.size(), MSG_DONTWAIT | MSG_NOSIGNAL) < 0) return;
    }
  }

  // ---- serving connections -------------------------------------------------

  void MarkReady(Connection& c) {
    if (c.in_ready) return;
    c.in_ready = true;
    ready_.push_back(c.id);
  }

  void ServiceReady() {
    std::vector<uint64_t> ready;
    ready.swap(ready_);
    for (uint64_t id : ready) {
      if (Connection* c = FindConnection(id)) {
        c->in_ready = false;
        Service(id);
      }
    }
  }

  void OnConnectionEvent(uint64_t id, uint32_t events) {
    Connection* c = FindConnection(id);
    if (c == nullptr) return;
    if (events & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) c->readable = true;
    if (events & (EPOLLHUP | EPOLLERR)) c->hung_up = true;
    Service(id);
  }

  // Whether the store may read the connection's next request: not while an
  // attach of it waits, nor while its peer leaves replies or descriptors unread.
  bool MayRead(const Connection& c) const { return WhyNotRead(c) == Connection::Pause::kNone; }

  Connection::Pause WhyNotRead(const Connection& c) const {
    using Pause = Connection::Pause;
    if (c.deferred) return Pause::kAttachWaits;
    if (c.queued_fds + c.in_flight_fds >= per_connection_fds_) return Pause::kDescriptors;
    if (c.queued_bytes >= kPauseQueuedBytes) return Pause::kQueuedBytes;
    if (queued_bytes_ >= max_queued_bytes_) return Pause::kStoreQueuedBytes;
    return Pause::kNone;
  }

  // Counts a connection the store stops reading while requests of it may be
  // waiting, once per pause and by reason; one paused for the store-wide
  // budget is woken when the budget has room.
  void NotePause(Connection& c) {
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
  void Service(uint64_t id) {
    Connection* c = FindConnection(id);
    if (c == nullptr) return;
    if (!Flush(*c)) return Close(id);
    RefreshInFlight(*c);
    if (c->deferred && !c->hung_up) {
      if (unread_fds_ >= max_unread_fds_) {
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
  bool ReadOne(Connection& c) {
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
      if (partial_bytes_ > max_partial_bytes_) {
        ++counters_["partial_rejections"];
        Reject(id,
               ResourceExhausted(
                   "unfinished messages of all connections hold " + std::to_string(partial_bytes_) +
                   " bytes, more than the store's budget of " + std::to_string(max_partial_bytes_) +
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

  void ChargePartial(Connection& c) {
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
  bool RefreshInFlight(Connection& c) {
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
  void ReleaseUnread(size_t n) {
    unread_fds_ -= n;
    size_t room = unread_fds_ < max_unread_fds_ ? max_unread_fds_ - unread_fds_ : 0;
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
  void Reject(uint64_t id, const Status& why) {
    Connection* c = FindConnection(id);
    if (c == nullptr) return;
    if (uint64_t dropped; reject_log_.Allow(&dropped))
      spdlog::warn("closing connection from pid {}: {}{}", c->pid, why.message(), Dropped(dropped));
    Flush(*c);
    SendAndForget(c->fd.get(), why);
    Close(id);
  }

  void Close(uint64_t id) {
    auto it = connections_.find(id);
    if (it == connections_.end()) return;
    Connection& c = *it->second;
    for (Lease& lease : c.leases) {
      --lease.model->leases;
      spdlog::debug("lease on {}@{} by pid {} ended", lease.model->name, lease.model->version,
                    c.pid);
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
    registry_.PruneRetired();
  }

  void Queue(Connection& c, MessageType type, const std::vector<std::byte>& payload,
             UniqueFd fd = UniqueFd()) {
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
  void ReleaseQueued(size_t n) {
    queued_bytes_ -= n;
    if (queued_bytes_ >= max_queued_bytes_) return;
    for (uint64_t id : std::exchange(output_waiters_, {}))
      if (Connection* c = FindConnection(id)) MarkReady(*c);
  }

  void QueueError(Connection& c, const Status& status) {
    Queue(c, MessageType::kError, protocol::EncodeError(status));
  }

  // Sends what the socket takes now; false if the connection is broken. What
  // does not fit waits for the next output edge.
  bool Flush(Connection& c) {
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

  // Answers one complete message. A non-OK return is a protocol violation
  // (the connection is dropped); request-level failures are answered with an
  // error message and return OK.
  Status Handle(Connection& c, const protocol::Message& m) {
    switch (m.type) {
      case MessageType::kListModels: {
        RETURN_IF_ERROR(protocol::CheckEmpty(m.payload, "list-models"));
        Queue(c, MessageType::kModelList, protocol::EncodeModelList(registry_.Summaries()));
        return Status::Ok();
      }
      case MessageType::kAttach: {
        ASSIGN_OR_RETURN(protocol::AttachRequest req, protocol::DecodeAttach(m.payload));
        HandleAttach(c, req);
        return Status::Ok();
      }
      case MessageType::kStatus: {
        RETURN_IF_ERROR(protocol::CheckEmpty(m.payload, "status"));
        Queue(c, MessageType::kStatusReply, protocol::EncodeStatus(CollectStatus()));
        return Status::Ok();
      }
      case MessageType::kStatusV2: {
        RETURN_IF_ERROR(protocol::CheckEmpty(m.payload, "status-v2"));
        Queue(c, MessageType::kStatusReplyV2, protocol::EncodeStatusV2(CollectStatus()));
        return Status::Ok();
      }
      case MessageType::kLoad: {
        ASSIGN_OR_RETURN(protocol::LoadRequest req, protocol::DecodeLoad(m.payload));
        if (c.uid != ::geteuid()) {
          spdlog::warn("refused load of {} by pid {} uid {}: only uid {} may load", req.name, c.pid,
                       c.uid, ::geteuid());
          QueueError(c, PermissionDenied("only the store's own uid may load models"));
          return Status::Ok();
        }
        if (load_threads_.size() >= kMaxConcurrentLoads) {
          if (waiting_loads_.size() >= kMaxWaitingLoads) {
            QueueError(c, ResourceExhausted(std::to_string(load_threads_.size()) +
                                            " loads are running and " +
                                            std::to_string(waiting_loads_.size()) +
                                            " waiting; try again when one has finished"));
            return Status::Ok();
          }
          waiting_loads_.push_back({c.id, std::move(req)});
          return Status::Ok();
        }
        StartLoad(c.id, std::move(req));
        return Status::Ok();
      }
      case MessageType::kUnload: {
        ASSIGN_OR_RETURN(protocol::UnloadRequest req, protocol::DecodeUnload(m.payload));
        if (c.uid != ::geteuid()) {
          spdlog::warn("refused unload of {} by pid {} uid {}: only uid {} may unload",
                       req.model.ToString(), c.pid, c.uid, ::geteuid());
          QueueError(c, PermissionDenied("only the store's own uid may unload models"));
          return Status::Ok();
        }
        Result<uint32_t> removed = registry_.Unload(req.model);
        if (!removed.ok()) {
          QueueError(c, removed.status());
        } else {
          Queue(c, MessageType::kUnloaded, protocol::EncodeUnloaded(*removed));
        }
        return Status::Ok();
      }
      default:
        return InvalidArgument(std::string("a client may not send a '") +
                               protocol::MessageTypeName(m.type) + "' message");
    }
  }

  void HandleAttach(Connection& c, const protocol::AttachRequest& req) {
    std::shared_ptr<ModelVersion> v = registry_.Find(req.model);
    if (!v) {
      QueueError(c, NotFound("no model '" + req.model.ToString() + "' in this store"));
      return;
    }
    if (c.leases.size() >= options_.max_leases_per_connection) {
      ++counters_["lease_refusals"];
      QueueError(c, ResourceExhausted("this connection holds " + std::to_string(c.leases.size()) +
                                      " leases, the store's limit per connection "
                                      "(max_leases_per_connection); attach on a new connection"));
      return;
    }
    if (unread_fds_ >= max_unread_fds_) {
      // Not an error: the answer waits, and the connection is not read
      // meanwhile, until peers have read enough of the descriptors sent or
      // the wait runs past attach_wait_timeout.
      if (uint64_t dropped; cap_log_.Allow(&dropped))
        spdlog::warn(
            "{} descriptors sent are not read yet, the limit; attach of {} by pid {} waits{}",
            unread_fds_, req.model.ToString(), c.pid, Dropped(dropped));
      ++counters_["attaches_deferred"];
      c.deferred = req;
      c.deferred_since = Clock::now();
      deferred_.push_back(c.id);
      return;
    }
    Result<UniqueFd> fd = v->arena->Export();
    if (!fd.ok()) {
      spdlog::error("exporting {}@{}: {}", v->name, v->version, fd.status().ToString());
      QueueError(c, fd.status());
      return;
    }
    Queue(c, MessageType::kManifest, protocol::EncodeManifest(v->manifest), std::move(*fd));
    ++v->leases;
    c.leases.push_back({v, NowMs()});
    spdlog::debug("pid {} attached {}@{}", c.pid, v->name, v->version);
  }

  // At most max_status_leases leases listed (the oldest connections' first
  // is not promised: connections are in no order); lease_total counts all.
  StoreStatus CollectStatus() {
    StoreStatus s;
    s.pid = ::getpid();
    s.device = options_.device;
    s.connections = static_cast<uint32_t>(connections_.size());
    for (const auto& [id, c] : connections_) {
      s.lease_total += c->leases.size();
      for (const Lease& l : c->leases) {
        if (s.leases.size() >= options_.max_status_leases) break;
        s.leases.push_back({c->pid, c->uid, c->gid, l.model->name, l.model->version, l.since_ms});
      }
    }
    s.counters = counters_;
    s.counters["unread_descriptors"] = unread_fds_;
    s.counters["queued_bytes"] = queued_bytes_;
    s.counters["partial_bytes"] = partial_bytes_;
    s.counters["attaches_waiting"] = deferred_.size();
    for (const auto& v : registry_.HeldVersions())
      s.arenas.push_back({v->name, v->version, v->manifest.device, v->arena->allocation_size(),
                          v->registered, v->leases});
    return s;
  }

  void StartLoad(uint64_t connection_id, protocol::LoadRequest req) {
    spdlog::info("loading {} from {}", req.name, req.path);
    const Device device = options_.device;
    const int threads = options_.load_threads;
    const uint64_t load_id = next_load_id_++;
    load_threads_.emplace(
        load_id, std::thread([this, load_id, connection_id, req = std::move(req), device, threads] {
          LoadOptions load;
          load.threads = threads;
          load.cancel = &cancel_loads_;
          Result<LoadedModel> result = LoadCheckpoint(req.path, device, load);
          {
            std::lock_guard lock(loads_mu_);
            loads_done_.push_back({load_id, connection_id, req.name, req.path, std::move(result)});
          }
          const uint64_t one = 1;
          [[maybe_unused]] ssize_t n = ::write(load_fd_.get(), &one, sizeof one);
        }));
  }

  void FinishLoads() {
    uint64_t count;
    [[maybe_unused]] ssize_t n = ::read(load_fd_.get(), &count, sizeof count);
    std::vector<LoadDone> done;
    {
      std::lock_guard lock(loads_mu_);
      done.swap(loads_done_);
    }
    for (LoadDone& d : done) {
      if (auto t = load_threads_.find(d.load_id); t != load_threads_.end()) {
        t->second.join();
        load_threads_.erase(t);
      }
      Connection* conn = FindConnection(d.connection_id);
      if (!d.result.ok()) {
        spdlog::error("load of {} failed: {}", d.name, d.result.status().ToString());
        if (conn != nullptr) QueueError(*conn, d.result.status());
      } else {
        const double seconds = d.result->seconds;
        const ModelVersion& v = registry_.Register(d.name, d.path, std::move(d.result).value());
        spdlog::info("loaded {}@{} from {} in {:.2f} s", v.name, v.version, v.path, seconds);
        if (conn != nullptr)
          Queue(*conn, MessageType::kLoaded, protocol::EncodeLoaded(v.Summary()));
      }
      if (conn != nullptr) MarkReady(*conn);
    }
    // Start what waited, skipping loads whose client has gone.
    while (load_threads_.size() < kMaxConcurrentLoads && !waiting_loads_.empty()) {
      WaitingLoad w = std::move(waiting_loads_.front());
      waiting_loads_.pop_front();
      if (FindConnection(w.connection_id) != nullptr)
        StartLoad(w.connection_id, std::move(w.request));
    }
  }

  void Shutdown() {
    spdlog::info("store shutting down");
    cancel_loads_ = true;
    RemoveSocketFile(socket_);
    listen_.Reset();
    connections_.clear();
    registry_.Clear();
  }

  StoreOptions options_;
  UniqueFd epoll_, stop_fd_, load_fd_, listen_;
  SocketFile socket_;
  bool stopping_ = false;
  uint64_t next_connection_id_ = kFirstConnection;
  std::unordered_map<uint64_t, std::unique_ptr<Connection>> connections_;
  std::vector<uint64_t> ready_;  // connections to service after this round of events
  store::Registry registry_;
  std::vector<std::byte> frame_buffer_ =
      std::vector<std::byte>(protocol::kFrameHeaderBytes + protocol::kMaxFramePayload + 1);

  // Limits (SetLimits) and what is held against them.
  size_t max_connections_ = 0;
  size_t max_unread_fds_ = 0;
  size_t per_connection_fds_ = 0;
  size_t max_partial_bytes_ = 0;
  size_t unread_fds_ = 0;     // queued or in flight, all connections
  size_t in_flight_fds_ = 0;  // in flight, all connections
  size_t partial_bytes_ = 0;  // assemblers' allocations, all connections
  size_t max_queued_bytes_ = 0;
  size_t queued_bytes_ = 0;               // replies queued in the store, all connections
  std::deque<uint64_t> deferred_;         // connections whose attach waits for unread_fds_ to drop
  std::vector<uint64_t> output_waiters_;  // connections not read while queued_bytes_ is at its max
  milliseconds wait_check_interval_{1000};
  Clock::time_point next_wait_check_;
  // What the status reply reports besides the current totals (docs/protocol.md).
  std::map<std::string, uint64_t> counters_;
  Clock::time_point next_sweep_;
  bool accept_paused_ = false;
  Clock::time_point accept_resume_at_;
  milliseconds accept_backoff_{0};
  LogLimiter accept_log_, refuse_log_, reject_log_, cap_log_;

  std::atomic<bool> cancel_loads_{false};
  std::mutex loads_mu_;
  std::vector<LoadDone> loads_done_;
  uint64_t next_load_id_ = 1;
  std::map<uint64_t, std::thread> load_threads_;
  struct WaitingLoad {
    uint64_t connection_id;
    protocol::LoadRequest request;
  };
  std::deque<WaitingLoad> waiting_loads_;  // in the order asked
};

Store::Store(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Store::~Store() {
  if (impl_) impl_->RemoveSocket();
}

Result<std::unique_ptr<Store>> Store::Create(StoreOptions options) {
  auto impl = std::make_unique<Impl>(std::move(options));
  RETURN_IF_ERROR(impl->Init());
  return std::unique_ptr<Store>(new Store(std::move(impl)));
}

Status Store::Run() { return impl_->Run(); }

void Store::Stop() { impl_->Stop(); }

void Store::CancelLoads() { impl_->CancelLoads(); }
Store::Held Store::HeldArenas() const { return impl_->HeldArenas(); }

}  // namespace hearth
