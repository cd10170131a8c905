#include "http/http_server.h"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <boost/asio/dispatch.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <deque>
#include <exception>
#include <future>
#include <limits>
#include <mutex>
#include <optional>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/compression.h"
#include "http/body_budget.h"
#include "http/event_stream.h"
#include "http/generate.h"
#include "http/kserve_codec.h"
#include "http/openai.h"
#include "http/responses.h"
#include "http/routes.h"
#include "http/sse.h"
#include "http/triton_json.h"

namespace hearth::rest {
namespace {

namespace net = boost::asio;
using tcp = net::ip::tcp;
using Clock = std::chrono::steady_clock;

constexpr uint32_t kHeaderLimit = 16 * 1024;
// Unparsed bytes one connection buffers: a head and what came with it. Beast
// reads at most 64 KiB at a time, and a head is at most kHeaderLimit.
constexpr size_t kReadBufferBytes = 64 * 1024;
// After a response that closes the connection, unread request bytes are
// drained for this long so that closing does not reset the connection (which
// can destroy the response before the client reads it).
constexpr std::chrono::seconds kLingerTime{2};
// Bodies at least this large (with a Content-Length) are read by the session
// itself, straight into their final string, rather than by Beast's parser.
// Measured with one sample of 16384 floats (a 64 KiB body, one connection):
// 1.32 ms per request through Beast's parser, 0.62 ms read directly.
constexpr uint64_t kDirectBodyBytes = 16 * 1024;
// Draining: an idle connection is closed once idle this long (see
// Session::CloseIfIdle).
constexpr std::chrono::seconds kDrainIdleGrace{1};
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
// Responses are compressed (when the client accepts it) from this size to
// this one.
constexpr size_t kCompressMinBytes = 1024;
constexpr size_t kCompressMaxBytes = size_t{1} << 30;
// Repository loads and unloads at once; past it they are answered 503.
constexpr int kMaxControlCalls = 4;

class Session;

// State the sessions share with the server. Owned by the Listener, which
// outlives every handler that runs (Stop() joins the I/O threads first).
struct ServerCore {
  ServerCore(InferenceService* service_in, HttpOptions options_in)
      : service(service_in),
        options(std::move(options_in)),
        body_limit(std::min(options.max_body_bytes, options.max_inflight_bytes)),
        budget(options.max_inflight_bytes) {}

  // Wakes Stop() when what it waits for may have changed. Only while
  // stopping, so that the request path takes no lock for it: the flag and
  // the counters are sequentially consistent, so either the session sees
  // `stopping` or Stop() sees the session's change. (Called on I/O threads,
  // which Stop() joins before anything is destroyed.)
  void Changed() {
    if (!stopping.load()) return;
    std::lock_guard lock(mutex);
    changed.notify_all();
  }

  HttpStats Stats() const {
    HttpStats s;
    s.draining = stopping.load();
    s.listening = listening.load();
    s.connections = connections.load();
    s.requests = busy.load();
    s.connection_limit = connection_limit.load();
    s.accept_paused = accept_paused.load();
    s.accept_errors = accept_errors.load();
    const BodyBudget::Snapshot b = budget.snapshot();
    s.inflight_body_bytes = b.held;
    s.inflight_body_bytes_peak = b.peak;
    s.inflight_body_bytes_limit = b.limit;
    s.budget_waiting = b.waiting;
    s.budget_waits = b.waits;
    s.head_timeouts = head_timeouts.load();
    s.body_timeouts = body_timeouts.load();
    s.idle_timeouts = idle_timeouts.load();
    s.write_timeouts = write_timeouts.load();
    s.connections_evicted = connections_evicted.load();
    s.streams = streams.load();
    s.stream_overflows = stream_overflows.load();
    return s;
  }

  InferenceService* const service;
  const HttpOptions options;
  const uint64_t body_limit;  // the largest body answered with anything but 413
  BodyBudget budget;

  std::atomic<bool> stopping{false};
  // False once the acceptor is closed: closing sessions stop waking it.
  std::atomic<bool> accepting{true};
  std::atomic<bool> accept_paused{false};
  std::atomic<bool> listening{false};
  std::atomic<uint64_t> connection_limit{0};
  std::atomic<uint64_t> connections{0};
  // Sessions between the first byte of a request and its response written.
  std::atomic<uint64_t> busy{0};
  std::atomic<uint64_t> accept_errors{0};
  std::atomic<uint64_t> head_timeouts{0};
  std::atomic<uint64_t> body_timeouts{0};
  std::atomic<uint64_t> idle_timeouts{0};
  std::atomic<uint64_t> write_timeouts{0};
  std::atomic<uint64_t> connections_evicted{0};
  std::atomic<uint64_t> streams{0};           // event streams whose head is sent, not yet ended
  std::atomic<uint64_t> stream_overflows{0};  // streams stopped for a client that fell behind
  // Posts Listener::ResumeAccepting onto the acceptor's strand; set before Start
  // runs any handler.
  std::function<void()> wake_acceptor;

  std::mutex mutex;
  std::condition_variable changed;
  uint64_t in_flight = 0;  // infers given to the service whose `done` has not returned
  // Repository loads and unloads running on their own threads (a load waits
  // for workers to start: never on an I/O thread); at most kMaxControlCalls.
  std::atomic<int> control_calls{0};

  // Every open session, for Stop() to reach them.
  std::mutex sessions_mutex;
  std::unordered_map<uint64_t, std::weak_ptr<Session>> sessions;
  std::atomic<uint64_t> next_session{1};
};

// Counts one infer as in flight from the moment it is given to the service
// until its `done` has handed the response to the connection's strand: Stop()
// keeps the I/O context alive until then.
class InFlightInfer {
 public:
  explicit InFlightInfer(ServerCore* core) : core_(core) {
    std::lock_guard lock(core_->mutex);
    ++core_->in_flight;
  }
  // Notifies under the lock: once in_flight is 0, Stop() may return and
  // destroy the condition variable, and this may run on the service's thread.
  ~InFlightInfer() {
    std::lock_guard lock(core_->mutex);
    --core_->in_flight;
    core_->changed.notify_all();
  }
  InFlightInfer(const InFlightInfer&) = delete;
  InFlightInfer& operator=(const InFlightInfer&) = delete;

 private:
  ServerCore* core_;
};

std::string HttpMetricsText(const HttpStats& s) {
  std::string out;
  auto metric = [&out](const char* name, const char* type, const char* help, uint64_t value) {
    out += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " " + type + "\n" +
           name + " " + std::to_string(value) + "\n";
  };
  metric("hearth_http_connections", "gauge", "Open HTTP connections.", s.connections);
  metric("hearth_http_requests", "gauge",
         "Requests being received, run or answered (from a head's first byte to the response "
         "written).",
         s.requests);
  metric("hearth_http_connection_limit", "gauge",
         "Connections served at once (--max-connections, lowered to fit the descriptor limit).",
         s.connection_limit);
  metric("hearth_http_accept_paused", "gauge",
         "1 while accepting is paused: at the connection limit or after an accept error.",
         s.accept_paused ? 1 : 0);
  metric("hearth_http_accept_errors_total", "counter",
         "Accepts that failed for want of descriptors or memory.", s.accept_errors);
  metric("hearth_http_connections_evicted_total", "counter",
         "Silent or idle connections closed at the connection limit to accept waiting ones.",
         s.connections_evicted);
  metric("hearth_http_streams", "gauge",
         "Server-sent event streams being written (generate_stream, OpenAI stream: true).",
         s.streams);
  metric("hearth_http_stream_overflows_total", "counter",
         "Streams stopped because their client did not read them fast enough.", s.stream_overflows);
  metric("hearth_http_inflight_body_bytes", "gauge",
         "Request body bytes held across all connections.", s.inflight_body_bytes);
  metric("hearth_http_inflight_body_bytes_peak", "gauge",
         "The most request body bytes held at once since the start.", s.inflight_body_bytes_peak);
  metric("hearth_http_inflight_body_bytes_limit", "gauge",
         "The request body bytes held across all connections may not exceed this "
         "(--max-inflight-bytes).",
         s.inflight_body_bytes_limit);
  metric("hearth_http_body_budget_waiting", "gauge",
         "Connections waiting for request body bytes to be freed.", s.budget_waiting);
  metric("hearth_http_body_budget_waits_total", "counter",
         "Times a connection waited for request body bytes to be freed.", s.budget_waits);
  out +=
      "# HELP hearth_http_timeouts_total Connections closed for being too slow.\n"
      "# TYPE hearth_http_timeouts_total counter\n";
  const std::pair<const char*, uint64_t> phases[] = {{"head", s.head_timeouts},
                                                     {"body", s.body_timeouts},
                                                     {"idle", s.idle_timeouts},
                                                     {"write", s.write_timeouts}};
  for (const auto& [phase, value] : phases) {
    out += std::string("hearth_http_timeouts_total{phase=\"") + phase + "\"} " +
           std::to_string(value) + "\n";
  }
  return out;
}

// A stream's state shared by its session and its request's callbacks
// (on_response, then `done`), which run on the service's threads. The
// channel holds the session until `done` drops it: the request the service
// keeps afterwards then holds nothing of the I/O context.
struct StreamChannel {
  ServerCore* core = nullptr;
  std::shared_ptr<Session> session;
  std::unique_ptr<StreamCodec> codec;  // used on the service's thread only
  Status failure;                      // likewise: a response that could not be encoded
  unsigned version = 11;
  bool chunked = true;                // HTTP/1.1; an HTTP/1.0 stream ends with the connection
  bool keep_alive = true;             // the connection serves on after the stream
  uint64_t limit = 0;                 // HttpOptions::max_stream_buffer_bytes
  std::atomic<bool> stop{false};      // on_response returns false from now on
  std::atomic<bool> overflow{false};  // stopped for a client that fell behind
  // Bytes of events handed to the strand and not yet written.
  std::atomic<uint64_t> queued{0};
};

bool IsHttpParseError(const beast::error_code& ec) {
  return ec.category() == http::make_error_code(http::error::bad_method).category();
}

// One connection, its requests one after another. Owned by the handlers
// pending on it (its reads, writes and deadline timer), by the body budget
// while it waits there, by the infer's `done` while the service runs one,
// and by a stream's channel until its `done`; all its handlers run on the
// connection's strand.
//
// A request goes: head (ReadHead), body (parsed by Beast for small or
// chunked bodies, read chunk by chunk into the final string for large ones),
// Handle, Send (or a stream's events, then its end), then the next head or a
// lingering close. Body bytes are taken from the server's budget before they
// are read and given back once the response is written, the body is parsed
// (generate and OpenAI requests, whose bodies are not kept), or the
// connection closes.
class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket socket, ServerCore* core)
      : socket_(std::move(socket)),
        timer_(socket_.get_executor()),
        core_(core),
        id_(core->next_session.fetch_add(1)),
        buffer_(kReadBufferBytes) {
    core_->connections.fetch_add(1);
  }

