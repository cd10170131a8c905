#include "http/listener.h"

#include <dirent.h>
#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <boost/asio/post.hpp>
#include <cerrno>
#include <cstring>
#include <exception>
#include <future>
#include <limits>
#include <mutex>
#include <new>
#include <string>
#include <utility>

namespace hearth::rest {
namespace {

// Accepting pauses this long after an accept error, doubling while errors
// continue; a connection that closes resumes it at once.
constexpr std::chrono::milliseconds kAcceptBackoffFirst{10};
constexpr std::chrono::milliseconds kAcceptBackoffMax{1000};
// At most one log line per this interval about failing accepts (and one
// about evictions).
constexpr std::chrono::seconds kAcceptLogInterval{10};
// At the connection limit, with connections waiting in the backlog, the
// connection silent longest is closed to make room (Listener::MakeRoom): one that
// has not sent a byte for at least kEvictGrace since its accept (so that a
// client whose first bytes are in flight keeps its connection), else one
// idle between requests for at least kEvictIdleGrace (longer: a kept-alive
// client's next request may cross our close, and is then lost).
constexpr std::chrono::milliseconds kEvictGrace{100};
constexpr std::chrono::milliseconds kEvictIdleGrace{1000};

// Descriptors open in this process now; 0 when /proc is not there.
uint64_t OpenDescriptors() {
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) return 0;
  uint64_t count = 0;
  while (const dirent* entry = ::readdir(dir)) {
    if (entry->d_name[0] != '.') ++count;
  }
  ::closedir(dir);
  return count > 0 ? count - 1 : 0;  // not the directory's own
}

}  // namespace

Listener::Listener(InferenceService* service, HttpOptions options)
    : core_(service, std::move(options)),
      runtime_(std::make_unique<Runtime>(core_.options.threads)),
      backoff_(kAcceptBackoffFirst) {
  core_.wake_acceptor = [this] {
    net::post(runtime_->acceptor.get_executor(), [this] { ResumeAccepting(); });
  };
}

Listener::~Listener() { Stop(); }

Status Listener::Bind() {
  if (bound_) return FailedPrecondition("HttpServer::Bind called twice");
  bound_ = BindAddress();
  return *bound_;
}

Status Listener::BindAddress() {
  const HttpOptions& options = core_.options;
  beast::error_code ec;
  tcp::resolver resolver(runtime_->io);
  const auto endpoints =
      resolver.resolve(options.host, std::to_string(options.port),
                       tcp::resolver::passive | tcp::resolver::numeric_service, ec);
  if (ec || endpoints.empty()) {
    return InvalidArgument("cannot resolve host '" + options.host + "': " + ec.message());
  }
  const tcp::endpoint endpoint = endpoints.begin()->endpoint();
  protocol_ = endpoint.protocol();
  // Opened here rather than by Asio, which does not set close-on-exec.
  const int fd =
      ::socket(protocol_.family(), SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, IPPROTO_TCP);
  if (fd < 0) return ErrnoError("socket", errno);
  runtime_->acceptor.assign(protocol_, fd, ec);
  if (ec) {
    ::close(fd);
    return Internal("cannot adopt the listening socket: " + ec.message());
  }
  runtime_->acceptor.set_option(net::socket_base::reuse_address(true), ec);
  runtime_->acceptor.bind(endpoint, ec);
  if (ec) {
    return Unavailable("cannot bind " + options.host + ":" + std::to_string(options.port) + ": " +
                       ec.message());
  }
  runtime_->acceptor.listen(net::socket_base::max_listen_connections, ec);
  if (ec) return Unavailable("cannot listen on " + options.host + ": " + ec.message());
  port_ = runtime_->acceptor.local_endpoint(ec).port();
  return Status::Ok();
}

Status Listener::Start() {
  if (started_) return FailedPrecondition("HttpServer::Start called twice");
  started_ = true;
  if (!bound_) bound_ = BindAddress();
  RETURN_IF_ERROR(*bound_);  // a failed Bind fails Start the same way
  const HttpOptions& options = core_.options;
  Result<uint64_t> limit = ConnectionLimit();
  if (!limit.ok()) return limit.status();
  core_.connection_limit.store(*limit);
  core_.listening.store(true);
  AcceptReady();
  for (int i = 0; i < options.threads; ++i) {
    threads_.emplace_back([this] { RunIo(); });
  }
  return Status::Ok();
}

