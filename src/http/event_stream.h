// Streams of server-sent events (generate_stream, OpenAI's "stream": true):
// what each protocol writes, how its events go on the wire, and the channel
// that carries them from the service's threads to the connection's strand.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "hearth/status.h"
#include "http/generate.h"
#include "http/kserve_codec.h"
#include "http/openai.h"
#include "http/responses.h"
#include "http/sse.h"
#include "server/inference_api.h"

namespace hearth::rest {

// What a stream writes, per protocol. Events and End run on the service's
// thread, one call at a time (on_response, then `done`), and read outputs
// that may be borrowed; the error methods run inside `done`.
class StreamCodec {
 public:
  virtual ~StreamCodec() = default;
  // The events for a response before the last; empty for none.
  virtual Result<std::string> Events(const InferResponse& response) = 0;
  // The events for the last response, and the stream's closing event if
  // the protocol has one.
  virtual Result<std::string> End(const InferResponse& response) = 0;
  // The stream broke after its head was sent: the event that says why.
  virtual std::string ErrorEvent(const Status& status) = 0;
  // It failed before anything was sent: a plain error response instead.
  virtual Response ErrorMessage(const Status& status, unsigned version, bool keep_alive) = 0;
};

// generate_stream: each response as the object generate answers with.
class GenerateStreamCodec : public StreamCodec {
 public:
  explicit GenerateStreamCodec(std::string id) : id_(std::move(id)) {}
  Result<std::string> Events(const InferResponse& response) override {
    ASSIGN_OR_RETURN(const std::string json, GenerateResponseJson(response, id_));
    return SseEvent(json);
  }
  // A stream's last response may have no outputs (the stream just ended);
  // a model that is not decoupled answers with one that has them.
  Result<std::string> End(const InferResponse& response) override {
    if (response.outputs.empty()) return std::string();
    return Events(response);
  }
  std::string ErrorEvent(const Status& status) override {
    return SseEvent(ErrorJson(status.message()));
  }
  Response ErrorMessage(const Status& status, unsigned version, bool keep_alive) override {
    return StatusResponse(status, version, keep_alive);
  }

 private:
  std::string id_;
};

// OpenAI's chunks, then [DONE].
class OpenAiStreamCodec : public StreamCodec {
 public:
  OpenAiStreamCodec(const OpenAiRequest& request, std::string id, int64_t created)
      : completion_(request, std::move(id), created) {}
  Result<std::string> Events(const InferResponse& response) override {
    return completion_.StreamEvents(response);
  }
  Result<std::string> End(const InferResponse& response) override {
    return completion_.StreamEnd(response);
  }
  std::string ErrorEvent(const Status& status) override {
    return OpenAiCompletion::StreamError(OpenAiErrorFor(status));
  }
  Response ErrorMessage(const Status& status, unsigned version, bool keep_alive) override {
    return OpenAiErrorResponse(OpenAiErrorFor(status), version, keep_alive);
  }

 private:
  OpenAiCompletion completion_;
};

// Events as they go on the wire: an HTTP/1.1 chunk each batch, or the bytes
// alone for HTTP/1.0 (whose body ends with the connection).
std::string FrameEvents(std::string_view events, bool chunked);

inline constexpr std::string_view kLastChunk = "0\r\n\r\n";

// The end of a stream, handed from `done` to the connection's strand.
struct StreamEnding {
  std::string events;  // the last events (or the error event), unframed
  // Set when the stream failed: the response to send instead when nothing
  // of the stream has been sent yet.
  std::optional<Response> error_response;
};

class Session;
struct ServerCore;

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

// on_response, on the service's thread.
bool OnStreamResponse(StreamChannel& channel, const InferResponse& response);

// `done`, on the service's thread: hands the stream's end to the strand.
void FinishChannel(StreamChannel& channel, const Result<InferResponse>& result);

}  // namespace hearth::rest
