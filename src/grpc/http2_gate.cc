#include "grpc/http2_gate.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <spdlog/spdlog.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "hearth/unique_fd.h"

namespace hearth {
namespace {

using Clock = std::chrono::steady_clock;

constexpr char kPreface[] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
constexpr size_t kPrefaceBytes = sizeof(kPreface) - 1;
constexpr size_t kFrameHeaderBytes = 9;
constexpr uint8_t kData = 0x0;
constexpr uint8_t kHeaders = 0x1;
constexpr uint8_t kRstStream = 0x3;
constexpr uint8_t kEndStream = 0x1;
constexpr auto kDrainTime = std::chrono::seconds(5);

// RST_STREAM(CANCEL) for `stream`.
std::string ResetFrame(uint32_t stream) {
  const char f[13] = {0,
                      0,
                      4,
                      3,
                      0,
                      static_cast<char>(stream >> 24),
                      static_cast<char>(stream >> 16),
                      static_cast<char>(stream >> 8),
                      static_cast<char>(stream),
                      0,
                      0,
                      0,
                      8};
  return std::string(f, sizeof(f));
}

// Tokens that come back at `rate` a second, at most `burst` of them.
class Bucket {
 public:
  Bucket(double rate, double burst) : rate_(rate), burst_(burst), tokens_(burst) {}
  bool Take(Clock::time_point now) {
    Refill(now);
    if (tokens_ < 1) return false;
    tokens_ -= 1;
    return true;
  }
  // When the next token is there.
  Clock::time_point Next(Clock::time_point now) {
    Refill(now);
    if (tokens_ >= 1) return now;
    return now + std::chrono::microseconds(static_cast<int64_t>((1 - tokens_) / rate_ * 1e6) + 1);
  }

 private:
  void Refill(Clock::time_point now) {
    const double seconds = std::chrono::duration<double>(now - last_).count();
    last_ = now;
    tokens_ = std::min(burst_, tokens_ + seconds * rate_);
  }
  double rate_;
  double burst_;
  double tokens_;
  Clock::time_point last_ = Clock::now();
};

// One direction of a relayed connection: the bytes read from its source and
// not yet written to its destination, [begin, end) of `bytes`, of which
// [begin, passed) have had their frame headers read and may be written.
struct Direction {
  std::vector<char> bytes = std::vector<char>(kGateBufferBytes);
  size_t begin = 0;
  size_t passed = 0;
  size_t end = 0;
  uint64_t payload = 0;  // bytes of the current frame's payload still to pass
  size_t preface = 0;    // bytes of the client's preface still to pass
  bool eof = false;      // the source has ended
  bool shut = false;     // the destination was shut down for writing

  size_t room() const { return bytes.size() - end; }
  bool pending() const { return passed > begin; }
  bool drained() const { return begin == end; }
  void Compact() {
    if (begin == end) {
      begin = passed = end = 0;
    } else if (begin > 0 && room() < kFrameHeaderBytes + 4096) {
      std::memmove(bytes.data(), bytes.data() + begin, end - begin);
      passed -= begin;
      end -= begin;
      begin = 0;
    }
  }
};

struct Connection;
struct Endpoint {
  Connection* connection;
  bool client;
};

struct Connection {
  Connection(const Http2GateLimits& limits)
      : streams(limits.streams_per_second, limits.stream_burst),
        resets(limits.resets_per_second, limits.reset_burst) {}
  uint64_t id = 0;
  UniqueFd client;
  UniqueFd grpc;          // the gate's end of the socketpair
  int grpc_peer_fd = -1;  // grpc's end's number ("fd:N")
  ClientConnection who;
  Direction up;    // client to grpc
  Direction down;  // grpc to client
  Bucket streams;
  Bucket resets;
  uint32_t last_stream = 0;
  std::unordered_set<uint32_t> open;
  Clock::time_point deadline;  // for the preface
  std::optional<Clock::time_point> paced_until;
  bool waiting_total = false;  // a new stream waits for room under max_total_open_streams
  bool draining = false;       // closed to its client; waits for grpc to end its streams
  Clock::time_point drain_deadline;
  Endpoint client_end{this, true};
  Endpoint grpc_end{this, false};
  uint32_t client_events = 0;
  uint32_t grpc_events = 0;
};

enum class Verdict { kPass, kWait, kClose };

// Why the gate closed a connection, for its log lines (one a second each).
enum Why { kOpenStreams, kResets, kHandshake, kWhys };

std::string Describe(const ClientConnection& c) { return c.address + ":" + std::to_string(c.port); }

}  // namespace

class Http2Gate::Impl {
 public:
  Impl(Http2GateLimits limits, std::function<void(int)> adopt)
      : limits_(limits),
        adopt_(std::move(adopt)),
        total_resets_(limits.total_resets_per_second, limits.total_resets_per_second) {}