  ~Session() {
    ReleaseBody();
    EndRequest();
    if (stream_started_) core_->streams.fetch_sub(1);
    {
      std::lock_guard lock(core_->sessions_mutex);
      core_->sessions.erase(id_);
    }
    beast::error_code ignored;
    socket_.close(ignored);  // before the slot is given back
    const uint64_t before = core_->connections.fetch_sub(1);
    if (core_->accepting.load() &&
        (before >= core_->connection_limit.load() || core_->accept_paused.load())) {
      core_->wake_acceptor();
    }
    core_->Changed();
  }

  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  void Start() {
    {
      std::lock_guard lock(core_->sessions_mutex);
      core_->sessions.emplace(id_, weak_from_this());
    }
    net::dispatch(socket_.get_executor(), [self = shared_from_this()] { self->ReadHead(); });
  }

  net::any_io_executor executor() { return socket_.get_executor(); }

  // Stop(), once the requests in progress are answered: closes the
  // connection if no request has begun on it and it has been idle for
  // kDrainIdleGrace (else it looks again then). A client between two requests
  // thus sends its next one and is answered 503 rather than meeting our FIN:
  // a request that crosses the FIN can only be read and discarded. The
  // pending head read stays as the lingering read, so that such a request is
  // never reset and the close completes on the client's EOF.
  void CloseIfIdle() {
    if (closed_ || phase_ != Phase::kIdle || fin_sent_) return;
    beast::error_code ec;
    if (buffer_.size() > 0 || socket_.available(ec) > 0) return;  // a request is arriving
    const Clock::duration idle_for = Clock::now() - idle_since_;
    if (idle_for < kDrainIdleGrace) return Arm(kDrainIdleGrace - idle_for, Deadline::kDrainIdle);
    fin_sent_ = true;
    socket_.shutdown(tcp::socket::shutdown_send, ec);
    Arm(kLingerTime, Deadline::kLinger);
  }

  // Stop(), at its deadline.
  void ForceClose() { Close(); }

  // For the acceptor's choice of a connection to evict, from any thread:
  // since when the connection has waited for a head without a byte of it
  // (nanoseconds of Clock; 0 while a request is in progress or once it
  // closes), and whether it has answered a request before. A hint only:
  // Evict() checks again on the strand.
  struct Silence {
    int64_t since = 0;
    bool kept_alive = false;
  };
  Silence silence() const {
    return {silent_since_.load(std::memory_order_relaxed),
            kept_alive_.load(std::memory_order_relaxed)};
  }

  // The acceptor, at the limit with connections waiting: closes this one if
  // no byte of a request has arrived (its destructor then wakes the
  // acceptor), else wakes the acceptor to choose another.
  void Evict() {
    if (closed_) return;  // the destructor wakes the acceptor
    beast::error_code ec;
    if (phase_ == Phase::kIdle && !fin_sent_ && !core_->stopping.load() && buffer_.size() == 0 &&
        socket_.available(ec) == 0 && !ec) {
      core_->connections_evicted.fetch_add(1);
      return Close();
    }
    // Its first bytes are here: the head read completes, and it is no longer
    // a candidate.
    silent_since_.store(0, std::memory_order_relaxed);
    if (core_->accepting.load()) core_->wake_acceptor();
  }

 private:
  enum class Phase {
    kIdle,
    kHead,
    kBody,
    kBudget,
    kHandling,
    kWriting,
    kStreaming,
    kLingering,
    kClosed
  };
  enum class Deadline { kHead, kBody, kIdle, kWrite, kLinger, kDrainIdle };
  // What a wait for the budget resumes.
  enum class Then { kReadParsed, kReadChunk, kContinue, kInflate };
  // What follows a request once the watch on its socket has ended.
  enum class Next { kReadHead, kLinger };

  // ---- deadlines: one timer, re-armed per phase --------------------------

  void Arm(Clock::duration after, Deadline what) {
    const uint64_t generation = ++timer_generation_;
    timer_.expires_after(after);
    timer_.async_wait([self = shared_from_this(), generation, what](beast::error_code ec) {
      if (ec || generation != self->timer_generation_) return;
      self->OnDeadline(what);
    });
  }

  void Disarm() {
    ++timer_generation_;
    timer_.cancel();
  }

  void OnDeadline(Deadline what) {
    if (closed_) return;
    switch (what) {
      case Deadline::kDrainIdle:
        return CloseIfIdle();
      case Deadline::kHead:
        core_->head_timeouts.fetch_add(1);
        break;
      case Deadline::kBody:
        core_->body_timeouts.fetch_add(1);
        break;
      case Deadline::kIdle:
        core_->idle_timeouts.fetch_add(1);
        break;
      case Deadline::kWrite:
        core_->write_timeouts.fetch_add(1);
        break;
      case Deadline::kLinger:
        break;
    }
    // Slow clients are closed, not answered: writing to them could stall too.
    Close();
  }

  // ---- bookkeeping ---------------------------------------------------------

  void BeginRequest() {
    if (busy_) return;
    busy_ = true;
    core_->busy.fetch_add(1);
  }

  void EndRequest() {
    if (!busy_) return;
    busy_ = false;
    core_->busy.fetch_sub(1);
    core_->Changed();
  }

  // Gives back every body byte this connection holds. Not while it waits for
  // the budget: OnGranted gives them back if the connection closed meanwhile.
  void ReleaseBody() {
    if (waiting_ || held_ == 0) return;
    core_->budget.Release(id_, held_);
    held_ = 0;
  }

  // Takes `bytes` of the budget for this request's body, then continues with
  // `then`, now or once they are free.
  void Take(uint64_t bytes, Then then) {
    const auto outcome =
        core_->budget.Acquire(id_, bytes, held_, [self = shared_from_this(), bytes](bool granted) {
          // On the thread that freed the bytes.
          auto executor = self->executor();
          net::post(executor,
                    [self = std::move(self), bytes, granted] { self->OnGranted(granted, bytes); });
        });
    switch (outcome) {
      case BodyBudget::Outcome::kGranted:
        held_ += bytes;
        return Continue(then);
      case BodyBudget::Outcome::kWaiting:
        // Not reading now, so not the client's delay: no deadline.
        waiting_ = true;
        then_ = then;
        phase_ = Phase::kBudget;
        Disarm();
        return;
      case BodyBudget::Outcome::kClosed:
        return Close();
    }
  }

  void OnGranted(bool granted, uint64_t bytes) {
    waiting_ = false;
    if (granted) held_ += bytes;
    if (!granted || closed_) {
      ReleaseBody();
      return Close();
    }
    phase_ = Phase::kBody;
    Continue(then_);
  }

  void Continue(Then then) {
    switch (then) {
      case Then::kReadParsed:
        return ReadParsed();
      case Then::kReadChunk:
        return ReadChunk();
      case Then::kInflate:
        return FinishInflate();
      case Then::kContinue:
        // The budget had room for the first chunk: the body may proceed. The
        // chunk is taken again once its bytes arrive.
        ReleaseBody();
        return SendContinue(Then::kReadChunk);
    }
  }

