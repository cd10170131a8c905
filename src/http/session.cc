#include "http/session.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <boost/asio/dispatch.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/write.hpp>
#include <exception>
#include <utility>

#include "http/body_budget.h"
#include "http/kserve_codec.h"
#include "http/routes.h"
#include "http/server_core.h"

namespace hearth::rest {
namespace {

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
// Responses are compressed (when the client accepts it) from this size to
// this one.
constexpr size_t kCompressMinBytes = 1024;
constexpr size_t kCompressMaxBytes = size_t{1} << 30;

bool IsHttpParseError(const beast::error_code& ec) {
  return ec.category() == http::make_error_code(http::error::bad_method).category();
}

}  // namespace

Session::Session(tcp::socket socket, ServerCore* core)
    : socket_(std::move(socket)),
      timer_(socket_.get_executor()),
      core_(core),
      id_(core->next_session.fetch_add(1)),
      buffer_(kReadBufferBytes) {
  core_->connections.fetch_add(1);
}

Session::~Session() {
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

void Session::Start() {
  {
    std::lock_guard lock(core_->sessions_mutex);
    core_->sessions.emplace(id_, weak_from_this());
  }
  net::dispatch(socket_.get_executor(), [self = shared_from_this()] { self->ReadHead(); });
}

net::any_io_executor Session::executor() { return socket_.get_executor(); }

void Session::CloseIfIdle() {
  if (closed_ || phase_ != Phase::kIdle || fin_sent_) return;
  beast::error_code ec;
  if (buffer_.size() > 0 || socket_.available(ec) > 0) return;  // a request is arriving
  const Clock::duration idle_for = Clock::now() - idle_since_;
  if (idle_for < kDrainIdleGrace) return Arm(kDrainIdleGrace - idle_for, Deadline::kDrainIdle);
  fin_sent_ = true;
  socket_.shutdown(tcp::socket::shutdown_send, ec);
  Arm(kLingerTime, Deadline::kLinger);
}

void Session::ForceClose() { Close(); }

Session::Silence Session::silence() const {
  return {silent_since_.load(std::memory_order_relaxed),
          kept_alive_.load(std::memory_order_relaxed)};
}

void Session::Evict() {
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

// ---- deadlines: one timer, re-armed per phase --------------------------

void Session::Arm(Clock::duration after, Deadline what) {
  const uint64_t generation = ++timer_generation_;
  timer_.expires_after(after);
  timer_.async_wait([self = shared_from_this(), generation, what](beast::error_code ec) {
    if (ec || generation != self->timer_generation_) return;
    self->OnDeadline(what);
  });
}

void Session::Disarm() {
  ++timer_generation_;
  timer_.cancel();
}

void Session::OnDeadline(Deadline what) {
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

void Session::BeginRequest() {
  if (busy_) return;
  busy_ = true;
  core_->busy.fetch_add(1);
}

void Session::EndRequest() {
  if (!busy_) return;
  busy_ = false;
  core_->busy.fetch_sub(1);
  core_->Changed();
}

// Gives back every body byte this connection holds. Not while it waits for
// the budget: OnGranted gives them back if the connection closed meanwhile.
void Session::ReleaseBody() {
  if (waiting_ || held_ == 0) return;
  core_->budget.Release(id_, held_);
  held_ = 0;
}

// Takes `bytes` of the budget for this request's body, then continues with
// `then`, now or once they are free.
void Session::Take(uint64_t bytes, Then then) {
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

void Session::OnGranted(bool granted, uint64_t bytes) {
  waiting_ = false;
  if (granted) held_ += bytes;
  if (!granted || closed_) {
    ReleaseBody();
    return Close();
  }
  phase_ = Phase::kBody;
  Continue(then_);
}

void Session::Continue(Then then) {
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

void Session::ReadHead() {
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

void Session::ReadHeadSome() {
  http::async_read_some(socket_, buffer_, *parser_,
                        beast::bind_front_handler(&Session::OnHeadSome, shared_from_this()));
}

void Session::OnHeadSome(beast::error_code ec, size_t /*bytes*/) {
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

void Session::OnHeader() {
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

Response Session::TooLarge() const {
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

void Session::ReadParsed() {
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

void Session::ReadParsedSome() {
  http::async_read_some(socket_, buffer_, *parser_,
                        beast::bind_front_handler(&Session::OnParsedSome, shared_from_this()));
}

void Session::OnParsedSome(beast::error_code ec, size_t /*bytes*/) {
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

void Session::FinishParsed() {
  Request request = parser_->release();
  parser_.reset();
  Handle(std::move(request));
}

// ---- large bodies: read chunk by chunk into their final string -----------

uint64_t Session::FirstChunk() const { return std::min(kBodyChunkBytes, body_length_); }

// Waits for the body's first byte before taking any budget for it, so that
// a client that sends a head and stalls holds nothing.
void Session::AwaitChunk() {
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
void Session::ReadChunk() {
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

void Session::OnChunk() {
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

void Session::SendContinue(Then then) {
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

void Session::Handle(Request request) {
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

void Session::FinishInflate() {
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

void Session::Run(Request request) {
  const unsigned version = request.version();
  try {
    Dispatch(*this, std::move(request));
  } catch (const std::exception& e) {
    // Handlers check what they use; this catches allocation failures and
    // any service method that throws against its contract.
    spdlog::error("http: request failed: {}", e.what());
    Send(ErrorResponse(500, std::string("internal error: ") + e.what(), version, false));
  }
}

void Session::OnReadError(beast::error_code ec) {
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

ClientConnection Session::Client() const {
  boost::system::error_code ec;
  const tcp::endpoint peer = socket_.remote_endpoint(ec);
  if (ec) return {};
  const tcp::endpoint local = socket_.local_endpoint(ec);
  if (ec) return {};
  return {peer.address().to_string(), peer.port(), local.port()};
}

void Session::Submit(InferRequest infer, Encode encode, unsigned version, bool keep_alive) {
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
  core_->service->Infer(
      std::move(infer), [self = shared_from_this(), encode = std::move(encode), version, keep_alive,
                         in_flight = std::move(in_flight)](Result<InferResponse> result) mutable {
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

void Session::StartStream(InferRequest infer, std::unique_ptr<StreamCodec> codec, bool decoupled,
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

void Session::StreamWrite(std::string framed, uint64_t counted) {
  if (closed_ || stream_ == nullptr) return;
  if (!stream_started_) BeginStream();
  stream_out_.push_back({std::move(framed), counted});
  PumpStream();
}

void Session::BeginStream() {
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

void Session::StreamFinished(std::optional<StreamEnding> ending) {
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

void Session::PumpStream() {
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

void Session::OnStreamWritten(beast::error_code ec) {
  stream_writing_ = false;
  if (stream_ != nullptr) stream_->queued.fetch_sub(writing_counted_);
  writing_counted_ = 0;
  if (ec || closed_) return Close();
  Disarm();
  PumpStream();
}

// The stream's last bytes are written: the request is over.
void Session::FinishStream() {
  const bool close = stream_closes_ || core_->stopping.load() || peer_eof_;
  EndStreamState();
  writing_ = std::string();
  ReleaseBody();
  EndRequest();
  AfterWatch(close ? Next::kLinger : Next::kReadHead);
}

void Session::EndStreamState() {
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

void Session::Watch() {
  if (watching_ || closed_ || peer_eof_) return;
  const size_t room = buffer_.max_size() - buffer_.size();
  if (room == 0) return;
  watching_ = true;
  socket_.async_read_some(buffer_.prepare(std::min<size_t>(room, 4096)),
                          [self = shared_from_this()](beast::error_code ec, size_t bytes) {
                            self->OnWatch(ec, bytes);
                          });
}

void Session::OnWatch(beast::error_code ec, size_t bytes) {
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
void Session::AfterWatch(Next next) {
  if (!watching_) return Proceed(next);
  after_watch_ = next;
  beast::error_code ignored;
  socket_.cancel(ignored);  // nothing else is pending on the socket now
}

void Session::Proceed(Next next) {
  if (next == Next::kReadHead) return ReadHead();
  LingeringClose();
}

// ---- responses and closing -----------------------------------------------

void Session::ShapeResponseFor(const Request& request) {
  head_ = request.method() == http::verb::head;
  response_coding_ = BodyCoding::kIdentity;
  if (const auto it = request.find(http::field::accept_encoding); it != request.end()) {
    response_coding_ = ChooseResponseCoding(it->value());
  }
}

void Session::Send(Response response) {
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

void Session::OnWrite(beast::error_code ec, size_t /*bytes*/) {
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
void Session::LingeringClose() {
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

void Session::Drain() {
  socket_.async_read_some(net::buffer(drain_),
                          [self = shared_from_this()](beast::error_code ec, size_t) {
                            if (ec) return self->Close();
                            self->Drain();
                          });
}

void Session::Close() {
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

}  // namespace hearth::rest