  ~Impl() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    Wake();
    if (thread_.joinable()) thread_.join();
  }

  Status Listen(const std::string& host, uint16_t port) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    addrinfo* found = nullptr;
    const std::string service = std::to_string(port);
    if (int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &found); rc != 0)
      return Unavailable("cannot listen for gRPC on " + host + ":" + service + ": cannot resolve " +
                         host + ": " + ::gai_strerror(rc));
    std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> owned(found, ::freeaddrinfo);
    int error = 0;
    for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
      UniqueFd fd(::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
      if (!fd.valid()) {
        error = errno;
        continue;
      }
      const int one = 1;
      ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
      if (::bind(fd.get(), a->ai_addr, a->ai_addrlen) != 0 || ::listen(fd.get(), 1024) != 0) {
        error = errno;
        continue;
      }
      sockaddr_storage bound{};
      socklen_t length = sizeof(bound);
      ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound), &length);
      port_ = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                                : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
      listener_ = std::move(fd);
      break;
    }
    if (!listener_.valid())
      return Unavailable("cannot listen for gRPC on " + host + ":" + service + ": " +
                         std::strerror(error) +
                         " (the port is in use or the address is not this machine's)");
    epoll_.Reset(::epoll_create1(EPOLL_CLOEXEC));
    wake_.Reset(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    if (!epoll_.valid() || !wake_.valid()) return ErrnoError("gRPC gate: epoll", errno);
    epoll_event e{};
    e.events = EPOLLIN;
    e.data.ptr = &listener_;
    if (::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, listener_.get(), &e) != 0)
      return ErrnoError("gRPC gate: epoll_ctl", errno);
    e.data.ptr = &wake_;
    if (::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, wake_.get(), &e) != 0)
      return ErrnoError("gRPC gate: epoll_ctl", errno);
    return Status::Ok();
  }

  uint16_t port() const { return port_; }

  void Start() {
    thread_ = std::thread([this] { Run(); });
  }

  // Returns once the gate's thread has closed the listener: no connection
  // is handed to grpc++ after it (grpc++ may be shutting down).
  void StopAccepting() {
    std::unique_lock lock(mu_);
    stop_accepting_ = true;
    if (!thread_.joinable()) {
      listener_.Reset();
      return;
    }
    lock.unlock();
    Wake();
    lock.lock();
    listener_closed_.wait(lock, [this] { return !listener_.valid() || stop_; });
  }

  std::optional<ClientConnection> Client(const std::string& peer) const {
    if (peer.rfind("fd:", 0) != 0) return std::nullopt;
    int fd = -1;
    try {
      size_t used = 0;
      fd = std::stoi(peer.substr(3), &used);
      if (used != peer.size() - 3) return std::nullopt;
    } catch (...) {
      return std::nullopt;
    }
    std::lock_guard lock(mu_);
    auto it = clients_.find(fd);
    if (it == clients_.end()) return std::nullopt;
    return it->second.second;
  }

  Http2GateStats stats() const {
    Http2GateStats s;
    s.connections = connections_.load();
    s.accepted = accepted_.load();
    s.closed_open_streams = closed_open_streams_.load();
    s.closed_resets = closed_resets_.load();
    s.closed_handshake = closed_handshake_.load();
    s.paced = paced_.load();
    s.waited_total = waited_total_.load();
    return s;
  }

 private:
  void Wake() {
    if (!wake_.valid()) return;
    const uint64_t one = 1;
    ssize_t unused = ::write(wake_.get(), &one, sizeof(one));
    (void)unused;
  }

  void Run() {
    std::vector<epoll_event> events(256);
    Clock::time_point next_sweep = Clock::now() + std::chrono::seconds(1);
    for (;;) {
      {
        std::lock_guard lock(mu_);
        if (stop_) break;
        if (stop_accepting_ && listener_.valid()) {
          listener_.Reset();  // closing it takes it out of the epoll set
          listener_closed_.notify_all();
        }
      }
      const Clock::time_point now = Clock::now();
      Clock::time_point wake_at = next_sweep;
      for (Connection* c : paced_set_) wake_at = std::min(wake_at, *c->paced_until);
      if (!unblocked_.empty()) wake_at = now;
      const int timeout = static_cast<int>(std::max<int64_t>(
          0, std::chrono::duration_cast<std::chrono::milliseconds>(wake_at - now).count() + 1));
      const int n =
          ::epoll_wait(epoll_.get(), events.data(), static_cast<int>(events.size()), timeout);
      if (n < 0 && errno != EINTR) {
        spdlog::error("gRPC gate: epoll_wait: {}", std::strerror(errno));
        break;
      }
      for (int i = 0; i < std::max(n, 0); ++i) {
        void* tag = events[i].data.ptr;
        if (tag == &listener_) {
          AcceptAll();
        } else if (tag == &wake_) {
          uint64_t count = 0;
          ssize_t unused = ::read(wake_.get(), &count, sizeof(count));
          (void)unused;
        } else {
          Connection* c = static_cast<Endpoint*>(tag)->connection;
          if (connections_by_id_.count(c->id) > 0 && !closed_.count(c->id)) Pump(*c);
        }
      }
      const Clock::time_point after = Clock::now();
      std::vector<Connection*> due;
      for (Connection* c : paced_set_)
        if (*c->paced_until <= after) due.push_back(c);
      for (Connection* c : due) {
        paced_set_.erase(c);
        c->paced_until.reset();
        if (!closed_.count(c->id)) Pump(*c);
      }
      // Streams ended: the connections waiting for room go on.
      while (!unblocked_.empty()) {
        std::vector<Connection*> ready;
        ready.swap(unblocked_);
        for (Connection* c : ready)
          if (!closed_.count(c->id)) Pump(*c);
      }
      if (after >= next_sweep) {
        next_sweep = after + std::chrono::seconds(1);
        if (connections_.load() < static_cast<uint64_t>(limits_.max_connections)) ResumeListener();
        std::vector<Connection*> late;
        for (auto& [id, c] : connections_by_id_)
          if (c->up.preface > 0 && c->deadline <= after) late.push_back(c.get());
        for (Connection* c : late) {
          ++closed_handshake_;
          Close(*c, "its HTTP/2 preface did not arrive within the handshake timeout", kHandshake);
        }
        std::vector<Connection*> drained;
        for (auto& [id, c] : connections_by_id_)
          if (c->draining && c->drain_deadline <= after) drained.push_back(c.get());
        for (Connection* c : drained) Finish(*c);
      }
      // Streams that ended in the sweep may have unblocked connections that
      // are gone by now: only the live ones wait for the next round.
      std::erase_if(unblocked_, [this](Connection* c) { return closed_.count(c->id) > 0; });
      for (uint64_t id : closed_) connections_by_id_.erase(id);
      closed_.clear();
    }
    connections_by_id_.clear();
    std::lock_guard lock(mu_);
    clients_.clear();
  }

  void AcceptAll() {
    while (listener_.valid() &&
           connections_.load() < static_cast<uint64_t>(limits_.max_connections)) {
      sockaddr_storage peer{};
      socklen_t length = sizeof(peer);
      UniqueFd client(::accept4(listener_.get(), reinterpret_cast<sockaddr*>(&peer), &length,
                                SOCK_NONBLOCK | SOCK_CLOEXEC));
      if (!client.valid()) {
        if (errno == EAGAIN || errno == EINTR || errno == ECONNABORTED) return;
        // Out of descriptors: the connection waits in the backlog; try again
        // at the next sweep rather than spin.
        spdlog::warn("gRPC: accepting a connection: {}", std::strerror(errno));
        PauseListener();
        return;
      }
      int pair[2];
      if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) != 0) {
        spdlog::warn("gRPC: a socketpair for a new connection: {}", std::strerror(errno));
        continue;  // the client's socket closes: it may try again
      }
      const int one = 1;
      ::setsockopt(client.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      // Both ends non-blocking: grpc++ reads its end as it reads the sockets
      // it accepts itself, and does not make it so.
      for (int fd : pair) ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
      auto c = std::make_unique<Connection>(limits_);
      c->id = ++last_id_;
      c->client = std::move(client);
      c->grpc.Reset(pair[0]);
      c->grpc_peer_fd = pair[1];
      c->who = Who(peer, c->client.get());
      c->up.preface = kPrefaceBytes;
      c->deadline = Clock::now() + limits_.handshake_timeout;
      {
        std::lock_guard lock(mu_);
        clients_[pair[1]] = {c->id, c->who};
      }
      Connection& ref = *c;
      connections_by_id_.emplace(c->id, std::move(c));
      ++connections_;
      ++accepted_;
      adopt_(pair[1]);
      Interest(ref);
    }
    if (listener_.valid()) PauseListener();
  }

  void PauseListener() {
    if (listener_paused_ || !listener_.valid()) return;
    epoll_event e{};
    e.events = 0;
    e.data.ptr = &listener_;
    ::epoll_ctl(epoll_.get(), EPOLL_CTL_MOD, listener_.get(), &e);
    listener_paused_ = true;
  }

  void ResumeListener() {
    if (!listener_paused_ || !listener_.valid()) return;
    epoll_event e{};
    e.events = EPOLLIN;
    e.data.ptr = &listener_;
    ::epoll_ctl(epoll_.get(), EPOLL_CTL_MOD, listener_.get(), &e);
    listener_paused_ = false;
  }

  static ClientConnection Who(const sockaddr_storage& peer, int fd) {
    ClientConnection who;
    char text[INET6_ADDRSTRLEN] = "";
    if (peer.ss_family == AF_INET) {
      const auto* a = reinterpret_cast<const sockaddr_in*>(&peer);
      ::inet_ntop(AF_INET, &a->sin_addr, text, sizeof(text));
      who.port = ntohs(a->sin_port);
    } else if (peer.ss_family == AF_INET6) {
      const auto* a = reinterpret_cast<const sockaddr_in6*>(&peer);
      ::inet_ntop(AF_INET6, &a->sin6_addr, text, sizeof(text));
      who.port = ntohs(a->sin6_port);
    }
    who.address = text;
    sockaddr_storage local{};
    socklen_t length = sizeof(local);
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &length) == 0) {
      who.server_port =
          ntohs(local.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&local)->sin6_port
                                            : reinterpret_cast<sockaddr_in*>(&local)->sin_port);
    }
    return who;
  }

  // The client's frames: streams it opens take a token (or wait for one),
  // more open streams than allowed or resets past their rate close it.
  Verdict ClientFrame(Connection& c, uint8_t type, uint8_t /*flags*/, uint32_t stream) {
    if (type == kHeaders && (stream & 1) == 1 && stream > c.last_stream) {
      if (total_open_ >= static_cast<uint64_t>(limits_.max_total_open_streams)) {
        c.waiting_total = true;
        blocked_.insert(&c);
        ++waited_total_;
        return Verdict::kWait;
      }
      const Clock::time_point now = Clock::now();
      if (!c.streams.Take(now)) {
        c.paced_until = c.streams.Next(now);
        ++paced_;
        return Verdict::kWait;
      }
      c.last_stream = stream;
      // The stream past the limit never reaches grpc.
      if (c.open.size() >= static_cast<size_t>(limits_.max_open_streams)) {
        ++closed_open_streams_;
        Close(c,
              "more than " + std::to_string(limits_.max_open_streams) +
                  " streams open at once (it ignores the server's SETTINGS)",
              kOpenStreams);
        return Verdict::kClose;
      }
      Opened(c, stream);
    } else if (type == kRstStream) {
      Ended(c, stream);
      // Each reset still costs grpc a call made and cancelled: a client
      // reconnecting after each close must not multiply the connection's
      // allowance, so resets are also bounded over all connections.
      const Clock::time_point now = Clock::now();
      if (!c.resets.Take(now) || !total_resets_.Take(now)) {
        ++closed_resets_;
        Close(c,
              "it resets streams faster than " +
                  std::to_string(static_cast<int>(limits_.resets_per_second)) + " a second",
              kResets);
        return Verdict::kClose;
      }
    }
    return Verdict::kPass;
  }

  // grpc's frames: a stream ends with END_STREAM or a reset.
  void ServerFrame(Connection& c, uint8_t type, uint8_t flags, uint32_t stream) {
    if (type == kRstStream || ((type == kHeaders || type == kData) && (flags & kEndStream) != 0))
      Ended(c, stream);
  }

  void Opened(Connection& c, uint32_t stream) {
    if (c.open.insert(stream).second) ++total_open_;
  }
  void Ended(Connection& c, uint32_t stream) {
    if (c.open.erase(stream) > 0) Released(1);
  }
  // `n` streams left grpc: the connections waiting for room go on.
  void Released(size_t n) {
    total_open_ -= n;
    if (!blocked_.empty() && total_open_ < static_cast<uint64_t>(limits_.max_total_open_streams)) {
      for (Connection* b : blocked_) {
        b->waiting_total = false;
        unblocked_.push_back(b);
      }
      blocked_.clear();
    }
  }

  // Reads the frame headers of `d`'s new bytes; false once `c` is closed.
  bool Scan(Connection& c, Direction& d, bool client) {
    while (d.passed < d.end) {
      if (d.preface > 0) {
        const size_t at = kPrefaceBytes - d.preface;
        const size_t n = std::min(d.preface, d.end - d.passed);
        if (std::memcmp(d.bytes.data() + d.passed, kPreface + at, n) != 0) {
          ++closed_handshake_;
          Close(c, "it did not begin with HTTP/2's connection preface", kHandshake);
          return false;
        }
        d.passed += n;
        d.preface -= n;
        continue;
      }
      if (d.payload > 0) {
        const size_t n = static_cast<size_t>(std::min<uint64_t>(d.payload, d.end - d.passed));
        d.passed += n;
        d.payload -= n;
        continue;
      }
      if (d.end - d.passed < kFrameHeaderBytes) return true;
      const auto* h = reinterpret_cast<const uint8_t*>(d.bytes.data() + d.passed);
      const uint32_t length = (uint32_t{h[0]} << 16) | (uint32_t{h[1]} << 8) | h[2];
      const uint8_t type = h[3];
      const uint8_t flags = h[4];
      const uint32_t stream =
          ((uint32_t{h[5]} << 24) | (uint32_t{h[6]} << 16) | (uint32_t{h[7]} << 8) | h[8]) &
          0x7fffffffu;
      if (client) {
        const Verdict v = ClientFrame(c, type, flags, stream);
        if (v == Verdict::kClose) return false;
        if (v == Verdict::kWait) {
          paced_set_.insert(&c);
          return true;
        }
      } else {
        ServerFrame(c, type, flags, stream);
      }
      d.passed += kFrameHeaderBytes;
      d.payload = length;
    }
    return true;
  }

  // Moves what can move between the two sockets, then sets what to wait for.
  void Pump(Connection& c) {
    if (!Move(c, c.client.get(), c.up, c.grpc.get(), true)) return;
    if (!Move(c, c.grpc.get(), c.down, c.client.get(), false)) return;
    Interest(c);
  }

  // One read from `from` into `d`, its frames scanned, one write of what
  // passed to `to`; false once `c` is closed.
  bool Move(Connection& c, int from, Direction& d, int to, bool client) {
    d.Compact();
    if (!d.eof && d.room() > 0) {
      const ssize_t n = ::read(from, d.bytes.data() + d.end, d.room());
      if (n > 0) {
        d.end += static_cast<size_t>(n);
      } else if (n == 0) {
        d.eof = true;
      } else if (errno != EAGAIN && errno != EINTR) {
        Close(c);
        return false;
      }
    }
    if (client && (c.paced_until || c.waiting_total || c.draining)) {
      // Waiting for a stream token: nothing more passes until the timer.
    } else if (!Scan(c, d, client)) {
      return false;
    }
    if (!client && c.draining) {
      d.begin = d.passed;  // the client is gone: grpc's answers are read for their ends only
      if (c.open.empty() || d.eof) {
        Finish(c);
        return false;
      }
    } else if (d.pending()) {
      const ssize_t n = ::send(to, d.bytes.data() + d.begin, d.passed - d.begin, MSG_NOSIGNAL);
      if (n > 0) {
        d.begin += static_cast<size_t>(n);
      } else if (n < 0 && errno != EAGAIN && errno != EINTR) {
        Close(c);
        return false;
      }
    }
    // Room for the rest of a frame header that ends the buffer: with none,
    // neither side would be waited for again.
    d.Compact();
    if (d.eof && d.drained() && !d.shut && !c.draining) {
      if (!client) {
        // grpc has closed its end: nothing more can pass either way.
        Close(c);
        return false;
      }
      ::shutdown(to, SHUT_WR);
      d.shut = true;
    }
    return true;
  }

  void Interest(Connection& c) {
    constexpr uint32_t kIn = EPOLLIN;
    constexpr uint32_t kOut = EPOLLOUT;
    const uint32_t client_events =
        (!c.up.eof && c.up.room() > 0 ? kIn : 0u) | (c.down.pending() ? kOut : 0u);
    const uint32_t grpc_events =
        (!c.down.eof && c.down.room() > 0 ? kIn : 0u) | (c.up.pending() ? kOut : 0u);
    if (c.client.valid()) Set(c.client.get(), &c.client_end, client_events, &c.client_events);
    Set(c.grpc.get(), &c.grpc_end, grpc_events, &c.grpc_events);
  }

  void Set(int fd, Endpoint* endpoint, uint32_t want, uint32_t* have) {
    if (registered_.count(endpoint) && *have == want) return;
    epoll_event e{};
    e.events = want;
    e.data.ptr = endpoint;
    const int op = registered_.count(endpoint) ? EPOLL_CTL_MOD : EPOLL_CTL_ADD;
    if (::epoll_ctl(epoll_.get(), op, fd, &e) == 0) {
      registered_.insert(endpoint);
      *have = want;
    }
  }

  // Ends a connection. `why` empty: it ended as connections do, nothing to
  // log. Streams it left open in grpc still count towards
  // max_total_open_streams: grpc is told to reset them (where the relay is
  // between two frames) and the gate reads grpc's end until they are over
  // (at most kDrainTime), so that a client cannot leave work in grpc by
  // reconnecting.
  void Close(Connection& c, const std::string& why = "", Why kind = kWhys) {
    if (closed_.count(c.id)) return;
    if (c.draining) {  // an error on grpc's end while waiting for it: nothing more to wait for
      Finish(c);
      return;
    }
    if (kind != kWhys) Warn(c, why, kind);
    paced_set_.erase(&c);
    c.paced_until.reset();
    blocked_.erase(&c);
    c.waiting_total = false;
    registered_.erase(&c.client_end);
    c.client.Reset();
    if (c.open.empty() || !c.grpc.valid() || c.down.eof) {
      Finish(c);
      return;
    }
    c.draining = true;
    c.drain_deadline = Clock::now() + kDrainTime;
    Direction& up = c.up;
    up.end = up.passed;  // what the client sent and the gate did not pass is dropped
    up.eof = true;
    if (up.payload == 0 && up.preface == 0) {
      for (uint32_t stream : c.open) {
        if (up.room() < 13) break;
        const std::string reset = ResetFrame(stream);
        std::memcpy(up.bytes.data() + up.end, reset.data(), reset.size());
        up.end += reset.size();
      }
      up.passed = up.end;
    }
    Interest(c);
  }

  // Forgets a connection: its descriptors closed, its open streams no
  // longer counted.
  void Finish(Connection& c) {
    if (closed_.count(c.id)) return;
    closed_.insert(c.id);
    paced_set_.erase(&c);
    blocked_.erase(&c);
    Released(c.open.size());
    c.open.clear();
    registered_.erase(&c.client_end);
    registered_.erase(&c.grpc_end);
    c.client.Reset();  // closing takes them out of the epoll set
    c.grpc.Reset();
    {
      std::lock_guard lock(mu_);
      auto it = clients_.find(c.grpc_peer_fd);
      if (it != clients_.end() && it->second.first == c.id) clients_.erase(it);
    }
    --connections_;
    ResumeListener();
  }

  // At most one line a second for each reason, with how many were left out.
  void Warn(const Connection& c, const std::string& why, Why kind) {
    const Clock::time_point now = Clock::now();
    uint64_t& unlogged = unlogged_by_why_[kind];
    if (now - last_warning_[kind] < std::chrono::seconds(1)) {
      ++unlogged;
      return;
    }
    last_warning_[kind] = now;
    spdlog::warn("gRPC: closed the connection from {}: {}{}", Describe(c.who), why,
                 unlogged > 0 ? " (and " + std::to_string(unlogged) + " more since the last line)"
                              : std::string());
    unlogged = 0;
  }

  const Http2GateLimits limits_;
  const std::function<void(int)> adopt_;
  UniqueFd listener_;
  UniqueFd epoll_;
  UniqueFd wake_;
  uint16_t port_ = 0;
  std::thread thread_;

  mutable std::mutex mu_;
  bool stop_ = false;
  bool stop_accepting_ = false;
  std::condition_variable listener_closed_;
  // grpc's end's descriptor number: the connection's id and its client.
  std::map<int, std::pair<uint64_t, ClientConnection>> clients_;

  // The gate's thread only.
  uint64_t last_id_ = 0;
  std::unordered_map<uint64_t, std::unique_ptr<Connection>> connections_by_id_;
  std::unordered_set<uint64_t> closed_;  // this round's, erased at its end
  std::unordered_set<Connection*> paced_set_;
  std::unordered_set<Connection*> blocked_;  // waiting for room under max_total_open_streams
  std::vector<Connection*> unblocked_;       // to pump before this round ends
  uint64_t total_open_ = 0;                  // streams opened in grpc, not yet ended
  Bucket total_resets_;                      // resets of all connections
  std::unordered_set<const Endpoint*> registered_;
  bool listener_paused_ = false;
  Clock::time_point last_warning_[kWhys] = {};
  uint64_t unlogged_by_why_[kWhys] = {};

  std::atomic<uint64_t> connections_{0};
  std::atomic<uint64_t> accepted_{0};
  std::atomic<uint64_t> closed_open_streams_{0};
  std::atomic<uint64_t> closed_resets_{0};
  std::atomic<uint64_t> closed_handshake_{0};
  std::atomic<uint64_t> paced_{0};
  std::atomic<uint64_t> waited_total_{0};
};

Result<std::unique_ptr<Http2Gate>> Http2Gate::Listen(const std::string& host, uint16_t port,
                                                     Http2GateLimits limits,
                                                     std::function<void(int fd)> adopt) {
  auto impl = std::make_unique<Impl>(limits, std::move(adopt));
  RETURN_IF_ERROR(impl->Listen(host, port));
  return std::unique_ptr<Http2Gate>(new Http2Gate(std::move(impl)));
}

Http2Gate::Http2Gate(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Http2Gate::~Http2Gate() = default;
uint16_t Http2Gate::port() const { return impl_->port(); }
void Http2Gate::Start() { impl_->Start(); }
void Http2Gate::StopAccepting() { impl_->StopAccepting(); }
std::optional<ClientConnection> Http2Gate::Client(const std::string& peer) const {
  return impl_->Client(peer);
}
Http2GateStats Http2Gate::stats() const { return impl_->stats(); }

}  // namespace hearth