  // ---- the head ------------------------------------------------------------

  void ReadHead() {
    phase_ = Phase::kIdle;
    idle_since_ = Clock::now();
    kept_alive_.store(!first_request_, std::memory_order_relaxed);
    silent_since_.store(buffer_.size() > 0 ? 0 : idle_since_.time_since_epoch().count(),
                        std::memory_order_relaxed);
    parser_.emplace();
    parser_->header_limit(kHeaderLimit);
    parser_->body_limit(core_->body_limit);
    continue_sent_ = false;
    if (buffer_.size() > 0) {  // pipelined
      phase_ = Phase::kHead;
      BeginRequest();
      Arm(core_->options.head_timeout, Deadline::kHead);
    } else if (first_request_) {
      Arm(core_->options.head_timeout, Deadline::kHead);  // from the accept
    } else {
      Arm(core_->options.idle_timeout, Deadline::kIdle);
    }
    ReadHeadSome();
  }

  void ReadHeadSome() {
    http::async_read_some(socket_, buffer_, *parser_,
                          beast::bind_front_handler(&Session::OnHeadSome, shared_from_this()));
  }

  void OnHeadSome(beast::error_code ec, size_t /*bytes*/) {
    if (ec) return OnReadError(ec);
    if (fin_sent_) return Drain();  // closing: what arrives now is discarded
    if (phase_ == Phase::kIdle) {
      phase_ = Phase::kHead;
      silent_since_.store(0, std::memory_order_relaxed);
      BeginRequest();
      // From its first byte; a connection's first head has had its deadline
      // since the accept, unless the drain replaced it (kDrainIdle).
      if ((!first_request_ || core_->stopping.load()) && !parser_->is_header_done()) {
        Arm(core_->options.head_timeout, Deadline::kHead);
      }
    }
    if (!parser_->is_header_done()) return ReadHeadSome();
    first_request_ = false;
    OnHeader();
  }

  void OnHeader() {
    phase_ = Phase::kBody;
    const auto& request = parser_->get();
    const unsigned version = request.version();
    if (core_->stopping.load()) {
      // Arrived during the drain. The body, if any, is read and discarded by
      // the lingering close.
      return Send(ErrorResponse(503, "the server is shutting down", version, false));
    }
    const auto length = parser_->content_length();
    if (length && *length > core_->body_limit) return Send(TooLarge());
    expect_continue_ = beast::iequals(request[http::field::expect], "100-continue");
    if (parser_->is_done()) {  // no body
      Disarm();
      return FinishParsed();
    }
    if (length && !parser_->chunked() && *length >= kDirectBodyBytes) {
      body_length_ = *length;
      body_.clear();
      // 100-continue: answered once the budget has room for the first chunk.
      if (expect_continue_) return Take(FirstChunk(), Then::kContinue);
      return AwaitChunk();
    }
    if (length) {
      // A small body takes all its bytes at once, and never waits: at most
      // one per connection, so large bodies cannot hold up small requests
      // (they add at most max_connections x kDirectBodyBytes).
      core_->budget.AcquireNow(*length);
      held_ += *length;
      return ReadParsed();
    }
    // A chunked body takes room for one more read at a time (ReadParsed).
    return Take(std::min<uint64_t>(kReadBufferBytes, core_->body_limit), Then::kReadParsed);
  }

  Response TooLarge() const {
    std::string message =
        "request body exceeds the limit of " + std::to_string(core_->body_limit) + " bytes";
    if (core_->body_limit < core_->options.max_body_bytes) {
      message += " (the most the server holds for all requests at once)";
    }
    // Beast refuses a Content-Length past body_limit before it calls the
    // head done, but with the request line already read.
    if (parser_.has_value()) {
      const std::optional<Route> route = ParseRoute(parser_->get().target());
      if (route.has_value() && route->openai()) {
        return OpenAiErrorResponse(OpenAiRequestError(413, message), 11, false);
      }
    }
    return ErrorResponse(413, message, 11, false);
  }

  // ---- bodies read by Beast's parser: small or chunked ---------------------

  void ReadParsed() {
    if (expect_continue_ && !continue_sent_) return SendContinue(Then::kReadParsed);
    phase_ = Phase::kBody;
    const auto length = parser_->content_length();
    if (length) {
      // Room for the JSON parser to read past the end (kRequestBodyPadding):
      // with it, the body is parsed where it lies. Beast's own reserve of
      // Content-Length bytes is then a no-op.
      parser_->get().body().reserve(*length + kRequestBodyPadding);
    }
    progress_mark_ = parser_->get().body().size();
    if (!(length && buffer_.size() >= *length)) Arm(core_->options.body_timeout, Deadline::kBody);
    ReadParsedSome();
  }

  void ReadParsedSome() {
    http::async_read_some(socket_, buffer_, *parser_,
                          beast::bind_front_handler(&Session::OnParsedSome, shared_from_this()));
  }

  void OnParsedSome(beast::error_code ec, size_t /*bytes*/) {
    if (ec) return OnReadError(ec);
    if (parser_->is_done()) {
      Disarm();
      return FinishParsed();
    }
    const uint64_t size = parser_->get().body().size();
    if (size - progress_mark_ >= kBodyChunkBytes) {  // progress: a new deadline
      progress_mark_ = size;
      Arm(core_->options.body_timeout, Deadline::kBody);
    }
    if (parser_->chunked()) {
      // One read adds at most kReadBufferBytes to a chunked body; the parser
      // stops it at body_limit. (A body with a Content-Length took all its
      // bytes before its first read.)
      const uint64_t needed = std::min(size + kReadBufferBytes, core_->body_limit);
      if (held_ < needed) return Take(needed - held_, Then::kReadParsed);
    }
    ReadParsedSome();
  }

  void FinishParsed() {
    Request request = parser_->release();
    parser_.reset();
    Handle(std::move(request));
  }

  // ---- large bodies: read chunk by chunk into their final string -----------

  uint64_t FirstChunk() const { return std::min(kBodyChunkBytes, body_length_); }

  // Waits for the body's first byte before taking any budget for it, so that
  // a client that sends a head and stalls holds nothing.
  void AwaitChunk() {
    if (buffer_.size() > 0) return Take(FirstChunk(), Then::kReadChunk);
    phase_ = Phase::kBody;
    Arm(core_->options.body_timeout, Deadline::kBody);
    socket_.async_receive(net::buffer(&peek_, 1), tcp::socket::message_peek,
                          [self = shared_from_this()](beast::error_code ec, size_t) {
                            if (ec) return self->OnReadError(ec);
                            self->Take(self->FirstChunk(), Then::kReadChunk);
                          });
  }

  // With the chunk's bytes taken from the budget. The string's capacity is
  // reserved once, for the whole body, so that it never moves: a large
  // allocation is mapped, not touched, and costs memory only as resize()
  // reaches it, one chunk at a time, just before the chunk is read into it.
  void ReadChunk() {
    phase_ = Phase::kBody;
    const size_t start = body_.size();
    const auto chunk = static_cast<size_t>(std::min(kBodyChunkBytes, body_length_ - start));
    if (body_.capacity() < body_length_ + kRequestBodyPadding) {
      body_.reserve(body_length_ + kRequestBodyPadding);  // see ReadParsed
    }
    body_.resize(start + chunk);
    const size_t buffered = std::min(buffer_.size(), chunk);
    net::buffer_copy(net::buffer(body_.data() + start, buffered), buffer_.data());
    buffer_.consume(buffered);
    if (buffered == chunk) return OnChunk();
    Arm(core_->options.body_timeout, Deadline::kBody);
    net::async_read(socket_, net::buffer(body_.data() + start + buffered, chunk - buffered),
                    [self = shared_from_this()](beast::error_code ec, size_t) {
                      if (ec) return self->OnReadError(ec);
                      self->OnChunk();
                    });
  }

  void OnChunk() {
    if (body_.size() < body_length_) {
      return Take(std::min(kBodyChunkBytes, body_length_ - body_.size()), Then::kReadChunk);
    }
    Disarm();
    Request request = parser_->release();
    parser_.reset();
    request.body() = std::move(body_);
    body_ = std::string();
    Handle(std::move(request));
  }

  void SendContinue(Then then) {
    continue_.emplace(http::status::continue_, parser_->get().version());
    Arm(core_->options.idle_timeout, Deadline::kWrite);
    http::async_write(socket_, *continue_,
                      [self = shared_from_this(), then](beast::error_code ec, size_t) {
                        self->continue_.reset();
                        if (ec) return self->Close();
                        self->continue_sent_ = true;
                        if (then == Then::kReadChunk) return self->AwaitChunk();
                        self->ReadParsed();
                      });
  }

  // ---- requests ------------------------------------------------------------

