// HttpServer: the KServe v2 REST front-end over an InferenceService.
//
// Endpoints (see docs or kserve_codec.h for the bodies):
//   GET  /v2/health/live, /v2/health/ready          200 or 503
//   GET  /v2                                        server metadata
//   GET  /v2/models/{m}[/versions/{v}]              model metadata
//   GET  /v2/models/{m}[/versions/{v}]/ready        200, 503, 404 if unknown
//   POST /v2/models/{m}[/versions/{v}]/infer        inference
// Unknown paths are 404, a known path with the wrong method 405. Every error
// has the body {"error": "..."}.
//
// One session per connection, HTTP/1.1 keep-alive, requests on a connection
// answered in order. A connection idle for idle_timeout is closed; a body over
// max_body_bytes is answered 413 and malformed HTTP 400, and the connection is
// then closed.
//
// Ownership and threads: the server does not own `service`, which must outlive
// it. Handlers run on `threads` I/O threads; the service's methods are called
// from them concurrently, and Infer's `done` may be called from any thread.
// Start() and Stop() are not thread-safe with each other.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "hearth/status.h"
#include "server/inference_api.h"

namespace hearth {

struct HttpOptions {
  std::string host = "127.0.0.1";  // an address or a name that resolves to one
  uint16_t port = 8000;            // 0: pick a free port (port() tells which)
  int threads = 2;                 // I/O threads
  uint64_t max_body_bytes = uint64_t{64} << 20;
  // A connection with no complete request for this long is closed; also the
  // limit on writing one response.
  std::chrono::milliseconds idle_timeout{60'000};
};

class HttpServer {
 public:
  // InvalidArgument for a null service or bad options. Binds nothing yet.
  static Result<std::unique_ptr<HttpServer>> Create(InferenceService* service,
                                                    HttpOptions options);
  ~HttpServer();  // Stop()s
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Binds, listens and starts the I/O threads. Unavailable when the address
  // cannot be bound; FailedPrecondition when called twice.
  Status Start();
  // Stops accepting, answers new infer requests 503, waits until the service
  // has called `done` for every infer it was given, then stops the I/O threads
  // and closes every connection. Idempotent.
  void Stop();
  // The bound port once Start() succeeded (the chosen one for port 0), else 0.
  uint16_t port() const;

 private:
  class Impl;
  explicit HttpServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace hearth