void Listener::Stop() {
  if (!started_ || stopped_) return;
  stopped_ = true;
  const Clock::time_point deadline = Clock::now() + core_.options.drain_timeout;
  core_.stopping.store(true);
  if (!threads_.empty()) Drain(deadline);
  core_.accepting.store(false);
  runtime_->work.reset();
  runtime_->io.stop();
  for (std::thread& thread : threads_) thread.join();
  threads_.clear();
  runtime_.reset();
  // What a client that saw its connection reset can hold against: every
  // connection accepted was answered or closed cleanly by the drain.
  spdlog::info("http: stopped after accepting {} connections", accepted_);
}

uint16_t Listener::port() const { return port_; }

HttpStats Listener::stats() const { return core_.Stats(); }

// The connections the descriptor limit leaves room for: the soft
// RLIMIT_NOFILE, less the descriptors open now (the store, the workers'
// sockets and memfds, the listening socket, the I/O context's own) and
// the reserve for the rest of the server.
Result<uint64_t> Listener::ConnectionLimit() const {
  const HttpOptions& options = core_.options;
  const auto wanted = static_cast<uint64_t>(options.max_connections);
  rlimit rl{};
  if (::getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY) return wanted;
  const auto soft = static_cast<uint64_t>(rl.rlim_cur);
  const uint64_t open = OpenDescriptors();
  const auto reserved = static_cast<uint64_t>(options.reserved_descriptors);
  const uint64_t room = soft > open + reserved ? soft - open - reserved : 0;
  const std::string why = "the descriptor limit (RLIMIT_NOFILE) is " + std::to_string(soft) + ", " +
                          std::to_string(open) + " descriptors are open and " +
                          std::to_string(reserved) +
                          " are kept for the server's own use (worker restarts, the store)";
  if (room == 0) {
    return ResourceExhausted("no descriptors are left for HTTP connections: " + why +
                             "; raise the limit (ulimit -n)");
  }
  if (room < wanted) {
    spdlog::warn(
        "http: serving at most {} connections at once, not the {} asked for: {}; raise "
        "the limit (ulimit -n) for more",
        room, wanted, why);
    return room;
  }
  return wanted;
}

void Listener::RunIo() {
  for (;;) {
    try {
      runtime_->io.run();
      return;
    } catch (const std::exception& e) {
      spdlog::error("http: I/O thread caught: {}", e.what());
    }
  }
}

// ---- accepting: all on the acceptor's strand -----------------------------
//
// Asio's reactor is edge-triggered: once accept4 has not drained the
// backlog (a pause), only another accept4 finds the connections waiting
// there, not a wait. So every resumption calls AcceptReady.

void Listener::WaitForConnection() {
  if (waiting_ || !runtime_->acceptor.is_open()) return;
  waiting_ = true;
  runtime_->acceptor.async_wait(tcp::acceptor::wait_read, [this](beast::error_code ec) {
    waiting_ = false;
    if (ec || !runtime_->acceptor.is_open()) return;
    AcceptReady();
  });
}

void Listener::AcceptReady() {
  for (;;) {
    if (!runtime_->acceptor.is_open() || backing_off_) return;
    const uint64_t limit = draining_ ? drain_connection_limit_ : core_.connection_limit.load();
    if (core_.connections.load() >= limit) {
      // Left in the kernel's backlog until a connection closes, or one is
      // closed to make room. The wait comes first: a connection that
      // arrives after MakeRoom looked at the backlog completes it.
      paused_for_limit_ = true;
      UpdatePaused();
      if (!draining_) {
        WaitForConnection();
        MakeRoom();
      }
      return;
    }
    const int fd = ::accept4(runtime_->acceptor.native_handle(), nullptr, nullptr,
                             SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      const int error = errno;
      if (error == EAGAIN || error == EWOULDBLOCK) break;
      // The connection, not the listener, failed (accept(2) lists the
      // network errors that Linux passes on).
      if (error == EINTR || error == ECONNABORTED || error == EPROTO || error == ENETDOWN ||
          error == ENOPROTOOPT || error == EHOSTDOWN || error == ENONET || error == EHOSTUNREACH ||
          error == EOPNOTSUPP || error == ENETUNREACH || error == EPERM) {
        continue;
      }
      return AcceptFailed(error);
    }
    backoff_ = kAcceptBackoffFirst;
    ++accepted_;
    OpenSession(fd);
  }
  paused_for_limit_ = false;
  UpdatePaused();
  WaitForConnection();
}