  void Handle(Request request) {
    phase_ = Phase::kHandling;
    const unsigned version = request.version();
    if (const auto it = request.find(http::field::content_encoding); it != request.end()) {
      const std::optional<BodyCoding> coding = ParseContentEncoding(it->value());
      if (!coding.has_value()) {
        return Send(ErrorResponse(415,
                                  "Content-Encoding " + std::string(it->value()) +
                                      " is not supported: send the body as it is, gzip or deflate",
                                  version, false));
      }
      if (*coding != BodyCoding::kIdentity) {
        // The inflated size is measured first, keeping nothing, and taken
        // from the budget before the inflated body is held: the limits
        // apply to it as to any body.
        Result<uint64_t> size = InflatedSize(request.body(), *coding, core_->body_limit);
        if (!size.ok()) {
          if (size.status().code() == StatusCode::kResourceExhausted) {
            return Send(ErrorResponse(413,
                                      "request body inflates past the limit of " +
                                          std::to_string(core_->body_limit) + " bytes",
                                      version, false));
          }
          return Send(StatusResponse(size.status(), version, false));
        }
        inflating_ = std::move(request);
        inflate_coding_ = *coding;
        inflate_size_ = *size;
        return Take(*size, Then::kInflate);
      }
    }
    Run(std::move(request));
  }

  void FinishInflate() {
    phase_ = Phase::kHandling;
    Request request = std::move(*inflating_);
    inflating_.reset();
    Result<std::string> body =
        Inflate(request.body(), inflate_coding_, inflate_size_, kRequestBodyPadding);
    if (!body.ok()) return Send(StatusResponse(body.status(), request.version(), false));
    request.erase(http::field::content_encoding);
    request.body() = std::move(*body);
    request.content_length(request.body().size());
    Run(std::move(request));
  }

  void Run(Request request) {
    const unsigned version = request.version();
    try {
      Dispatch(std::move(request));
    } catch (const std::exception& e) {
      // Handlers check what they use; this catches allocation failures and
      // any service method that throws against its contract.
      spdlog::error("http: request failed: {}", e.what());
      Send(ErrorResponse(500, std::string("internal error: ") + e.what(), version, false));
    }
  }

  void OnReadError(beast::error_code ec) {
    if (closed_) return;  // closed by a deadline or by Stop()
    if (ec == http::error::body_limit) return Send(TooLarge());
    if (ec == http::error::header_limit) {
      return Send(ErrorResponse(
          400, "request header exceeds the limit of " + std::to_string(kHeaderLimit) + " bytes", 11,
          false));
    }
    // A client that closed between or in the middle of requests, a reset:
    // nothing to answer.
    if (ec == http::error::end_of_stream || ec == http::error::partial_message ||
        !IsHttpParseError(ec)) {
      return Close();
    }
    Send(ErrorResponse(400, "malformed HTTP request: " + ec.message(), 11, false));
  }
  void Dispatch(Request request) {
    const unsigned version = request.version();
    const bool keep_alive = request.keep_alive();
    const std::optional<Route> route = ParseRoute(request.target());
    if (!route.has_value()) {
      return Send(ErrorResponse(400, "bad percent-encoding in the path", version, keep_alive));
    }
    if (route->kind == Route::Kind::kNone) {
      return Send(ErrorResponse(404, "no such endpoint: " + std::string(request.target()), version,
                                keep_alive));
    }
    // HEAD is GET without the body (Send leaves it out).
    head_ = request.method() == http::verb::head;
    response_coding_ = BodyCoding::kIdentity;
    if (const auto it = request.find(http::field::accept_encoding); it != request.end()) {
      response_coding_ = ChooseResponseCoding(it->value());
    }
    const http::verb method =
        head_ && route->method() == http::verb::get ? http::verb::get : request.method();
    const bool either = route->kind == Route::Kind::kTraceSetting ||
                        route->kind == Route::Kind::kLogging;  // GET reads, POST changes
    if (either && (method == http::verb::get || method == http::verb::post)) {
      return Send(ErrorResponse(
          501,
          route->kind == Route::Kind::kTraceSetting
              ? "hearth has no request tracing yet: there are no trace settings to read or change"
              : "hearth's log settings cannot be read or changed over the API yet: start hearth "
                "with --log-level",
          version, keep_alive));
    }
    if (method != route->method()) {
      const std::string message = "method " + std::string(request.method_string()) +
                                  " is not allowed on " + std::string(request.target());
      Response response = route->openai() ? OpenAiErrorResponse(OpenAiRequestError(405, message),
                                                                version, keep_alive)
                                          : ErrorResponse(405, message, version, keep_alive);
      response.set(http::field::allow, either                                ? "GET, POST"
                                       : route->method() == http::verb::post ? "POST"
                                                                             : "GET");
      return Send(std::move(response));
    }
    InferenceService& service = *core_->service;
    auto health = [&](bool ok) {
      return MakeResponse(ok ? http::status::ok : http::status::service_unavailable, version,
                          keep_alive, "", "");
    };
    switch (route->kind) {
      case Route::Kind::kLive:
        return Send(health(service.Live()));
      case Route::Kind::kReady:
        return Send(health(service.Ready()));
      case Route::Kind::kServer:
        return Send(MakeResponse(
            http::status::ok, version, keep_alive,
            ServerMetadataJson(service.ServerName(), service.ServerVersion(), service.Extensions()),
            "application/json"));
      case Route::Kind::kModel: {
        Result<ModelMetadata> metadata = service.Metadata(route->model, route->version);
        if (!metadata.ok()) return Send(StatusResponse(metadata.status(), version, keep_alive));
        return Send(MakeResponse(http::status::ok, version, keep_alive,
                                 ModelMetadataJson(*metadata), "application/json"));
      }
      case Route::Kind::kModelReady: {
        Result<bool> ready = service.ModelReady(route->model, route->version);
        if (!ready.ok()) return Send(StatusResponse(ready.status(), version, keep_alive));
        return Send(health(*ready));
      }
      case Route::Kind::kInfer:
        return StartInfer(std::move(request), *route);
      case Route::Kind::kGenerate:
        return StartGenerate(std::move(request), *route, false);
      case Route::Kind::kGenerateStream:
        return StartGenerate(std::move(request), *route, true);
      case Route::Kind::kCompletions:
        return StartOpenAi(std::move(request), OpenAiEndpoint::kCompletions);
      case Route::Kind::kChatCompletions:
        return StartOpenAi(std::move(request), OpenAiEndpoint::kChatCompletions);
      case Route::Kind::kOpenAiModels:
        return Send(MakeResponse(http::status::ok, version, keep_alive,
                                 OpenAiModelListJson(service.ModelNames()), "application/json"));
      case Route::Kind::kMetrics:
        return Send(MakeResponse(http::status::ok, version, keep_alive,
                                 service.MetricsText() + HttpMetricsText(core_->Stats()),
                                 "text/plain; version=0.0.4"));
      case Route::Kind::kModelConfig: {
        Result<std::string> config = service.ModelConfigJson(route->model, route->version);
        if (!config.ok()) return Send(StatusResponse(config.status(), version, keep_alive));
        return Send(MakeResponse(http::status::ok, version, keep_alive, std::move(*config),
                                 "application/json"));
      }
      case Route::Kind::kModelStats: {
        Result<std::vector<ModelStatistics>> stats =
            service.Statistics(route->model, route->version);
        if (!stats.ok()) return Send(StatusResponse(stats.status(), version, keep_alive));
        return Send(MakeResponse(http::status::ok, version, keep_alive, ModelStatisticsJson(*stats),
                                 "application/json"));
      }
      case Route::Kind::kRepositoryIndex: {
        Result<bool> ready_only = ParseRepositoryIndexBody(request.body());
        if (!ready_only.ok()) return Send(StatusResponse(ready_only.status(), version, keep_alive));
        return Send(MakeResponse(http::status::ok, version, keep_alive,
                                 RepositoryIndexJson(service.RepositoryIndex(*ready_only)),
                                 "application/json"));
      }
      case Route::Kind::kRepositoryLoad:
      case Route::Kind::kRepositoryUnload: {
        const bool load = route->kind == Route::Kind::kRepositoryLoad;
        // Triton's unload_dependents: hearth has no ensembles, nothing depends
        // on another model.
        if (Status valid =
                CheckRepositoryControlBody(request.body(), load ? "" : "unload_dependents");
            !valid.ok()) {
          return Send(StatusResponse(valid, version, keep_alive));
        }
        return RunControl(load, route->model, version, keep_alive);
      }
      case Route::Kind::kShmRegister: {
        Result<SystemSharedMemoryRegistration> body =
            ParseSystemSharedMemoryRegisterBody(request.body());
        if (!body.ok()) return Send(StatusResponse(body.status(), version, keep_alive));
        return Send(RegistrationResponse(
            service.RegisterSystemSharedMemory(Client(), route->region, body->key, body->offset,
                                               body->byte_size),
            version, keep_alive));
      }
      case Route::Kind::kShmUnregister:
        return Send(
            EmptyOrError(service.UnregisterSystemSharedMemory(route->region), version, keep_alive));
      case Route::Kind::kShmStatus: {
        Result<std::vector<SharedMemoryRegion>> regions =
            service.SystemSharedMemoryStatus(route->region);
        if (!regions.ok()) return Send(StatusResponse(regions.status(), version, keep_alive));
        return Send(MakeResponse(http::status::ok, version, keep_alive,
                                 SystemSharedMemoryStatusJson(*regions), "application/json"));
      }
      case Route::Kind::kCudaShmRegister: {
        Result<CudaSharedMemoryRegistration> body =
            ParseCudaSharedMemoryRegisterBody(request.body());
        if (!body.ok()) return Send(StatusResponse(body.status(), version, keep_alive));
        return Send(RegistrationResponse(
            service.RegisterCudaSharedMemory(Client(), route->region, body->raw_handle,
                                             body->device_id, body->byte_size),
            version, keep_alive));
      }
      case Route::Kind::kCudaShmUnregister:
        return Send(
            EmptyOrError(service.UnregisterCudaSharedMemory(route->region), version, keep_alive));
      case Route::Kind::kCudaShmStatus: {
        Result<std::vector<CudaSharedMemoryRegion>> regions =
            service.CudaSharedMemoryStatus(route->region);
        if (!regions.ok()) return Send(StatusResponse(regions.status(), version, keep_alive));
        return Send(MakeResponse(http::status::ok, version, keep_alive,
                                 CudaSharedMemoryStatusJson(*regions), "application/json"));
      }
      case Route::Kind::kTraceSetting:
      case Route::Kind::kLogging:
        break;  // answered above
      case Route::Kind::kNone:
        break;
    }
  }

