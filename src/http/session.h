// A connection: the transport of its requests and their responses.
#pragma once

#include <array>
#include <atomic>
#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/http.hpp>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "common/compression.h"
#include "hearth/status.h"
#include "http/event_stream.h"
#include "http/responses.h"
#include "server/inference_api.h"

namespace hearth::rest {

namespace net = boost::asio;
using tcp = net::ip::tcp;
using Clock = std::chrono::steady_clock;

struct ServerCore;

// One connection, its requests one after another. Owned by the handlers
// pending on it (its reads, writes and deadline timer), by the body budget
// while it waits there, by the infer's `done` while the service runs one,
// and by a stream's channel until its `done`; all its handlers run on the
// connection's strand.
//
// A request goes: head (ReadHead), body (parsed by Beast for small or
// chunked bodies, read chunk by chunk into the final string for large ones),
// Handle (then Dispatch, routes.h, to its endpoint's handler), Send (or a
// stream's events, then its end), then the next head or a lingering close.
// Body bytes are taken from the server's budget before they are read and
// given back once the response is written, the body is parsed (generate and
// OpenAI requests, whose bodies are not kept), or the connection closes.
//
// The listener calls Start, CloseIfIdle, ForceClose, silence and Evict; the
// endpoints' handlers, on the strand, answer with Send, Submit or
// StartStream.
class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket socket, ServerCore* core);
  ~Session();

  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  void Start();

  net::any_io_executor executor();
  ServerCore* core() const { return core_; }

  // Stop(), once the requests in progress are answered: closes the
  // connection if no request has begun on it and it has been idle for
  // kDrainIdleGrace (else it looks again then). A client between two requests
  // thus sends its next one and is answered 503 rather than meeting our FIN:
  // a request that crosses the FIN can only be read and discarded. The
  // pending head read stays as the lingering read, so that such a request is
  // never reset and the close completes on the client's EOF.
  void CloseIfIdle();

  // Stop(), at its deadline.
  void ForceClose();

  // For the acceptor's choice of a connection to evict, from any thread:
  // since when the connection has waited for a head without a byte of it
  // (nanoseconds of Clock; 0 while a request is in progress or once it
  // closes), and whether it has answered a request before. A hint only:
  // Evict() checks again on the strand.
  struct Silence {
    int64_t since = 0;
    bool kept_alive = false;
  };
  Silence silence() const;

  // The acceptor, at the limit with connections waiting: closes this one if
  // no byte of a request has arrived (its destructor then wakes the
  // acceptor), else wakes the acceptor to choose another.
  void Evict();

  // ---- for the endpoints' handlers, on the strand --------------------------

  // Send then answers `request` the way it asks: a HEAD without the body,
  // compressed in a coding its Accept-Encoding accepts.
  void ShapeResponseFor(const Request& request);

  // Answers the request being handled.
  void Send(Response response);

  // Makes the response of a request that ends with one answer (`encode`
  // builds it from the service's result), and sends it. With
  // infer.cancelled set, the socket is watched meanwhile (Watch): a client
  // that goes away cancels the request.
  using Encode = std::function<Response(const Result<InferResponse>&)>;
  void Submit(InferRequest infer, Encode encode, unsigned version, bool keep_alive);

  // Answers with a stream of server-sent events that `codec` writes (see
  // session.cc's streams section).
  void StartStream(InferRequest infer, std::unique_ptr<StreamCodec> codec, bool decoupled,
                   unsigned version, bool keep_alive);

  // Gives back every body byte this connection holds; a handler calls it once
  // it has parsed the body and keeps nothing that refers to it.
  void ReleaseBody();

  // This connection's two ends, for the server to find the client's user.
  ClientConnection Client() const;

  // ---- for a stream's channel (event_stream.h), on the strand --------------

  void StreamWrite(std::string framed, uint64_t counted);
  void StreamFinished(std::optional<StreamEnding> ending);

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

  void Arm(Clock::duration after, Deadline what);
  void Disarm();
  void OnDeadline(Deadline what);

  // ---- bookkeeping ---------------------------------------------------------

  void BeginRequest();
  void EndRequest();
  void Take(uint64_t bytes, Then then);
  void OnGranted(bool granted, uint64_t bytes);
  void Continue(Then then);

  // ---- the head ------------------------------------------------------------

  void ReadHead();
  void ReadHeadSome();
  void OnHeadSome(beast::error_code ec, size_t /*bytes*/);
  void OnHeader();
  Response TooLarge() const;

  // ---- bodies read by Beast's parser: small or chunked ---------------------

  void ReadParsed();
  void ReadParsedSome();
  void OnParsedSome(beast::error_code ec, size_t /*bytes*/);
  void FinishParsed();

  // ---- large bodies: read chunk by chunk into their final string -----------

  uint64_t FirstChunk() const;
  void AwaitChunk();
  void ReadChunk();
  void OnChunk();
  void SendContinue(Then then);

  // ---- requests ------------------------------------------------------------

  void Handle(Request request);
  void FinishInflate();
  void Run(Request request);
  void OnReadError(beast::error_code ec);

  // ---- streams: server-sent events, in order, on this strand --------------

  void BeginStream();
  void PumpStream();
  void OnStreamWritten(beast::error_code ec);
  void FinishStream();
  void EndStreamState();

  // ---- watching for a client that goes away ------------------------------

  void Watch();
  void OnWatch(beast::error_code ec, size_t bytes);
  void AfterWatch(Next next);
  void Proceed(Next next);

  // ---- responses and closing -----------------------------------------------

  void OnWrite(beast::error_code ec, size_t /*bytes*/);
  void LingeringClose();
  void Drain();
  void Close();

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

}  // namespace hearth::rest