void Listener::OpenSession(int fd) {
  tcp::socket socket(net::make_strand(runtime_->io));
  beast::error_code ec;
  socket.assign(protocol_, fd, ec);
  if (ec) {
    ::close(fd);
    return;
  }
  socket.set_option(tcp::no_delay(true), ec);
  try {
    std::make_shared<Session>(std::move(socket), &core_)->Start();
  } catch (const std::bad_alloc&) {
    spdlog::error("http: out of memory for a new connection");  // the socket closes
  }
}

// Out of descriptors (EMFILE, ENFILE) or memory (ENOBUFS, ENOMEM): pauses
// with a back-off (a connection that closes resumes at once) and logs at
// most once per kAcceptLogInterval, instead of retrying in a loop.
void Listener::AcceptFailed(int error) {
  core_.accept_errors.fetch_add(1);
  const Clock::time_point now = Clock::now();
  if (now - last_accept_log_ >= kAcceptLogInterval) {
    spdlog::warn(
        "http: cannot accept a connection: {} ({} connections open, limit {}); pausing "
        "accepts for {} ms{}",
        std::strerror(error), core_.connections.load(), core_.connection_limit.load(),
        backoff_.count(),
        suppressed_accept_errors_ > 0
            ? fmt::format(" ({} more failed accepts since the last message)",
                          suppressed_accept_errors_)
            : std::string());
    last_accept_log_ = now;
    suppressed_accept_errors_ = 0;
  } else {
    ++suppressed_accept_errors_;
  }
  backing_off_ = true;
  UpdatePaused();
  runtime_->accept_retry.expires_after(backoff_);
  runtime_->accept_retry.async_wait([this](beast::error_code ec) {
    if (ec || !backing_off_) return;  // cancelled: ResumeAccepting took over
    backing_off_ = false;
    AcceptReady();
  });
  backoff_ = std::min(backoff_ * 2, kAcceptBackoffMax);
}

// A connection that waits in the backlog, ready for accept4.
bool Listener::BacklogWaiting() const {
  pollfd fd{runtime_->acceptor.native_handle(), POLLIN, 0};
  return ::poll(&fd, 1, 0) > 0 && (fd.revents & POLLIN) != 0;
}

// At the limit, with a connection waiting in the backlog: asks the
// connection silent longest to close (see kEvictGrace), one at a time; its
// close (or its refusal, once bytes arrived) resumes accepting. With none
// silent long enough yet, looks again when the first will be; with none at
// all, accepting resumes when a connection closes. O(connections), and only
// at the limit.
void Listener::MakeRoom() {
  if (evicting_ || core_.stopping.load() || !BacklogWaiting()) return;
  std::vector<std::shared_ptr<Session>> live;
  {
    std::lock_guard lock(core_.sessions_mutex);
    live.reserve(core_.sessions.size());
    for (const auto& [id, weak] : core_.sessions) {
      if (std::shared_ptr<Session> session = weak.lock()) live.push_back(std::move(session));
    }
  }  // released after the lock: the last owner's destructor takes it
  const int64_t now = Clock::now().time_since_epoch().count();
  Session* victim = nullptr;
  Session::Silence chosen;
  int64_t next = std::numeric_limits<int64_t>::max();  // when one will be old enough
  for (const std::shared_ptr<Session>& session : live) {
    const Session::Silence silence = session->silence();
    if (silence.since == 0) continue;
    const auto grace = std::chrono::duration_cast<Clock::duration>(
                           silence.kept_alive ? kEvictIdleGrace : kEvictGrace)
                           .count();
    if (now - silence.since < grace) {
      next = std::min(next, silence.since + grace);
      continue;
    }
    // Never spoke before kept alive; then silent longest.
    if (victim == nullptr || (chosen.kept_alive && !silence.kept_alive) ||
        (chosen.kept_alive == silence.kept_alive && silence.since < chosen.since)) {
      victim = session.get();
      chosen = silence;
    }
  }
  if (victim == nullptr) {
    if (next == std::numeric_limits<int64_t>::max()) return;
    runtime_->evict_retry.expires_after(Clock::duration(next - now));
    runtime_->evict_retry.async_wait([this](beast::error_code ec) {
      if (ec || !runtime_->acceptor.is_open() || !paused_for_limit_ || backing_off_) return;
      AcceptReady();
    });
    return;
  }
  evicting_ = true;
  LogEviction(chosen.kept_alive);
  for (std::shared_ptr<Session>& session : live) {
    if (session.get() != victim) continue;
    auto executor = session->executor();
    net::post(executor, [session = std::move(session)] { session->Evict(); });
    break;
  }
}