  static Response EmptyOrError(const Status& status, unsigned version, bool keep_alive) {
    if (!status.ok()) return StatusResponse(status, version, keep_alive);
    return MakeResponse(http::status::ok, version, keep_alive, "", "");
  }

  // A shared-memory registration's answer. PermissionDenied is 500 elsewhere
  // (the server's own files); here it is the client asking for memory it may
  // not name: 403.
  static Response RegistrationResponse(const Status& status, unsigned version, bool keep_alive) {
    if (status.code() == StatusCode::kPermissionDenied)
      return ErrorResponse(403, status.message(), version, keep_alive);
    return EmptyOrError(status, version, keep_alive);
  }

  // This connection's two ends, for the server to find the client's user.
  ClientConnection Client() const {
    boost::system::error_code ec;
    const tcp::endpoint peer = socket_.remote_endpoint(ec);
    if (ec) return {};
    const tcp::endpoint local = socket_.local_endpoint(ec);
    if (ec) return {};
    return {peer.address().to_string(), peer.port(), local.port()};
  }

  // Runs a repository load or unload on a thread of its own (LoadModel waits
  // for the new workers; the I/O thread serves on meanwhile) and answers it
  // on this connection's strand. The thread is detached: it touches nothing
  // of the server once its InFlightInfer is gone, and Stop() waits for that.
  void RunControl(bool load, std::string model, unsigned version, bool keep_alive) {
    if (core_->control_calls.fetch_add(1) >= kMaxControlCalls) {
      core_->control_calls.fetch_sub(1);
      return Send(ErrorResponse(503,
                                "too many repository loads and unloads at once (at most " +
                                    std::to_string(kMaxControlCalls) +
                                    "): try again when one has finished",
                                version, keep_alive));
    }
    auto in_flight = std::make_shared<InFlightInfer>(core_);
    try {
      std::thread([self = shared_from_this(), load, model = std::move(model), version, keep_alive,
                   in_flight]() mutable {
        Status status;
        try {
          status = load ? self->core_->service->LoadModel(model)
                        : self->core_->service->UnloadModel(model);
        } catch (const std::exception& e) {
          status = Internal(std::string("repository control failed: ") + e.what());
        }
        self->core_->control_calls.fetch_sub(1);
        {
          auto executor = self->executor();
          net::post(executor,
                    [self = std::move(self), status = std::move(status), version, keep_alive]() {
                      self->Send(EmptyOrError(status, version, keep_alive));
                    });
        }
        in_flight.reset();
      }).detach();
    } catch (const std::system_error& e) {
      core_->control_calls.fetch_sub(1);
      return Send(ErrorResponse(503, std::string("cannot start a thread: ") + e.what(), version,
                                keep_alive));
    }
  }

  void StartInfer(Request request, const Route& route) {
    const unsigned version = request.version();
    const bool keep_alive = request.keep_alive();
    std::optional<uint64_t> json_length;
    if (const auto it = request.find("Inference-Header-Content-Length"); it != request.end()) {
      Result<uint64_t> parsed = ParseJsonLength(it->value());
      if (!parsed.ok()) return Send(StatusResponse(parsed.status(), version, keep_alive));
      json_length = *parsed;
    }
    // The body moves into the parsed request: its binary inputs are views
    // into it, which keep it alive until the service is done with them.
    Result<InferRequest> infer =
        ParseInferRequest(std::move(request.body()), json_length, route.model, route.version);
    request = {};
    if (!infer.ok()) return Send(StatusResponse(infer.status(), version, keep_alive));
    Result<ModelMetadata> metadata = core_->service->Metadata(route.model, route.version);
    if (!metadata.ok()) return Send(StatusResponse(metadata.status(), version, keep_alive));
    if (Status valid = ValidateInferRequest(*infer, *metadata); !valid.ok()) {
      return Send(StatusResponse(valid, version, keep_alive));
    }
    OutputSelection selection = SelectionOf(*infer);
    Submit(
        std::move(*infer),
        [selection = std::move(selection), version,
         keep_alive](const Result<InferResponse>& result) {
          return InferResponseMessage(result, selection, version, keep_alive);
        },
        version, keep_alive);
  }

  // Makes the response of a request that ends with one answer (`encode`
  // builds it from the service's result), and sends it. With
  // infer.cancelled set, the socket is watched meanwhile (Watch): a client
  // that goes away cancels the request.
  using Encode = std::function<Response(const Result<InferResponse>&)>;
  void Submit(InferRequest infer, Encode encode, unsigned version, bool keep_alive) {
    if (infer.cancelled != nullptr) {
      cancel_ = infer.cancelled;
      Watch();
    }
    auto in_flight = std::make_shared<InFlightInfer>(core_);
    // `done` may run on any thread, even inside Infer. The outputs it gets
    // may be borrowed from the service (the worker's slot) and valid only
    // until it returns: `encode` turns them into the response body right
    // there, one copy, and only the finished response moves onto this
    // connection's strand.
    core_->service->Infer(std::move(infer), [self = shared_from_this(), encode = std::move(encode),
                                             version, keep_alive, in_flight = std::move(in_flight)](
                                                Result<InferResponse> result) mutable {
      if (self == nullptr) return;  // a second call, against the contract
      std::optional<Response> response;
      try {
        response = encode(result);
      } catch (const std::exception& e) {
        // Out of memory: answered below without a body built here. Nothing
        // may throw into the service's thread.
        spdlog::error("http: encoding a response failed: {}", e.what());
      }
      {
        // Scoped: the executor's copy must be gone, like everything of
        // the I/O context's, before in_flight lets Stop() destroy it.
        auto executor = self->executor();
        net::post(executor, [self = std::move(self), response = std::move(response), version,
                             keep_alive]() mutable {
          if (!response.has_value()) {
            return self->Send(ErrorResponse(500, "internal error: cannot encode the response",
                                            version, keep_alive));
          }
          self->Send(std::move(*response));
        });
      }
      in_flight.reset();  // after the post: the I/O context may go now
    });
  }

  // ---- the generate extension and the OpenAI-compatible endpoints ----------

  void StartGenerate(Request request, const Route& route, bool stream) {
    const unsigned version = request.version();
    const bool keep_alive = request.keep_alive();
    Result<ModelMetadata> metadata = core_->service->Metadata(route.model, route.version);
    if (!metadata.ok()) return Send(StatusResponse(metadata.status(), version, keep_alive));
    Result<InferRequest> infer = ParseGenerateRequest(request.body(), *metadata, route.version);
    request = {};
    ReleaseBody();  // parsed: nothing refers to the body any more
    if (!infer.ok()) return Send(StatusResponse(infer.status(), version, keep_alive));
    std::string id = infer->id;
    if (stream) {
      return StartStream(std::move(*infer), std::make_unique<GenerateStreamCodec>(std::move(id)),
                         metadata->decoupled, version, keep_alive);
    }
    // A decoupled model's pieces are joined by the service: no on_response.
    infer->cancelled = std::make_shared<std::atomic<bool>>(false);
    Submit(
        std::move(*infer),
        [id = std::move(id), version, keep_alive](const Result<InferResponse>& result) {
          if (!result.ok()) return StatusResponse(result.status(), version, keep_alive);
          Result<std::string> body = GenerateResponseJson(*result, id);
          if (!body.ok()) return StatusResponse(body.status(), version, keep_alive);
          return MakeResponse(http::status::ok, version, keep_alive, std::move(*body),
                              "application/json");
        },
        version, keep_alive);
  }

