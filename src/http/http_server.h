// HttpServer: the HTTP front-end over an InferenceService: KServe v2 REST,
// the generate extension and OpenAI-compatible endpoints.
//
// Endpoints (bodies: kserve_codec.h, generate.h, openai.h, docs/generate.md):
//   GET  /v2/health/live, /v2/health/ready          200 or 503
//   GET  /v2                                        server metadata
//   GET  /v2/models/{m}[/versions/{v}]              model metadata
//   GET  /v2/models/{m}[/versions/{v}]/ready        200, 503, 404 if unknown
//   POST /v2/models/{m}[/versions/{v}]/infer        inference
//   POST /v2/models/{m}[/versions/{v}]/generate     generate: one JSON answer
//   POST /v2/models/{m}[/versions/{v}]/generate_stream
//                                                   generate, as server-sent events
//   POST /v1/completions, /v1/chat/completions      OpenAI-compatible; "stream": true
//                                                   answers with server-sent events
//   GET  /v1/models                                 the repository's models, OpenAI's list
//   GET  /metrics                                   Prometheus text
//   GET  /v2/hearth/workers                         hearth's own: the models' worker
//                                                   processes, standbys and hot spares
//                                                   (workers_json.h)
// Triton's extensions (bodies: triton_json.h):
//   GET  /v2/models/{m}[/versions/{v}]/config       the model's config, Triton's JSON as is
//   GET  /v2/models/stats                           every model's statistics (Triton's
//                                                   route: not a model named "stats")
//   GET  /v2/models/{m}[/versions/{v}]/stats        one model's statistics
//   POST /v2/repository/index                       [{"name","version","state","reason"}];
//                                                   body empty or {"ready": bool}
//   POST /v2/repository/models/{m}/load, /unload    200, empty body; run on a thread of
//                                                   their own (at most 4 at once, then 503);
//                                                   load parameters (config, file:) are 400
//   POST /v2/systemsharedmemory/region/{r}/register {"key","offset","byte_size"}
//   POST /v2/systemsharedmemory[/region/{r}]/unregister
//   GET  /v2/systemsharedmemory[/region/{r}]/status [{"name","key","offset","byte_size"}]
//   /v2/cudasharedmemory/...                        501: not supported yet
//   GET/POST /v2/[models/{m}/]trace/setting, /v2/logging
//                                                   501: not supported yet
// In infer requests, inputs and outputs may name a region (parameters
// shared_memory_region, shared_memory_offset, shared_memory_byte_size): an
// input then has no data (its byte size is checked against its shape first),
// and an output comes back with those parameters and no data, as Triton.
// Bodies: a request body with Content-Encoding gzip or deflate (zlib format)
// is inflated, its inflated size measured first and held to max_body_bytes
// (413 past it) and to the body budget like any body; other codings are 415.
// Responses of 1 KiB or more are compressed when Accept-Encoding accepts
// gzip or deflate (gzip preferred; q=0 refuses one).
// HEAD on a GET endpoint is answered with GET's headers (Content-Length
// included) and no body; HEAD elsewhere gets the 405 without a body.
// Unknown paths are 404, a known path with the wrong method 405. Errors have
// the body {"error": "..."}, except those of the /v1 endpoints, which have
// OpenAI's {"error": {"message", "type", "param", "code"}}.
//
// Streams (generate_stream, OpenAI with "stream": true): a head with
// Content-Type: text/event-stream, Cache-Control: no-cache and chunked
// transfer encoding (HTTP/1.0: no chunks, and the connection closes at the
// end), sent with the first event, so that a request that fails before any
// response gets a plain error response; then one `data: ...\n\n` event per
// response, in order; then the end of the body, after which a kept-alive
// connection serves its next request. A stream that breaks after its head
// ends with an error event. While a generate or OpenAI request runs (streamed
// or not), a read is kept pending on its connection: when it ends with EOF or
// an error (the client went away), the request's `cancelled` is set and a
// stream's on_response returns false, so that the model stops.
//
// One session per connection, HTTP/1.1 keep-alive, requests on a connection
// answered in order. Malformed HTTP is answered 400 and a body over
// max_body_bytes (or over max_inflight_bytes) 413, and the connection is then
// closed.
//
// Limits (every resource a client can make the server hold):
// - connections: at most max_connections, and never more than the descriptor
//   limit (RLIMIT_NOFILE) leaves after the descriptors open at Start() and
//   reserved_descriptors kept for the server itself (worker restarts need a
//   socketpair, a memfd and pipes). At the limit, with a connection waiting
//   in the kernel's backlog, the server closes the connection silent longest
//   to accept it: one that has sent no byte for 100 ms since its accept, else
//   one idle between requests for 1 s (never one with a request in
//   progress); with none, it stops accepting and leaves new connections in
//   the backlog until one closes.
//   Accept errors (out of descriptors or memory) pause accepting with a
//   back-off and a rate-limited log line.
// - body bytes: bodies grow as their bytes arrive, and all connections
//   together hold at most max_inflight_bytes of them (see body_budget.h); a
//   connection whose next chunk does not fit stops reading until bytes are
//   given back. `Expect: 100-continue` is answered only when the body can
//   proceed. Bodies under 16 KiB with a Content-Length count in the budget
//   but never wait (one per connection: at most max_connections x 16 KiB
//   more), so that large bodies cannot hold up small requests.
// - stream bytes: the events of one stream encoded but not yet written
//   (a client that reads slowly) are at most max_stream_buffer_bytes (one
//   event alone may be larger); past it the request is stopped (on_response
//   returns false) and the stream ends with an error event saying so.
// - time: a request head must arrive within head_timeout (from its first
//   byte, or from the accept for a connection's first request), a body must
//   deliver each kBodyChunkBytes within body_timeout (waiting for the budget
//   does not count), a kept-alive connection may idle for idle_timeout, and
//   writing one response (or each write of a stream) may take idle_timeout.
//   Connections past a deadline are closed (a stream's request is cancelled).
//
// Ownership and threads: the server does not own `service`, which must outlive
// it. Handlers run on `threads` I/O threads; the service's methods are called
// from them concurrently, and Infer's `done` may be called from any thread.
// Start() and Stop() are not thread-safe with each other; stats() is
// thread-safe.
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
  // Body bytes held across all connections (see the header comment).
  uint64_t max_inflight_bytes = uint64_t{1} << 30;
  // Open connections; lowered at Start() to what the descriptor limit allows.
  int max_connections = 1024;
  // Descriptors kept free for the rest of the server: never used for
  // connections.
  int reserved_descriptors = 64;
  // A kept-alive connection with no request for this long is closed; also
  // the limit on writing one response.
  std::chrono::milliseconds idle_timeout{60'000};
  // The bytes of a stream's events waiting to be written (see the header
  // comment).
  uint64_t max_stream_buffer_bytes = uint64_t{1} << 20;
  // The whole request head, from its first byte.
  std::chrono::milliseconds head_timeout{10'000};
  // Each kBodyChunkBytes of a body (or its last bytes).
  std::chrono::milliseconds body_timeout{10'000};
  // Stop(): how long requests in progress and open connections get before
  // the connections are closed.
  std::chrono::milliseconds drain_timeout{20'000};
  // The name GET /v2 answers with; empty: the service's (ServerName()).
  std::string server_name;
};

// A body is read, budgeted and timed in chunks of this size.
inline constexpr uint64_t kBodyChunkBytes = uint64_t{1} << 20;

// What the front-end holds now; thread-safe snapshots for tests and /metrics.
struct HttpStats {
  bool draining = false;          // Stop() has begun
  bool listening = false;         // the listening socket is open
  uint64_t connections = 0;       // open, lingering ones included
  uint64_t requests = 0;          // from a head's first byte until its response is written
  uint64_t connection_limit = 0;  // in force (after Start)
  bool accept_paused = false;     // at the limit or backing off after an accept error
  uint64_t accept_errors = 0;     // accepts that failed for want of descriptors or memory
  uint64_t inflight_body_bytes = 0;
  uint64_t inflight_body_bytes_peak = 0;
  uint64_t inflight_body_bytes_limit = 0;
  uint64_t budget_waiting = 0;       // connections waiting for body bytes now
  uint64_t budget_waits = 0;         // times a connection had to wait
  uint64_t head_timeouts = 0;        // connections closed for a slow head
  uint64_t body_timeouts = 0;        // ... for a slow body
  uint64_t idle_timeouts = 0;        // ... for idling
  uint64_t write_timeouts = 0;       // ... for not reading their response
  uint64_t connections_evicted = 0;  // silent or idle ones closed at the limit to accept others
  uint64_t streams = 0;              // event streams being written now (their head sent)
  uint64_t stream_overflows = 0;     // streams stopped for a client that fell behind
};

class HttpServer {
 public:
  // InvalidArgument for a null service or bad options. Binds nothing yet.
  static Result<std::unique_ptr<HttpServer>> Create(InferenceService* service, HttpOptions options);
  ~HttpServer();  // Stop()s
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Binds and listens, accepting nothing yet: clients that connect wait in
  // the backlog until Start. Unavailable when the address cannot be bound;
  // FailedPrecondition when called twice. Optional: Start binds if this was
  // not called.
  Status Bind();
  // Binds (unless Bind did), listens and starts the I/O threads.
  // Unavailable when the address cannot be bound; FailedPrecondition when
  // called twice.
  Status Start();
  // Drains, then stops: stops accepting (connections already in the backlog
  // are taken and answered), lets every request whose head has arrived run
  // and be answered (with `Connection: close`), answers later requests on
  // open connections 503 with `Connection: close`, closes idle connections,
  // and closes each connection with shutdown(SHUT_WR) and a lingering read,
  // so that no client that finished sending a request sees a reset. After
  // drain_timeout the remaining connections are closed outright (and their
  // requests, streams included, cancelled). Returns once
  // the service has called `done` for every infer it was given (that wait has
  // no deadline: the service bounds its infers) and the I/O threads have
  // stopped. Idempotent.
  void Stop();
  // The bound port once Bind() or Start() succeeded (the chosen one for port
  // 0), else 0.
  uint16_t port() const;
  HttpStats stats() const;

 private:
  class Impl;
  explicit HttpServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace hearth
