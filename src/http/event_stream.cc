#include "http/event_stream.h"

#include <spdlog/spdlog.h>

#include <boost/asio/post.hpp>
#include <cstdio>
#include <exception>
#include <utility>

#include "http/server_core.h"
#include "http/session.h"

namespace hearth::rest {

std::string FrameEvents(std::string_view events, bool chunked) {
  if (!chunked) return std::string(events);
  char size[20];
  const int n = std::snprintf(size, sizeof(size), "%zx\r\n", events.size());
  std::string framed;
  framed.reserve(static_cast<size_t>(n) + events.size() + 2);
  framed.append(size, static_cast<size_t>(n));
  framed += events;
  framed += "\r\n";
  return framed;
}

bool OnStreamResponse(StreamChannel& channel, const InferResponse& response) {
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

void FinishChannel(StreamChannel& channel, const Result<InferResponse>& result) {
  std::shared_ptr<Session> session = std::move(channel.session);
  if (session == nullptr) return;  // a second call, against the contract
  std::optional<StreamEnding> ending;
  try {
    StreamEnding end;
    Status error;
    if (channel.overflow.load()) {
      error =
          ResourceExhausted("the client did not keep up with the stream: more than " +
                            std::to_string(channel.limit) + " bytes of it were waiting to be sent");
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
      end.error_response = channel.codec->ErrorMessage(error, channel.version, channel.keep_alive);
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

}  // namespace hearth::rest