  void StartOpenAi(Request request, OpenAiEndpoint endpoint) {
    const unsigned version = request.version();
    const bool keep_alive = request.keep_alive();
    std::string param;
    Result<OpenAiRequest> parsed = ParseOpenAiRequest(request.body(), endpoint, &param);
    request = {};
    ReleaseBody();
    if (!parsed.ok()) {
      return Send(OpenAiErrorResponse(OpenAiErrorFor(parsed.status(), param), version, keep_alive));
    }
    Result<ModelMetadata> metadata = core_->service->Metadata(parsed->model, "");
    if (!metadata.ok()) {
      return Send(
          OpenAiErrorResponse(OpenAiErrorFor(metadata.status(), "model"), version, keep_alive));
    }
    std::string id = NewCompletionId(endpoint);
    Result<InferRequest> infer = OpenAiInferRequest(*parsed, *metadata, id);
    if (!infer.ok()) {
      return Send(
          OpenAiErrorResponse(OpenAiErrorFor(infer.status(), "model"), version, keep_alive));
    }
    const auto created = static_cast<int64_t>(std::time(nullptr));
    if (parsed->stream) {
      return StartStream(std::move(*infer),
                         std::make_unique<OpenAiStreamCodec>(*parsed, std::move(id), created),
                         metadata->decoupled, version, keep_alive);
    }
    infer->cancelled = std::make_shared<std::atomic<bool>>(false);
    auto completion = std::make_shared<OpenAiCompletion>(*parsed, std::move(id), created);
    Submit(
        std::move(*infer),
        [completion = std::move(completion), version,
         keep_alive](const Result<InferResponse>& result) {
          if (!result.ok()) {
            return OpenAiErrorResponse(OpenAiErrorFor(result.status()), version, keep_alive);
          }
          Result<std::string> body = completion->Answer(*result);
          if (!body.ok()) {
            return OpenAiErrorResponse(OpenAiErrorFor(body.status()), version, keep_alive);
          }
          return MakeResponse(http::status::ok, version, keep_alive, std::move(*body),
                              "application/json");
        },
        version, keep_alive);
  }

  // ---- streams: server-sent events, in order, on this strand --------------
  //
  // A stream's head waits for its first event, so that a request that fails
  // before any response (a full queue, a timeout) gets a plain error
  // response with its status. Each response is encoded on the service's
  // thread (its outputs may be borrowed) into events, framed as a chunk, and
  // posted here; the bytes posted and not yet written are bounded by
  // max_stream_buffer_bytes: past it, on_response returns false and the
  // stream ends with an error event. Writes go out one at a time (what
  // queued meanwhile goes in the next), each under the write deadline.

  void StartStream(InferRequest infer, std::unique_ptr<StreamCodec> codec, bool decoupled,
                   unsigned version, bool keep_alive) {
    auto channel = std::make_shared<StreamChannel>();
    channel->core = core_;
    channel->session = shared_from_this();
    channel->codec = std::move(codec);
    channel->version = version;
    channel->chunked = version >= 11;
    channel->keep_alive = keep_alive && channel->chunked;
    channel->limit = core_->options.max_stream_buffer_bytes;
    infer.cancelled = std::make_shared<std::atomic<bool>>(false);
    // A model that is not decoupled answers once, through `done`: one event.
    if (decoupled) {
      infer.on_response = [channel](const InferResponse& response) {
        return OnStreamResponse(*channel, response);
      };
    }
    stream_ = channel;
    cancel_ = infer.cancelled;
    phase_ = Phase::kStreaming;
    Watch();
    auto in_flight = std::make_shared<InFlightInfer>(core_);
    core_->service->Infer(
        std::move(infer), [channel = std::move(channel),
                           in_flight = std::move(in_flight)](Result<InferResponse> result) mutable {
          FinishChannel(*channel, result);
          in_flight.reset();  // after FinishChannel's post: the I/O context may go now
        });
  }

  // on_response, on the service's thread.
  static bool OnStreamResponse(StreamChannel& channel, const InferResponse& response) {
    if (channel.stop.load() || channel.session == nullptr) return false;
    try {
      Result<std::string> events = channel.codec->Events(response);
      if (!events.ok()) {
        channel.failure = events.status();
        channel.stop.store(true);
        return false;
      }
      if (events->empty()) return true;
      std::string framed = FrameEvents(*events, channel.chunked);
      const uint64_t size = framed.size();
      // One event of any size may wait alone; more may not pass the bound.
      const uint64_t queued = channel.queued.load();
      if (queued > 0 && queued + size > channel.limit) {
        channel.overflow.store(true);
        channel.stop.store(true);
        channel.core->stream_overflows.fetch_add(1);
        return false;
      }
      channel.queued.fetch_add(size);
      auto executor = channel.session->executor();
      net::post(executor, [session = channel.session, framed = std::move(framed), size]() mutable {
        session->StreamWrite(std::move(framed), size);
      });
      return true;
    } catch (const std::exception& e) {
      channel.failure = Internal(std::string("cannot encode a response: ") + e.what());
      channel.stop.store(true);
      return false;
    }
  }

  // `done`, on the service's thread: hands the stream's end to the strand.
  static void FinishChannel(StreamChannel& channel, const Result<InferResponse>& result) {
    std::shared_ptr<Session> session = std::move(channel.session);
    if (session == nullptr) return;  // a second call, against the contract
    std::optional<StreamEnding> ending;
    try {
      StreamEnding end;
      Status error;
      if (channel.overflow.load()) {
        error = ResourceExhausted("the client did not keep up with the stream: more than " +
                                  std::to_string(channel.limit) +
                                  " bytes of it were waiting to be sent");
      } else if (!channel.failure.ok()) {
        error = channel.failure;
      } else if (!result.ok()) {
        error = result.status();
      } else {
        Result<std::string> events = channel.codec->End(*result);
        if (events.ok()) {
          end.events = std::move(*events);
        } else {
          error = events.status();
        }
      }
      if (!error.ok()) {
        end.events = channel.codec->ErrorEvent(error);
        end.error_response =
            channel.codec->ErrorMessage(error, channel.version, channel.keep_alive);
      }
      ending = std::move(end);
    } catch (const std::exception& e) {
      spdlog::error("http: ending a stream failed: {}", e.what());  // the connection closes
    }
    auto executor = session->executor();
    net::post(executor, [session = std::move(session), ending = std::move(ending)]() mutable {
      session->StreamFinished(std::move(ending));
    });
  }

  void StreamWrite(std::string framed, uint64_t counted) {
    if (closed_ || stream_ == nullptr) return;
    if (!stream_started_) BeginStream();
    stream_out_.push_back({std::move(framed), counted});
    PumpStream();
  }

  void BeginStream() {
    stream_started_ = true;
    core_->streams.fetch_add(1);
    stream_closes_ = !stream_->keep_alive || core_->stopping.load();
    std::string head = stream_->version >= 11 ? "HTTP/1.1 200 OK\r\n" : "HTTP/1.0 200 OK\r\n";
    head += "Server: hearth\r\nContent-Type: ";
    head += kEventStreamType;
    head += "\r\nCache-Control: no-cache\r\n";
    if (stream_->chunked) head += "Transfer-Encoding: chunked\r\n";
    if (stream_closes_) head += "Connection: close\r\n";
    head += "\r\n";
    stream_out_.push_back({std::move(head), 0});
  }

  void StreamFinished(std::optional<StreamEnding> ending) {
    if (closed_ || stream_ == nullptr) return;
    if (!ending.has_value()) return Close();
    if (!stream_started_ && ending->error_response.has_value()) {
      EndStreamState();
      return Send(std::move(*ending->error_response));
    }
    if (!stream_started_) BeginStream();
    if (!ending->events.empty()) {
      stream_out_.push_back({FrameEvents(ending->events, stream_->chunked), 0});
    }
    if (stream_->chunked) stream_out_.push_back({std::string(kLastChunk), 0});
    stream_ending_ = true;
    PumpStream();
  }

  void PumpStream() {
    if (stream_writing_ || closed_) return;
    if (stream_out_.empty()) {
      if (stream_ending_) FinishStream();
      return;
    }
    writing_.clear();
    writing_counted_ = 0;
    for (PendingBytes& pending : stream_out_) {
      if (writing_.empty()) {
        writing_ = std::move(pending.bytes);
      } else {
        writing_ += pending.bytes;
      }
      writing_counted_ += pending.counted;
    }
    stream_out_.clear();
    stream_writing_ = true;
    Arm(core_->options.idle_timeout, Deadline::kWrite);
    net::async_write(
        socket_, net::buffer(writing_),
        [self = shared_from_this()](beast::error_code ec, size_t) { self->OnStreamWritten(ec); });
  }