void Listener::LogEviction(bool kept_alive) {
  ++evictions_since_log_;
  const Clock::time_point now = Clock::now();
  if (now - last_evict_log_ < kAcceptLogInterval) return;
  spdlog::warn(
      "http: at the connection limit ({}) with connections waiting: closing a connection {} "
      "to accept one ({} so far, {} since the last message)",
      core_.connection_limit.load(), kept_alive ? "idle between requests" : "that has sent nothing",
      core_.connections_evicted.load() + 1, evictions_since_log_);
  last_evict_log_ = now;
  evictions_since_log_ = 0;
}

// A connection closed: below the limit again, and a descriptor is free.
// Also an evicted connection that refused (see Session::Evict).
void Listener::ResumeAccepting() {
  evicting_ = false;
  if (!runtime_->acceptor.is_open()) return;
  if (backing_off_) {
    backing_off_ = false;
    runtime_->accept_retry.cancel();
  } else if (!paused_for_limit_) {
    return;
  }
  paused_for_limit_ = false;
  AcceptReady();
}

void Listener::UpdatePaused() { core_.accept_paused.store(paused_for_limit_ || backing_off_); }

// ---- draining ------------------------------------------------------------

// Takes the connections that completed their handshake before the drain
// began (closing the listener would reset them), then closes it. listen()
// with a backlog of 0 first, so that hardly any complete meanwhile: their
// SYNs are dropped, and the clients' retries find the port closed, before
// they have sent anything.
void Listener::CloseListener() {
  if (runtime_->acceptor.is_open()) {
    ::listen(runtime_->acceptor.native_handle(), 0);
    draining_ = true;
    // Past the limit, into the reserve: these only get a 503.
    drain_connection_limit_ = core_.connection_limit.load() +
                              static_cast<uint64_t>(core_.options.reserved_descriptors) / 2;
    backing_off_ = false;
    paused_for_limit_ = false;
    AcceptReady();
    beast::error_code ignored;
    runtime_->acceptor.close(ignored);
    runtime_->accept_retry.cancel();
    runtime_->evict_retry.cancel();
    evicting_ = false;
  }
  core_.listening.store(false);
  core_.accepting.store(false);
}

template <typename Predicate>
bool Listener::WaitUntil(Clock::time_point deadline, Predicate done) {
  std::unique_lock lock(core_.mutex);
  return core_.changed.wait_until(lock, deadline, done);
}

void Listener::ForEachSession(void (Session::*what)()) {
  std::vector<std::shared_ptr<Session>> live;
  {
    std::lock_guard lock(core_.sessions_mutex);
    for (const auto& [id, weak] : core_.sessions) {
      if (std::shared_ptr<Session> session = weak.lock()) live.push_back(std::move(session));
    }
  }
  for (std::shared_ptr<Session>& session : live) {
    auto executor = session->executor();
    net::post(executor, [session = std::move(session), what] { ((*session).*what)(); });
  }
}

void Listener::Drain(Clock::time_point deadline) {
  std::promise<void> closed;
  net::post(runtime_->acceptor.get_executor(), [this, &closed] {
    CloseListener();
    closed.set_value();
  });
  closed.get_future().wait();
  // Every request that has begun is answered (and closes its connection).
  WaitUntil(deadline, [this] { return core_.busy.load() == 0 && core_.in_flight == 0; });
  // The connections left are idle, or lingering after their last answer.
  ForEachSession(&Session::CloseIfIdle);
  if (!WaitUntil(deadline, [this] { return core_.connections.load() == 0; })) {
    spdlog::warn("http: drain deadline ({} ms) passed: closing {} connections",
                 core_.options.drain_timeout.count(), core_.connections.load());
    core_.budget.Close();
    ForEachSession(&Session::ForceClose);
  }
  // The service's `done` must have posted its last response before the
  // I/O context goes: no deadline here, the service bounds its infers.
  std::unique_lock lock(core_.mutex);
  core_.changed.wait(lock, [this] { return core_.in_flight == 0; });
}

}  // namespace hearth::rest