  void OnStreamWritten(beast::error_code ec) {
    stream_writing_ = false;
    if (stream_ != nullptr) stream_->queued.fetch_sub(writing_counted_);
    writing_counted_ = 0;
    if (ec || closed_) return Close();
    Disarm();
    PumpStream();
  }

  // The stream's last bytes are written: the request is over.
  void FinishStream() {
    const bool close = stream_closes_ || core_->stopping.load() || peer_eof_;
    EndStreamState();
    writing_ = std::string();
    ReleaseBody();
    EndRequest();
    AfterWatch(close ? Next::kLinger : Next::kReadHead);
  }

  void EndStreamState() {
    if (stream_started_) core_->streams.fetch_sub(1);
    stream_started_ = false;
    stream_ending_ = false;
    stream_closes_ = false;
    stream_.reset();
    cancel_.reset();
    stream_out_.clear();
  }

  // ---- watching for a client that goes away ------------------------------
  //
  // While a generate or OpenAI request runs, a read is kept pending on the
  // socket: it ends with EOF or an error when the client closes, which
  // cancels the request (and stops its stream). Bytes that arrive meanwhile
  // (the next, pipelined request) are kept for the next head; once
  // kReadBufferBytes wait there, the watch stops, and a client that goes
  // away then shows as a failed write. A client that half-closes (EOF) is
  // cancelled too, but whatever is then written still goes to it.

  void Watch() {
    if (watching_ || closed_ || peer_eof_) return;
    const size_t room = buffer_.max_size() - buffer_.size();
    if (room == 0) return;
    watching_ = true;
    socket_.async_read_some(buffer_.prepare(std::min<size_t>(room, 4096)),
                            [self = shared_from_this()](beast::error_code ec, size_t bytes) {
                              self->OnWatch(ec, bytes);
                            });
  }

  void OnWatch(beast::error_code ec, size_t bytes) {
    watching_ = false;
    if (closed_) return;
    if (!ec) buffer_.commit(bytes);
    if (after_watch_.has_value()) {
      // The request is over, and AfterWatch cancelled this read. An EOF or
      // error that came instead is seen again by the next read.
      const Next next = *after_watch_;
      after_watch_.reset();
      return Proceed(next);
    }
    if (!ec) return Watch();
    if (cancel_ != nullptr) cancel_->store(true);
    if (stream_ != nullptr) stream_->stop.store(true);
    if (ec == net::error::eof) {
      peer_eof_ = true;
      return;
    }
    Close();
  }

  // Ends the watch, if one is pending, then goes on with `next`.
  void AfterWatch(Next next) {
    if (!watching_) return Proceed(next);
    after_watch_ = next;
    beast::error_code ignored;
    socket_.cancel(ignored);  // nothing else is pending on the socket now
  }

  void Proceed(Next next) {
    if (next == Next::kReadHead) return ReadHead();
    LingeringClose();
  }

  // The HTTP response to an infer; reads the outputs' bytes, so it runs
  // inside `done`.
  static Response InferResponseMessage(const Result<InferResponse>& result,
                                       const OutputSelection& selection, unsigned version,
                                       bool keep_alive) {
    if (!result.ok()) return StatusResponse(result.status(), version, keep_alive);
    Result<EncodedInferResponse> encoded = EncodeInferResponse(*result, selection);
    if (!encoded.ok()) return StatusResponse(encoded.status(), version, keep_alive);
    const bool binary = encoded->json_length.has_value();
    Response response =
        MakeResponse(http::status::ok, version, keep_alive, std::move(encoded->body),
                     binary ? "application/octet-stream" : "application/json");
    if (binary) {
      response.set("Inference-Header-Content-Length", std::to_string(*encoded->json_length));
    }
    return response;
  }

  // ---- responses and closing -----------------------------------------------

  void Send(Response response) {
    if (closed_) return;
    if (response_coding_ != BodyCoding::kIdentity) {
      const BodyCoding coding = response_coding_;
      response_coding_ = BodyCoding::kIdentity;
      const size_t size = response.body().size();
      // Small bodies gain nothing; zlib takes at most 4 GiB at once.
      if (size >= kCompressMinBytes && size <= kCompressMaxBytes) {
        Result<std::string> compressed = Deflate(response.body(), coding);
        if (compressed.ok()) {
          response.body() = std::move(*compressed);
          response.set(http::field::content_encoding,
                       coding == BodyCoding::kGzip ? "gzip" : "deflate");
          response.prepare_payload();
        }
      }
    }
    if (head_) {
      // The head GET would have, Content-Length included, and no body.
      head_ = false;
      const size_t length = response.body().size();
      response.body().clear();
      response.content_length(length);
    }
    // Draining: this answer is the connection's last.
    if (core_->stopping.load() && response.keep_alive()) response.keep_alive(false);
    phase_ = Phase::kWriting;
    response_ = std::make_unique<Response>(std::move(response));
    Arm(core_->options.idle_timeout, Deadline::kWrite);
    http::async_write(socket_, *response_,
                      beast::bind_front_handler(&Session::OnWrite, shared_from_this()));
  }

  void OnWrite(beast::error_code ec, size_t /*bytes*/) {
    const bool close = response_->need_eof() || peer_eof_;
    response_.reset();
    ReleaseBody();
    EndRequest();
    cancel_.reset();
    if (ec) return Close();
    AfterWatch(close ? Next::kLinger : Next::kReadHead);
  }

  // Half-closes, then reads and discards what the client still sends until it
  // closes too (or kLingerTime passes): closing with unread bytes would reset
  // the connection.
  void LingeringClose() {
    phase_ = Phase::kLingering;
    silent_since_.store(0, std::memory_order_relaxed);
    ReleaseBody();
    EndRequest();
    fin_sent_ = true;
    beast::error_code ignored;
    socket_.shutdown(tcp::socket::shutdown_send, ignored);
    Arm(kLingerTime, Deadline::kLinger);
    Drain();
  }

  void Drain() {
    socket_.async_read_some(net::buffer(drain_),
                            [self = shared_from_this()](beast::error_code ec, size_t) {
                              if (ec) return self->Close();
                              self->Drain();
                            });
  }

  void Close() {
    if (closed_) return;
    closed_ = true;
    phase_ = Phase::kClosed;
    // A request still running has no client now.
    if (cancel_ != nullptr) cancel_->store(true);
    if (stream_ != nullptr) stream_->stop.store(true);
    if (stream_started_) {
      stream_started_ = false;
      core_->streams.fetch_sub(1);
    }
    silent_since_.store(0, std::memory_order_relaxed);
    Disarm();
    ReleaseBody();
    EndRequest();
    beast::error_code ignored;
    socket_.shutdown(tcp::socket::shutdown_both, ignored);
    socket_.close(ignored);
  }

  tcp::socket socket_;
  net::steady_timer timer_;
  ServerCore* const core_;
  const uint64_t id_;  // in core_->sessions and as the budget's holder
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  std::string body_;  // a large body being read directly
  uint64_t body_length_ = 0;
  uint64_t progress_mark_ = 0;  // body bytes when the body deadline was last armed
  uint64_t held_ = 0;           // budget bytes taken for this request
  uint64_t timer_generation_ = 0;
  Clock::time_point idle_since_{};  // when it last began waiting for a head
  Phase phase_ = Phase::kIdle;
  Then then_ = Then::kReadParsed;
  bool first_request_ = true;
  bool busy_ = false;
  bool waiting_ = false;  // in the budget's queue
  bool expect_continue_ = false;
  bool head_ = false;  // the request being answered is a HEAD
  // Accept-Encoding of the request being answered: Send compresses in it.
  BodyCoding response_coding_ = BodyCoding::kIdentity;
  // A compressed body waiting for the budget to take its inflated size.
  std::optional<Request> inflating_;
  BodyCoding inflate_coding_ = BodyCoding::kIdentity;
  uint64_t inflate_size_ = 0;
  bool continue_sent_ = false;
  bool fin_sent_ = false;
  bool closed_ = false;
  // Written on the strand, read by the acceptor (silence()).
  std::atomic<int64_t> silent_since_{0};
  std::atomic<bool> kept_alive_{false};
  char peek_ = 0;
  std::optional<http::response<http::empty_body>> continue_;
  std::unique_ptr<Response> response_;
  std::array<char, 4096> drain_{};

  // The request running now, if it is a generate or OpenAI one: set true
  // when its client goes away.
  std::shared_ptr<std::atomic<bool>> cancel_;
  bool watching_ = false;            // Watch's read is pending
  std::optional<Next> after_watch_;  // the request is over: what follows the watch
  bool peer_eof_ = false;            // the client closed its end
  // The stream being written, if any (its channel), and its state here.
  std::shared_ptr<StreamChannel> stream_;
  struct PendingBytes {
    std::string bytes;
    uint64_t counted;  // toward the channel's bound (the head and the end do not count)
  };
  std::deque<PendingBytes> stream_out_;  // framed, waiting for the write in progress
  std::string writing_;                  // the write in progress
  uint64_t writing_counted_ = 0;
  bool stream_started_ = false;  // the head is queued or sent
  bool stream_writing_ = false;
  bool stream_ending_ = false;  // the end is queued: the request is over once it is written
  bool stream_closes_ = false;  // the head said Connection: close
};

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

// Accepts connections, evicts silent ones at the limit, drains on Stop(), and
// runs the I/O threads.
class Listener {
 public:
  Listener(InferenceService* service, HttpOptions options)
      : core_(service, std::move(options)),
        runtime_(std::make_unique<Runtime>(core_.options.threads)) {
    core_.wake_acceptor = [this] {
      net::post(runtime_->acceptor.get_executor(), [this] { ResumeAccepting(); });
    };
  }

  ~Listener() { Stop(); }

  Status Start() {
    if (started_) return FailedPrecondition("HttpServer::Start called twice");
    started_ = true;
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

  void Stop() {
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
  }

  uint16_t port() const { return port_; }
  HttpStats stats() const { return core_.Stats(); }

 private:
  // The connections the descriptor limit leaves room for: the soft
  // RLIMIT_NOFILE, less the descriptors open now (the store, the workers'
  // sockets and memfds, the listening socket, the I/O context's own) and
  // the reserve for the rest of the server.
  Result<uint64_t> ConnectionLimit() const {
    const HttpOptions& options = core_.options;
    const auto wanted = static_cast<uint64_t>(options.max_connections);
    rlimit rl{};
    if (::getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY) return wanted;
    const auto soft = static_cast<uint64_t>(rl.rlim_cur);
    const uint64_t open = OpenDescriptors();
    const auto reserved = static_cast<uint64_t>(options.reserved_descriptors);
    const uint64_t room = soft > open + reserved ? soft - open - reserved : 0;
    const std::string why = "the descriptor limit (RLIMIT_NOFILE) is " + std::to_string(soft) +
                            ", " + std::to_string(open) + " descriptors are open and " +
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

  void RunIo() {
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

  void WaitForConnection() {
    if (waiting_ || !runtime_->acceptor.is_open()) return;
    waiting_ = true;
    runtime_->acceptor.async_wait(tcp::acceptor::wait_read, [this](beast::error_code ec) {
      waiting_ = false;
      if (ec || !runtime_->acceptor.is_open()) return;
      AcceptReady();
    });
  }

  void AcceptReady() {
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
            error == ENOPROTOOPT || error == EHOSTDOWN || error == ENONET ||
            error == EHOSTUNREACH || error == EOPNOTSUPP || error == ENETUNREACH ||
            error == EPERM) {
          continue;
        }
        return AcceptFailed(error);
      }
      backoff_ = kAcceptBackoffFirst;
      OpenSession(fd);
    }
    paused_for_limit_ = false;
    UpdatePaused();
    WaitForConnection();
  }

  void OpenSession(int fd) {
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
  void AcceptFailed(int error) {
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
  bool BacklogWaiting() const {
    pollfd fd{runtime_->acceptor.native_handle(), POLLIN, 0};
    return ::poll(&fd, 1, 0) > 0 && (fd.revents & POLLIN) != 0;
  }

  // At the limit, with a connection waiting in the backlog: asks the
  // connection silent longest to close (see kEvictGrace), one at a time; its
  // close (or its refusal, once bytes arrived) resumes accepting. With none
  // silent long enough yet, looks again when the first will be; with none at
  // all, accepting resumes when a connection closes. O(connections), and only
  // at the limit.
  void MakeRoom() {
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

  void LogEviction(bool kept_alive) {
    ++evictions_since_log_;
    const Clock::time_point now = Clock::now();
    if (now - last_evict_log_ < kAcceptLogInterval) return;
    spdlog::warn(
        "http: at the connection limit ({}) with connections waiting: closing a connection {} "
        "to accept one ({} so far, {} since the last message)",
        core_.connection_limit.load(),
        kept_alive ? "idle between requests" : "that has sent nothing",
        core_.connections_evicted.load() + 1, evictions_since_log_);
    last_evict_log_ = now;
    evictions_since_log_ = 0;
  }

  // A connection closed: below the limit again, and a descriptor is free.
  // Also an evicted connection that refused (see Session::Evict).
  void ResumeAccepting() {
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

  void UpdatePaused() { core_.accept_paused.store(paused_for_limit_ || backing_off_); }

  // ---- draining ------------------------------------------------------------

  // Takes the connections that completed their handshake before the drain
  // began (closing the listener would reset them), then closes it. listen()
  // with a backlog of 0 first, so that hardly any complete meanwhile: their
  // SYNs are dropped, and the clients' retries find the port closed, before
  // they have sent anything.
  void CloseListener() {
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
  bool WaitUntil(Clock::time_point deadline, Predicate done) {
    std::unique_lock lock(core_.mutex);
    return core_.changed.wait_until(lock, deadline, done);
  }

  void ForEachSession(void (Session::*what)()) {
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

  void Drain(Clock::time_point deadline) {
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

  // The I/O context and what runs on it. Stop() destroys it after joining the
  // threads, which destroys the pending handlers and with them every session
  // and connection.
  struct Runtime {
    explicit Runtime(int threads)
        : io(threads),
          acceptor(net::make_strand(io)),
          accept_retry(acceptor.get_executor()),
          evict_retry(acceptor.get_executor()),
          work(net::make_work_guard(io)) {}
    net::io_context io;      // first: outlives the objects that use it
    tcp::acceptor acceptor;  // its handlers run on its own strand
    net::steady_timer accept_retry;
    net::steady_timer evict_retry;  // MakeRoom's next look
    net::executor_work_guard<net::io_context::executor_type> work;
  };

  ServerCore core_;  // outlives runtime_: handlers destroyed with it may refer to it
  std::unique_ptr<Runtime> runtime_;
  std::vector<std::thread> threads_;
  tcp protocol_ = tcp::v4();
  uint16_t port_ = 0;
  bool started_ = false;
  bool stopped_ = false;
  // The acceptor's state, touched on its strand only (and by Start before
  // the threads run).
  bool waiting_ = false;  // an async_wait is pending
  bool paused_for_limit_ = false;
  bool backing_off_ = false;
  bool draining_ = false;
  bool evicting_ = false;  // an eviction was asked for and has not closed or refused
  uint64_t evictions_since_log_ = 0;
  Clock::time_point last_evict_log_{};
  uint64_t drain_connection_limit_ = 0;
  std::chrono::milliseconds backoff_ = kAcceptBackoffFirst;
  Clock::time_point last_accept_log_{};
  uint64_t suppressed_accept_errors_ = 0;
};

}  // namespace hearth::rest

namespace hearth {

class HttpServer::Impl : public rest::Listener {
 public:
  using Listener::Listener;
};

HttpServer::HttpServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

HttpServer::~HttpServer() = default;

Result<std::unique_ptr<HttpServer>> HttpServer::Create(InferenceService* service,
                                                       HttpOptions options) {
  if (service == nullptr) return InvalidArgument("HttpServer needs a service");
  if (options.threads < 1 || options.threads > 1024) {
    return InvalidArgument("HttpOptions.threads must be 1..1024, got " +
                           std::to_string(options.threads));
  }
  if (options.max_body_bytes == 0) return InvalidArgument("HttpOptions.max_body_bytes is 0");
  if (options.max_inflight_bytes == 0) {
    return InvalidArgument("HttpOptions.max_inflight_bytes is 0");
  }
  if (options.max_stream_buffer_bytes == 0) {
    return InvalidArgument("HttpOptions.max_stream_buffer_bytes is 0");
  }
  if (options.max_connections < 1) {
    return InvalidArgument("HttpOptions.max_connections must be at least 1, got " +
                           std::to_string(options.max_connections));
  }
  if (options.reserved_descriptors < 0) {
    return InvalidArgument("HttpOptions.reserved_descriptors must not be negative");
  }
  for (const auto& [name, value] : {std::pair{"idle_timeout", options.idle_timeout},
                                    std::pair{"head_timeout", options.head_timeout},
                                    std::pair{"body_timeout", options.body_timeout}}) {
    if (value.count() <= 0) {
      return InvalidArgument(std::string("HttpOptions.") + name + " must be positive");
    }
  }
  if (options.drain_timeout.count() < 0) {
    return InvalidArgument("HttpOptions.drain_timeout must not be negative");
  }
  return std::unique_ptr<HttpServer>(
      new HttpServer(std::make_unique<Impl>(service, std::move(options))));
}

Status HttpServer::Start() { return impl_->Start(); }

void HttpServer::Stop() { impl_->Stop(); }

uint16_t HttpServer::port() const { return impl_->port(); }

HttpStats HttpServer::stats() const { return impl_->stats(); }

}  // namespace hearth
